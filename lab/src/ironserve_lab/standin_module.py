"""Simulated loaded nvidia kernel module for lab VM hosts, which behaves like a real one across a reboot.

The stand-in driver packages carry no kernel module (there is no GPU to drive), so a VM has none loaded. A
test that needs one touches FLAG; from then on, at every boot, ironserve-lab-nvidia-module.service (early,
before sysinit.target, as systemd-modules-load loads a real module) mounts a tmpfs over /proc/driver and
writes /proc/driver/nvidia/version in the real module's format with the version of the *installed* driver
(dpkg's nvidia-driver, else the runfile's nvidia-installer) - what a real host loads after a reboot. No
driver installed: no module. The product reads it as it reads a real one (roles/nvidia/facts.py
MODULE_VERSION_COMMAND: /sys/module/nvidia/version, which a VM lacks, else /proc/driver/nvidia/version).

`SCRIPT VERSION` "loads" an explicit version now, without a reboot: the module a host loaded at its last
boot, before a driver change. Without the flag nothing happens at boot; removing it and unmounting
/proc/driver (or rebooting) unloads the simulated module. edge.py installs and enables the unit on VMs.
"""

from __future__ import annotations

FLAG = "/etc/ironserve-lab/simulate-loaded-nvidia-module"
SCRIPT = "/usr/local/sbin/ironserve-lab-nvidia-module"
UNIT_NAME = "ironserve-lab-nvidia-module.service"
UNIT = f"/etc/systemd/system/{UNIT_NAME}"
MOUNT_SOURCE = "ironserve-simulated-module"  # the tmpfs's name in /proc/mounts

SCRIPT_TEXT = f"""\
#!/bin/sh
# ironserve lab (standin_module.py): a simulated loaded nvidia module.
# Usage: {SCRIPT} [VERSION]   (default: the installed driver's version; none installed: no module)
set -eu
version=${{1:-}}
if [ -z "$version" ]; then
    version=$(dpkg-query -W -f='${{db:Status-Abbrev}} ${{Version}}\\n' nvidia-driver 2>/dev/null \\
        | awk '$1 ~ /^[ih]i$/ {{ sub(/-[^-]*$/, "", $2); print $2 }}')
fi
if [ -z "$version" ] && command -v nvidia-installer >/dev/null 2>&1; then
    version=$(nvidia-installer --version 2>/dev/null | sed -n 's/.*version \\([0-9][0-9.]*\\).*/\\1/p' | head -n 1)
fi
if [ -z "$version" ]; then
    echo "no nvidia driver installed: no module loaded"
    exit 0
fi
mountpoint -q /proc/driver || mount -t tmpfs -o size=64k,mode=755 {MOUNT_SOURCE} /proc/driver
mkdir -p /proc/driver/nvidia
printf 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  %s  (ironserve lab: simulated)\\n' "$version" \\
    > /proc/driver/nvidia/version
printf 'GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\\n' >> /proc/driver/nvidia/version
echo "simulated nvidia module $version loaded"
"""

UNIT_TEXT = f"""\
[Unit]
Description=ironserve lab: simulated nvidia kernel module (the installed driver's version)
DefaultDependencies=no
ConditionPathExists={FLAG}
After=local-fs.target
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart={SCRIPT}

[Install]
WantedBy=sysinit.target
"""


def files() -> dict[str, tuple[str, int]]:
    """Absolute path -> (content, mode) for edge.py's archive."""
    return {SCRIPT: (SCRIPT_TEXT, 0o755), UNIT: (UNIT_TEXT, 0o644)}


ENABLE = f"systemctl enable --quiet {UNIT_NAME}"
