"""Inventory of the running local lab (`ironserve lab up`), read from the lab's state file.

Container hosts defer reboots (their kernel is the machine's); VM hosts reboot for real. Built with
`site()` like a real site's inventory: every host is validated when pyinfra loads this file.
"""

from ironserve.inventory import site
from ironserve_lab.inventory import lab_groups

_containers, _vms = lab_groups()
lab_containers = site(_containers)
lab_vms = site(_vms)
