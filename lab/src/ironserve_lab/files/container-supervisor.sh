#!/bin/sh
# Supervisor of one container lab host, started by ironserve_lab.container as
#   setsid -f unshare --mount --net --propagation private -- sh container-supervisor.sh NAME LOWER WORKDIR
# It lives in the host's own mount and network namespaces, so the overlay it mounts and the
# host's network vanish with it. It boots the host (container-boot.sh as PID 1 of a new PID
# namespace), boots it again when it reboots and exits when it powers off.
set -eu
name=$1 lower=$2 dir=$3
files=$(dirname "$(readlink -f "$0")")

mount -t overlay overlay -o "lowerdir=$lower,upperdir=$dir/upper,workdir=$dir/work" "$dir/root"
# The machine has no cgroup2 mount; this one exists only in our mount namespace. The host gets
# its own subtree so that its systemd sees (and `lab down` can kill) only its own processes.
mount -t cgroup2 cgroup2 "$dir/cgroup"
cgroup=$dir/cgroup/ironserve-lab/$name
mkdir -p "$cgroup/supervisor" "$cgroup/payload"
echo $$ >"$cgroup/supervisor/cgroup.procs"

# Hand-shake with container.start: it reads our PID, moves the host's veth into our network
# namespace, then says go. End of input (start died) ends us here.
echo $$
read -r _go
exec </dev/null >&2

while :; do
    # A fresh cgroup tree for every boot, as after a power cycle.
    find "$cgroup/payload" -mindepth 1 -depth -type d -exec rmdir {} + 2>/dev/null || true
    status=0
    # The boot process joins the payload cgroup first, so that it becomes the host's cgroup root.
    sh -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' - "$cgroup/payload" \
        env -i unshare --pid --fork --kill-child=SIGKILL --mount --uts --ipc --cgroup --propagation private \
        /bin/sh "$files/container-boot.sh" "$dir/root" "$name" || status=$?
    echo "ironserve-lab: $name init ended with status $status"
    # The kernel kills a PID namespace's init with SIGHUP when it reboots, SIGINT when it halts.
    [ "$status" -eq $((128 + 1)) ] || break
    echo "ironserve-lab: $name rebooting"
done
