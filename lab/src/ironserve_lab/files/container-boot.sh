#!/bin/sh
# PID 1 of a container lab host until it execs systemd (see container-supervisor.sh).
# Runs in the host's fresh PID, mount, UTS, IPC and cgroup namespaces; every mount made here
# dies with them. Usage: container-boot.sh ROOT HOSTNAME
set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
root=$1 name=$2

mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
# The machine's kernel settings stay its own: /proc/sys is read-only except for the host's own
# network namespace, and the files that reach hardware or the whole kernel are read-only too.
mount --bind "$root/proc/sys" "$root/proc/sys"
mount --bind "$root/proc/sys/net" "$root/proc/sys/net"
mount -o remount,bind,ro "$root/proc/sys"
for path in sysrq-trigger irq bus fs; do
    [ -e "$root/proc/$path" ] || continue
    mount --bind -o ro "$root/proc/$path" "$root/proc/$path"
done
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$root/sys/fs/cgroup"

# A /dev of its own: systemd chowns and chmods console and tty nodes, which must never be the machine's.
mount -t tmpfs -o nosuid,mode=755,size=4m tmpfs "$root/dev"
for node in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
    IFS=: read -r file major minor <<NODE
$node
NODE
    mknod -m 666 "$root/dev/$file" c "$major" "$minor"
done
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
mkdir "$root/dev/pts" "$root/dev/shm"
mount -t devpts -o newinstance,nosuid,noexec,ptmxmode=0666,mode=620,gid=5 devpts "$root/dev/pts"
ln -s pts/ptmx "$root/dev/ptmx"

# A boot ID of its own, new at every boot as nspawn does: the kernel's is the machine's, and
# "the boot ID changed" is how a reboot is told from SSH merely answering again.
cat /proc/sys/kernel/random/uuid >"$root/dev/.boot_id"
mount --bind -o ro "$root/dev/.boot_id" "$root/proc/sys/kernel/random/boot_id"
rm "$root/dev/.boot_id"

hostname "$name"
cd "$root"
pivot_root . .
umount -l .
# systemd reads its arguments as the kernel command line in a container. Masked: mounts that would
# hand the host the machine's kernel tracing and configuration interfaces.
exec env -i container=ironserve-lab /sbin/init \
    systemd.mask=sys-kernel-debug.mount systemd.mask=sys-kernel-tracing.mount \
    systemd.mask=sys-kernel-config.mount systemd.mask=sys-fs-fuse-connections.mount
