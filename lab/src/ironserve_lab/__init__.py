"""The local lab: disposable Debian 12 hosts reached over real SSH.

Two kinds of host share one state file (see `state.py`): container hosts
(`container.py`, systemd as PID 1 in its own namespaces) and VM hosts
(`vm.py`, qemu with GRUB inside the image). Hardware that cannot exist here
is described by a hardware profile (`hardware.py`) that the simulated tools read.
"""
