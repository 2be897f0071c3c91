"""The VM lab's base disk image: Debian 12 with its own kernel and GRUB, built once and cached.

The image boots like a server: BIOS -> GRUB (in the MBR gap) -> kernel from /boot,
so editing /etc/default/grub, running update-grub and rebooting really changes
/proc/cmdline. It is built without loop devices or mounts on this machine:

1. copy the debootstrapped root file system and add the lab's files to the copy;
2. `mkfs.ext4 -d` writes that tree straight into the disk file at a 1 MiB offset,
   behind an MBR partition table written here;
3. one boot of the kernel (qemu -kernel/-initrd, a setup script as PID 1) runs
   Debian's own `grub-install /dev/vda && update-grub` and powers off;
4. the raw disk becomes a qcow2 that every VM overlays.

Per-VM identity (SSH host key, root's authorised key, host name, hardware profile)
is not in the image: qemu passes it through fw_cfg and a first-boot unit installs it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ironserve.paths import cache_dir
from ironserve_lab.rootfs import cached_rootfs

PACKAGES = [
    "ca-certificates",
    "dbus",
    "grub-pc",
    "initramfs-tools",
    "iproute2",
    "kmod",
    "linux-image-amd64",
    "netbase",
    "openssh-server",
    "procps",
    "python3",
    "systemd",
    "systemd-sysv",
    "udev",
]
DISK_SIZE = 16 * 1024**3  # sparse; room for what the roles install
SECTOR = 512
ROOT_OFFSET = 1024**2  # 1 MiB: the gap before the partition holds GRUB's core.img
SETUP_TIMEOUT_S = 900
SETUP_DONE = "IRONSERVE-IMAGE-SETUP-DONE"
SETUP_SCRIPT = "/usr/local/sbin/ironserve-image-setup"
QEMU_ACCEL = ["-accel", "tcg,thread=multi,tb-size=256", "-cpu", "max"]

# The base keeps Debian's stock GRUB settings except this: a fresh older server
# boots the cgroup v1 hierarchy, so the host-tuning role's switch to v2 is a real change.
CGROUP_V1_CMDLINE = "systemd.unified_cgroup_hierarchy=0"

# Lab-only GRUB settings, kept out of /etc/default/grub so roles editing that file see
# Debian's layout. grub-mkconfig sources this after /etc/default/grub.
GRUB_LAB_CFG = """\
# ironserve lab VM: kernel and GRUB on the serial port (qemu writes it to a per-VM log),
# and no menu delay.
GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX console=tty0 console=ttyS0,115200n8"
GRUB_TERMINAL="console serial"
GRUB_SERIAL_COMMAND="serial --unit=0 --speed=115200"
GRUB_TIMEOUT=0
"""

DHCP_NETWORK = """\
[Match]
Name=en*

[Network]
DHCP=ipv4
"""

# qemu's user-mode network answers DNS at this address.
RESOLV_CONF = "nameserver 10.0.2.3\n"

SEED_SCRIPT = """\
#!/bin/sh
# Installs this VM's identity, which qemu passes as fw_cfg files (see vm.py).
set -eu
modprobe qemu_fw_cfg
src=/sys/firmware/qemu_fw_cfg/by_name/opt/ironserve
install -d -m 700 /root/.ssh
install -m 600 "$src/authorized_keys/raw" /root/.ssh/authorized_keys
# Generated on the lab machine: key generation under software emulation takes seconds.
for type in ed25519 ecdsa rsa; do
    install -m 600 "$src/ssh_host_${type}_key/raw" "/etc/ssh/ssh_host_${type}_key"
    ssh-keygen -y -f "/etc/ssh/ssh_host_${type}_key" > "/etc/ssh/ssh_host_${type}_key.pub"
done
name=$(cat "$src/hostname/raw")
echo "$name" > /etc/hostname
hostname "$name"
printf '127.0.0.1\\tlocalhost\\n127.0.1.1\\t%s\\n' "$name" > /etc/hosts
install -D -m 644 "$src/hardware.yaml/raw" /etc/ironserve-lab/hardware.yaml
touch /etc/ironserve-lab/seeded
"""

SEED_UNIT = """\
[Unit]
Description=ironserve lab: install this VM's identity from qemu fw_cfg
ConditionPathExists=!/etc/ironserve-lab/seeded
Before=ssh.service systemd-networkd.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/ironserve-lab-seed

[Install]
WantedBy=multi-user.target
"""

# Runs once as PID 1 in the build VM: GRUB can only be installed onto a real disk.
# A failure ends PID 1, the kernel panics and qemu exits without the done marker.
IMAGE_SETUP_SCRIPT = f"""\
#!/bin/sh
set -eux
# initramfs-tools usually moves these into the root already.
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
# So a later grub-pc upgrade inside the VM reinstalls GRUB without asking.
echo "grub-pc grub-pc/install_devices multiselect /dev/vda" | debconf-set-selections
grub-install --target=i386-pc /dev/vda
update-grub
rm {SETUP_SCRIPT}
sync
# This script is still open, so a plain read-only remount is refused; sysrq's is forced.
echo u > /proc/sysrq-trigger
sleep 2
echo {SETUP_DONE}
echo o > /proc/sysrq-trigger
sleep 60
"""


def _recipe_digest() -> str:
    """Everything that shapes the image, so a changed recipe builds a new image."""
    recipe = [
        PACKAGES,
        DISK_SIZE,
        ROOT_OFFSET,
        CGROUP_V1_CMDLINE,
        GRUB_LAB_CFG,
        DHCP_NETWORK,
        RESOLV_CONF,
        SEED_SCRIPT,
        SEED_UNIT,
        IMAGE_SETUP_SCRIPT,
    ]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]


def image_dir() -> Path:
    path = cache_dir() / "vm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_image() -> Path:
    """Where the base image for the current recipe lives (it may not be built yet)."""
    return image_dir() / f"base-{_recipe_digest()}.qcow2"


def base_image() -> Path:
    """Return the cached base image (qcow2), building it on first use.

    Concurrent callers wait on a lock instead of building twice.
    """
    target = cached_image()
    with open(image_dir() / ".base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        started = time.monotonic()
        rootfs = cached_rootfs("vm", PACKAGES)
        print(f"lab: building VM base image (once; cached in {image_dir()})", file=sys.stderr)
        build = image_dir() / f"build-{target.stem}"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir()
        try:
            _build(rootfs, build, target)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        # Images of older recipes: a running VM keeps its open base file even when it is deleted.
        for stale in image_dir().glob("base-*.qcow2"):
            if stale != target:
                stale.unlink()
        print(f"lab: VM base image ready in {time.monotonic() - started:.0f} s: {target}", file=sys.stderr)
        return target


def _build(rootfs: Path, build: Path, target: Path) -> None:
    tree = build / "root"
    subprocess.run(["cp", "-a", str(rootfs), str(tree)], check=True)
    (tree / ".ironserve-complete").unlink(missing_ok=True)
    fs_uuid = str(uuid.uuid4())
    _customise(tree, fs_uuid)
    kernel, initrd = _kernel_and_initrd(tree)
    shutil.copy(kernel, build / "vmlinuz")
    shutil.copy(initrd, build / "initrd.img")

    disk = build / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(DISK_SIZE)
    print("lab: writing the root file system into the disk image (mkfs.ext4 -d)", file=sys.stderr)
    subprocess.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "ironserve-root",
            "-U",
            fs_uuid,
            "-E",
            f"offset={ROOT_OFFSET}",
            "-d",
            str(tree),
            str(disk),
            f"{(DISK_SIZE - ROOT_OFFSET) // 1024}k",
        ],
        check=True,
    )
    shutil.rmtree(tree)
    _write_mbr(disk)

    print("lab: installing GRUB inside the image (one boot under qemu)", file=sys.stderr)
    log = image_dir() / "setup-console.log"  # outside the build folder: kept for post-mortems
    try:
        subprocess.run(
            [
                "qemu-system-x86_64",
                *QEMU_ACCEL,
                "-m",
                "1024",
                "-smp",
                "1",
                "-kernel",
                str(build / "vmlinuz"),
                "-initrd",
                str(build / "initrd.img"),
                "-append",
                f"root=UUID={fs_uuid} rw console=ttyS0 init={SETUP_SCRIPT} panic=-1",
                "-drive",
                f"file={disk},format=raw,if=virtio",
                "-nic",
                "none",
                "-display",
                "none",
                "-monitor",
                "none",
                "-serial",
                f"file:{log}",
                "-no-reboot",
            ],
            check=True,
            stdin=subprocess.DEVNULL,
            timeout=SETUP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as timeout:
        raise RuntimeError(f"VM image setup did not finish in {SETUP_TIMEOUT_S} s; console log: {log}") from timeout
    if SETUP_DONE not in log.read_text(errors="replace"):
        raise RuntimeError(f"VM image setup failed (grub-install/update-grub); console log: {log}")

    partial = target.with_name(target.name + ".partial")
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(disk), str(partial)], check=True)
    os.replace(partial, target)


def _customise(tree: Path, fs_uuid: str) -> None:
    """Turn the debootstrapped tree into a bootable, clonable server image."""
    (tree / "etc/fstab").write_text(f"UUID={fs_uuid} / ext4 errors=remount-ro 0 1\n")

    grub_default = tree / "etc/default/grub"
    stock = grub_default.read_text()
    edited, count = re.subn(r'^GRUB_CMDLINE_LINUX=""$', f'GRUB_CMDLINE_LINUX="{CGROUP_V1_CMDLINE}"', stock, flags=re.M)
    if count != 1:
        raise RuntimeError(f"{grub_default} does not have Debian's empty GRUB_CMDLINE_LINUX line")
    grub_default.write_text(edited)
    (tree / "etc/default/grub.d").mkdir(exist_ok=True)
    (tree / "etc/default/grub.d/ironserve-lab.cfg").write_text(GRUB_LAB_CFG)

    (tree / "etc/systemd/network/20-lab-dhcp.network").write_text(DHCP_NETWORK)
    resolv = tree / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text(RESOLV_CONF)
    (tree / "etc/hostname").write_text("ironserve-lab-vm\n")

    # Clones must not share identities: systemd makes a machine id on first boot and
    # each VM gets its own SSH host keys from the seed unit.
    (tree / "etc/machine-id").write_text("")
    dbus_machine_id = tree / "var/lib/dbus/machine-id"
    dbus_machine_id.unlink(missing_ok=True)
    dbus_machine_id.symlink_to("/etc/machine-id")
    for key in (tree / "etc/ssh").glob("ssh_host_*"):
        key.unlink()

    _install(tree / "usr/local/sbin/ironserve-lab-seed", SEED_SCRIPT, 0o755)
    _install(tree / "etc/systemd/system/ironserve-lab-seed.service", SEED_UNIT, 0o644)
    _install(tree / SETUP_SCRIPT.lstrip("/"), IMAGE_SETUP_SCRIPT, 0o755)
    subprocess.run(
        ["chroot", str(tree), "systemctl", "enable", "--quiet", "systemd-networkd", "ironserve-lab-seed"],
        check=True,
    )
    # An empty machine id means "first boot", where this unit would wait for answers on the console.
    subprocess.run(["chroot", str(tree), "systemctl", "mask", "--quiet", "systemd-firstboot"], check=True)


def _install(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _kernel_and_initrd(tree: Path) -> tuple[Path, Path]:
    kernels = sorted((tree / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise RuntimeError(f"expected one kernel in {tree / 'boot'}, found {[k.name for k in kernels]}")
    initrd = tree / "boot" / kernels[0].name.replace("vmlinuz-", "initrd.img-")
    if not initrd.exists():
        raise RuntimeError(f"no initramfs {initrd} beside the kernel")
    return kernels[0], initrd


def _write_mbr(disk: Path) -> None:
    """One bootable Linux partition from ROOT_OFFSET to the end of the disk (classic MBR)."""
    first = ROOT_OFFSET // SECTOR
    count = DISK_SIZE // SECTOR - first
    # status 0x80 = bootable; CHS fields 0xFEFFFF mean "use the LBA fields"; type 0x83 = Linux.
    entry = struct.pack("<B3sB3sII", 0x80, b"\xfe\xff\xff", 0x83, b"\xfe\xff\xff", first, count)
    with open(disk, "r+b") as f:
        f.seek(440)
        f.write(os.urandom(4) + b"\0\0" + entry + bytes(16 * 3) + b"\x55\xaa")
