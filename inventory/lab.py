"""Inventory of the running local lab (`ironserve lab up`), read from the lab's state file.

Container hosts defer reboots (their kernel is the machine's); VM hosts reboot for real.
"""

from ironserve.lab.inventory import lab_groups

lab_containers, lab_vms = lab_groups()
