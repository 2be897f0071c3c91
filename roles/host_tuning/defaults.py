"""Public API of the host_tuning role: every inventory key it reads, with its default.

Plain data only (no imports), so the configuration model can read it without importing pyinfra.
"""

DEFAULTS: dict[str, object] = {
    # Kernel parameters written to host_tuning_sysctl_file and applied live (catalog: network_tuning).
    "host_tuning_sysctls": {
        "net.core.rmem_max": 26214400,  # sysctl-rmem-max: 25 MB socket receive buffer ceiling
        "net.core.wmem_max": 26214400,  # sysctl-wmem-max: 25 MB socket send buffer ceiling
        "net.ipv4.tcp_slow_start_after_idle": 0,  # keep cwnd on idle keep-alive connections
        "net.ipv4.ip_local_port_range": "32768 60999",  # net-ip-local-port-range: never narrowed
    },
    # The file the sysctls persist in; systemd-sysctl applies it at every boot.
    "host_tuning_sysctl_file": "/etc/sysctl.d/90-ironserve.conf",
    # Arguments GRUB_CMDLINE_LINUX must carry (kernel-cgroup-v2: the unified cgroup v2 hierarchy).
    "host_tuning_kernel_args": ["systemd.unified_cgroup_hierarchy=1"],
    # auto: reboot when the running kernel lacks the arguments; defer: leave a marker; never: report only.
    "host_tuning_reboot_policy": "defer",
    # Seconds to wait for SSH to come back after a reboot under the auto policy.
    "host_tuning_reboot_timeout_s": 600,
    # NTP servers for systemd-timesyncd (kernel-time-sync); empty keeps the distribution's pool.
    "host_tuning_ntp_servers": [],
}
