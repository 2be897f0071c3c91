"""One mistaken or hostile inventory value at a time, for every key of every role: each is refused with a
ConfigError that names the key and says what is accepted (the secrets' own cases are in test_secrets.py).

Every case is the inventory data with one bad value and the essential words of its message (besides the key).
The cases are what a demanding admin tried as root on production hosts; each would otherwise have
re-owned a system directory, rewritten a system account, rebooted into a rescue shell, written a directive into
a unit file or deleted outside the model's own directory.
"""

from __future__ import annotations

import importlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from ironserve_service.artifacts import seal_model_dir

from ironserve.config import ConfigError
from ironserve.layout import role_template
from roles import check_deployable, stack_config

CGROUP = "systemd.unified_cgroup_hierarchy=1"
SYSTEM_DIR = "system directory"
OUTSIDE = "outside the directories"
NORMALISED = "accepted:"
NOT_SYSTEM_ACCOUNT = "not a system account"
ACCOUNT_TAKEN = "system account or group of the host"
NEVER_ARG = "is never accepted"
UNLISTED_ARG = "not on ironserve's list"
INTEGER = "expected a non-negative integer"
PORTS = "LOW HIGH"
CATALOG = "outside the catalog's sysctls"
CONTROL = "control"
MODEL_VERSION = "YYYYMMDD-HHMMSS"

# (key, value, essential words of the message besides the key)
Case = tuple[str, Any, tuple[str, ...]]

SECURITY: list[Case] = [
    ("security_user", "root", (ACCOUNT_TAKEN, NOT_SYSTEM_ACCOUNT)),
    ("security_user", "nobody", (ACCOUNT_TAKEN,)),
    ("security_user", "daemon", (ACCOUNT_TAKEN,)),
    ("security_user", "bin", (ACCOUNT_TAKEN,)),
    ("security_user", "sys", (ACCOUNT_TAKEN,)),
    ("security_user", "sshd", (ACCOUNT_TAKEN,)),
    ("security_user", "systemd-network", (ACCOUNT_TAKEN,)),
    ("security_user", "_apt", (ACCOUNT_TAKEN,)),
    ("security_user", "www-data", (ACCOUNT_TAKEN,)),
    ("security_user", "messagebus", (ACCOUNT_TAKEN,)),
    ("security_user", "Root", ("not a user or group name", NOT_SYSTEM_ACCOUNT)),
    ("security_user", "ai runner", ("not a user or group name",)),
    ("security_user", "ai-runner\n", ("not a user or group name",)),
    ("security_user", "1runner", ("not a user or group name",)),
    ("security_user", "a" * 33, ("at most 32",)),
    ("security_user", "ai-r\u00fcnner", ("not a user or group name",)),
    ("security_group", "root", (ACCOUNT_TAKEN,)),
    ("security_group", "sudo", (ACCOUNT_TAKEN,)),
    ("security_group", "adm", (ACCOUNT_TAKEN,)),
    ("security_group", "disk", (ACCOUNT_TAKEN,)),
    ("security_group", "shadow", (ACCOUNT_TAKEN,)),
    ("security_group", "docker", (ACCOUNT_TAKEN,)),
    ("security_group", "ai-runner\n", ("not a user or group name",)),
    ("security_shell", "/bin/bash", ("/bin/false",)),
    ("security_shell", "/bin/false\n", ("/bin/false",)),
    ("security_model_dir", "/", (SYSTEM_DIR, "/srv")),
    ("security_model_dir", "/etc", (SYSTEM_DIR,)),
    ("security_model_dir", "/var/log", (SYSTEM_DIR,)),
    ("security_model_dir", "/root", (SYSTEM_DIR,)),
    ("security_model_dir", "/srv", (SYSTEM_DIR,)),
    ("security_model_dir", "/var/lib/dpkg", (SYSTEM_DIR,)),
    ("security_model_dir", "/srv/ai/../../etc", (". or .. segment", "/srv")),
    ("security_model_dir", "/srv/./ai", (". or .. segment",)),
    ("security_model_dir", "/srv//ai", ("//",)),
    ("security_model_dir", "/srv/ai/", ("trailing slash",)),
    ("security_model_dir", "srv/ai", ("not absolute",)),
    ("security_model_dir", "/srv/ai models", ("characters outside",)),
    ("security_model_dir", "/srv/ai\n", (CONTROL,)),
    ("security_model_dir", "/home/ai", (OUTSIDE, "/srv, /opt, /var/lib")),
    ("security_model_dir", "/usr/share/models", (OUTSIDE,)),
    ("security_model_dir", "/proc/self/cwd", ("virtual filesystem",)),
    ("security_model_dir", "/var/lib/ai-service", ("overlap", "security_state_dir /var/lib/ai-service")),
    ("security_log_dir", "/var/lib/ai-service/logs", (OUTSIDE,)),
    ("security_state_dir", "/var/lib", (SYSTEM_DIR, "/var/lib")),
    ("security_state_dir", "/etc/ai-service", (OUTSIDE,)),
    ("security_state_dir", "/var/lib/systemd", (SYSTEM_DIR,)),
    ("security_state_dir", "/root/.cache", (OUTSIDE,)),
    ("security_state_dir", "/var/lib/../lib/x", (". or .. segment",)),
    ("security_state_dir", "/srv/ai/models/cache", ("security_model_dir /srv/ai/models", "separate directories")),
    ("security_log_dir", "/var/log", (SYSTEM_DIR,)),
    ("security_log_dir", "/var/log/journal", (SYSTEM_DIR,)),
    ("security_log_dir", "/var/lib/ai-logs", (OUTSIDE, "/var/log")),
    ("security_log_dir", "/var/log/ai-service/../../..", (". or .. segment",)),
    ("security_log_dir", "/var/log/ai service", ("characters outside",)),
    ("security_log_dir", "/var/log//ai", ("//",)),
    ("security_slice", "-.slice", ("systemd's own", "ai-service.slice")),
    ("security_slice", "system.slice", ("systemd's own",)),
    ("security_slice", "user.slice", ("systemd's own",)),
    ("security_slice", "machine.slice", ("systemd's own",)),
    ("security_slice", "init.scope", ("systemd's own",)),
    ("security_slice", "system-getty.slice", ("systemd's own",)),
    ("security_slice", "user-1000.slice", ("systemd's own",)),
    ("security_slice", "ai service.slice", ("not a slice name", "ai-service.slice")),
    ("security_slice", "ai-service", ("not a slice name",)),
    ("security_slice", "ai--service.slice", ("not a slice name",)),
    ("security_slice", "ai-service.slice\n", ("not a slice name",)),
    ("security_uid", 0, ("greater than or equal to 100",)),
    ("security_uid", 1000, ("less than or equal to 999",)),
    ("security_uid", "990; id", ("valid integer",)),
    ("security_gid", 65534, ("less than or equal to 999",)),
    ("security_gid", "ai-runner", ("valid integer",)),
    ("security_memory_max", "24 gigs", ("size such as 24G",)),
    ("security_memory_max", "24g", ("size such as 24G",)),
    ("security_memory_max", "0", ("size such as 24G",)),
    ("security_memory_max", "1K", ("256M to 64T",)),
    ("security_memory_max", "999999T", ("256M to 64T",)),
    ("security_memory_max", "24G\n", ("size such as 24G",)),
    ("security_memory_max", "\u0662\u0664G", ("size such as 24G",)),
    ("security_memory_max", "infinity", ("size such as 24G",)),
    ("security_cpu_weight", 0, ("greater than or equal to 1",)),
    ("security_cpu_weight", 10001, ("less than or equal to 10000",)),
    ("security_device_allow", ["/dev/sda"], ("not an NVIDIA device node", "/dev/nvidiactl")),
    ("security_device_allow", ["/dev/nvidia0/../sda"], ("not an NVIDIA device node",)),
    ("security_device_allow", ["/dev/nvidia0\n"], ("not an NVIDIA device node",)),
    ("security_device_allow", ["/dev/nvidia"], ("not an NVIDIA device node",)),
    ("security_capabilities", ["CAP_SYS_ADMIN"], ("as good as root", "CAP_SYS_NICE, CAP_IPC_LOCK")),
    ("security_capabilities", ["CAP_NET_ADMIN"], ("as good as root",)),
    ("security_capabilities", ["CAP_DAC_READ_SEARCH"], ("as good as root",)),
    ("security_capabilities", ["CAP_SETUID"], ("as good as root",)),
    ("security_capabilities", ["CAP_BPF"], ("as good as root",)),
    ("security_capabilities", ["CAP_KILL"], ("not a capability the service may hold", "CAP_NET_BIND_SERVICE")),
    ("security_capabilities", ["cap_sys_nice"], ("not a capability the service may hold",)),
    ("security_capabilities", ["CAP_SYS_NICE\n"], ("not a capability the service may hold",)),
    ("security_service_units", ["ssh.service"], ("not one of the service's units", "ai-service@.service")),
    ("security_service_units", ["sshd.service"], ("not one of the service's units",)),
    ("security_service_units", ["systemd-journald.service"], ("not one of the service's units",)),
    ("security_service_units", ["dbus.service"], ("not one of the service's units",)),
    ("security_service_units", ["getty@.service"], ("not one of the service's units",)),
    ("security_service_units", ["cron.service"], ("not one of the service's units",)),
    ("security_service_units", ["ironserve-serve.service"], ("not one of the service's units",)),
    ("security_service_units", ["ai-service.service\n"], ("not one of the service's units",)),
    ("security_service_units", ["ai-service"], ("not one of the service's units",)),
    ("security_kubelet_seccomp_dir", "/", (SYSTEM_DIR,)),
    ("security_kubelet_seccomp_dir", "/etc", (SYSTEM_DIR,)),
    ("security_kubelet_seccomp_dir", "/var/lib/kubelet/../../../etc", (". or .. segment",)),
    ("security_kubelet_seccomp_dir", "var/lib/kubelet/seccomp", ("not absolute",)),
    ("security_kubelet_seccomp_dir", "/sys/kernel", ("virtual filesystem",)),
]

RMEM = "net.core.rmem_max"
PORT_RANGE = "net.ipv4.ip_local_port_range"
HOST_TUNING: list[Case] = [
    ("host_tuning_sysctls", {RMEM: "\uff12\uff16\uff12\uff11\uff14\uff14\uff10\uff10"}, (INTEGER, "ASCII digits")),
    ("host_tuning_sysctls", {RMEM: "\u0662\u0666\u0662\u0661\u0664\u0664\u0660\u0660"}, (INTEGER,)),
    ("host_tuning_sysctls", {RMEM: "010000"}, (INTEGER, "no leading zero")),
    ("host_tuning_sysctls", {RMEM: "99999999999"}, (INTEGER, "2147483647")),
    ("host_tuning_sysctls", {RMEM: 2**40}, (INTEGER, "2147483647")),
    ("host_tuning_sysctls", {RMEM: 100}, (INTEGER, "from 4608")),
    ("host_tuning_sysctls", {RMEM: "26214400\n"}, (INTEGER,)),
    ("host_tuning_sysctls", {RMEM: " 26214400"}, (INTEGER,)),
    ("host_tuning_sysctls", {RMEM: "0x1000000"}, (INTEGER,)),
    ("host_tuning_sysctls", {RMEM: "-1"}, (INTEGER,)),
    ("host_tuning_sysctls", {RMEM: True}, ("a boolean is not a sysctl value",)),
    ("host_tuning_sysctls", {"net.ipv4.tcp_slow_start_after_idle": 2}, (INTEGER, "from 0 to 1")),
    ("host_tuning_sysctls", {PORT_RANGE: "60999 32768"}, ("1024 <= LOW < HIGH <= 65535",)),
    ("host_tuning_sysctls", {PORT_RANGE: "1023 60999"}, ("1024 <= LOW < HIGH <= 65535",)),
    ("host_tuning_sysctls", {PORT_RANGE: "32768 70000"}, ("1024 <= LOW < HIGH <= 65535",)),
    ("host_tuning_sysctls", {PORT_RANGE: "\uff13\uff12\uff17\uff16\uff18 60999"}, (PORTS,)),
    ("host_tuning_sysctls", {PORT_RANGE: "032768 60999"}, (PORTS,)),
    ("host_tuning_sysctls", {PORT_RANGE: "32768 60999\n"}, (PORTS,)),
    ("host_tuning_sysctls", {"kernel.panic": 1}, (CATALOG, "host_tuning_allow_sysctl_keys")),
    ("host_tuning_sysctls", {"net.core.somaxconn": 4096}, (CATALOG, "host_tuning_allow_sysctl_keys")),
    ("host_tuning_sysctls", {RMEM + "\n": 1}, ("not a sysctl key", "net.core.rmem_max")),
    ("host_tuning_sysctls", {"net..core": 1}, ("not a sysctl key",)),
    ("host_tuning_sysctls", {"NET.core.x": 1}, ("not a sysctl key",)),
    ("host_tuning_sysctls", {"net.ipv4.tcp_congestion_control": "bbr; reboot"}, ("single word",)),
    ("host_tuning_sysctls", {"net.core.default_qdisc": "fq\n"}, ("single word",)),
    ("host_tuning_sysctls", ["net.core.rmem_max=1"], ("mapping of sysctl key to value",)),
    ("host_tuning_allow_sysctl_keys", ["kernel.core_pattern"], ("program the kernel runs as root",)),
    ("host_tuning_allow_sysctl_keys", ["kernel.modprobe"], ("program the kernel runs as root",)),
    ("host_tuning_allow_sysctl_keys", ["net core"], ("not a sysctl key",)),
    ("host_tuning_sysctl_file", "/tmp/x.conf", ("/etc/sysctl.d", "90-ironserve.conf")),
    ("host_tuning_sysctl_file", "/etc/sysctl.d/../sysctl.conf", ("/etc/sysctl.d",)),
    ("host_tuning_sysctl_file", "/etc/sysctl.d/99-sysctl.conf", ("belongs to the distribution",)),
    ("host_tuning_sysctl_file", "/etc/sysctl.d/91-ironserve-containers.conf", ("another role",)),
    ("host_tuning_sysctl_file", "/etc/sysctl.d/x.conf\n", ("/etc/sysctl.d",)),
    ("host_tuning_sysctl_file", "/etc/sysctl.d/sub/x.conf", ("/etc/sysctl.d",)),
    ("host_tuning_kernel_args", [CGROUP, "single"], (NEVER_ARG, "iommu=pt")),
    ("host_tuning_kernel_args", [CGROUP, "rescue"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "emergency"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "S"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "1"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "init=/bin/sh"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "mem=1G"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "maxcpus=1"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "nosmp"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "root=/dev/sdb1"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "rd.break"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "rd.break=pre-mount"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "systemd.unit=rescue.target"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "rd.systemd.unit=emergency.target"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "systemd.debug_shell"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "module_blacklist=nvme"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "mitigations=off"], (NEVER_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "quiet"], (UNLISTED_ARG, "host_tuning_allow_kernel_args")),
    ("host_tuning_kernel_args", [CGROUP, "iommu=off"], (UNLISTED_ARG,)),
    ("host_tuning_kernel_args", [CGROUP, "bad arg;rm"], ("not a kernel argument",)),
    ("host_tuning_kernel_args", [CGROUP, "intel_iommu=on\n"], ("not a kernel argument",)),
    ("host_tuning_kernel_args", [CGROUP, "iommu=pt", "iommu=pt"], ("more than once",)),
    ("host_tuning_kernel_args", [], (f"must include {CGROUP}",)),
    ("host_tuning_kernel_args", ["iommu=pt"], (f"must include {CGROUP}",)),
    ("host_tuning_kernel_args", ["systemd.unified_cgroup_hierarchy=0"], (f"must include {CGROUP}",)),
    ("host_tuning_allow_kernel_args", ["init"], (NEVER_ARG,)),
    ("host_tuning_allow_kernel_args", ["single"], (NEVER_ARG,)),
    ("host_tuning_allow_kernel_args", ["systemd.unit"], (NEVER_ARG,)),
    ("host_tuning_allow_kernel_args", ["quiet=1"], ("not a kernel parameter name",)),
    ("host_tuning_ntp_servers", ["ntp1.example.internal; rm -rf /"], ("not a host name", "IP address")),
    ("host_tuning_ntp_servers", ["-ntp.example.internal"], ("not a host name",)),
    ("host_tuning_ntp_servers", ["ntp.example.internal\n"], ("not a host name",)),
    ("host_tuning_ntp_servers", ["n\u0442p.example.internal"], ("not a host name",)),
    ("host_tuning_ntp_servers", ["a" * 64 + ".example"], ("not a host name",)),
    ("host_tuning_ntp_servers", ["999.1.1.1"], ("not a host name",)),
]

CONTAINER_RUNTIME: list[Case] = [
    ("container_runtime_allow_plain_http", ["https://mirror.example:5000"], ("pattern",)),
    ("container_runtime_sandbox_image", "pause:3.10", ("not an image reference",)),
    ("container_runtime_sandbox_image", "registry.k8s.io/pause", ("not an image reference",)),
    ("container_runtime_sandbox_image", "registry.k8s.io/pause:3.10\n", ("not an image reference",)),
    ("container_runtime_registry_mirrors", {"registry.k8s.io": "mirror.example"}, ("not a mirror URL",)),
    ("container_runtime_registry_mirrors", {"https://registry.k8s.io": "https://m.example"}, ("not a registry host",)),
    ("container_runtime_registry_mirrors", {"docker.io": "https://m.example/$(id)"}, ("not a mirror URL",)),
    ("container_runtime_sysctls", {"net.ipv4.ip_forward": "on"}, (INTEGER,)),
    ("container_runtime_sysctls", {"net.ipv4.ip_forward": "2"}, (INTEGER, "from 0 to 1")),
    ("container_runtime_sysctls", {"net.ipv4.ip_forward": "01"}, (INTEGER,)),
    ("container_runtime_sysctls", {"net.bridge.bridge-nf-call-iptables": "\uff11"}, (INTEGER,)),
    ("container_runtime_sysctls", {"kernel.panic": 1}, (CATALOG, "container_runtime_allow_sysctl_keys")),
    ("container_runtime_allow_sysctl_keys", ["kernel.modprobe"], ("program the kernel runs as root",)),
    ("container_runtime_allow_sysctl_keys", ["x"], ("not a sysctl key",)),
    ("container_runtime_nvidia_binary", "nvidia-container-runtime", ("not absolute",)),
    ("container_runtime_nvidia_binary", "/usr/bin/../bin/nvidia-container-runtime", (". or .. segment",)),
    ("container_runtime_nvidia_binary", "/usr/bin/nvidia container runtime", ("characters outside",)),
    ("container_runtime_nvidia_binary", "/usr/bin", (SYSTEM_DIR,)),
    ("container_runtime_nvidia_binary", "/tmp/nvidia-container-runtime", ("NVIDIA container toolkit",)),
    ("container_runtime_nvidia_binary", "/usr/bin/runc", ("NVIDIA container toolkit", "/usr/local/nvidia/toolkit")),
    ("container_runtime_devmapper_root_path", "/var/lib/containerd", (SYSTEM_DIR,)),
    ("container_runtime_devmapper_root_path", "/var/lib/docker/devmapper", (OUTSIDE, "/var/lib/containerd")),
    ("container_runtime_devmapper_root_path", "/", (SYSTEM_DIR,)),
    ("container_runtime_devmapper_root_path", "/var/lib/containerd/../../../etc", (". or .. segment",)),
    ("container_runtime_devmapper_pool_name", "pool/../x", ("not a device-mapper name",)),
    ("container_runtime_devmapper_pool_name", "pool name", ("not a device-mapper name",)),
    ("container_runtime_devmapper_pool_name", "pool\n", ("not a device-mapper name",)),
    ("container_runtime_devmapper_base_image_size", "40 GB", ("not a size", "40GB")),
    ("container_runtime_devmapper_base_image_size", "040GB", ("not a size",)),
    ("container_runtime_devmapper_base_image_size", "9999999GB", ("not a size",)),
    ("container_runtime_devmapper_base_image_size", "40GB\n", ("not a size",)),
    ("container_runtime_cni_bin_dir", "/usr/bin", (SYSTEM_DIR, "/opt/cni")),
    ("container_runtime_cni_bin_dir", "/opt", (SYSTEM_DIR,)),
    ("container_runtime_cni_bin_dir", "/etc/cni/bin", (OUTSIDE,)),
    ("container_runtime_cni_bin_dir", "/opt/cni/../bin", (". or .. segment",)),
    ("container_runtime_cni_conf_dir", "/etc", (SYSTEM_DIR, "/etc/cni")),
    ("container_runtime_cni_conf_dir", "/etc/cni", (SYSTEM_DIR,)),
    ("container_runtime_cni_conf_dir", "/tmp/cni", (OUTSIDE,)),
    ("container_runtime_kernel_modules", ["overlay; reboot"], ("not a kernel module name", "br_netfilter")),
    ("container_runtime_kernel_modules", ["../../x"], ("not a kernel module name",)),
    ("container_runtime_kernel_modules", ["Overlay"], ("not a kernel module name",)),
    ("container_runtime_kernel_modules", ["a" * 56], ("not a kernel module name",)),
    ("container_runtime_default_runtime", "crun", ("'runc' or 'nvidia'",)),
    ("container_runtime_snapshotter", "zfs", ("'overlayfs' or 'devmapper'",)),
    ("container_runtime_packages", {"runc": "1.1.5+ds1-1+deb12u1"}, ("containerd must be listed",)),
    ("container_runtime_packages", {"containerd;rm": "1.6.20"}, ("pattern",)),
    ("container_runtime_packages", {"containerd": "1.6.20\n"}, ("pattern",)),
    ("container_runtime_swap_off", "maybe", ("valid boolean",)),
]

INFERENCE: list[Case] = [
    ("inference_mode", "k8s", ("'systemd' or 'kubernetes'",)),
    ("inference_pip_index_url", "ftp://mirror.example.internal/simple/", ("not http, https or file",)),
    ("inference_pip_index_url", "https://mirror.example.internal:99999/simple/", ("1-65535",)),
    ("inference_pip_index_url", "https://mirror.example.internal:0/simple/", ("1-65535",)),
    ("inference_pip_index_url", "http:///simple/", ("names no host",)),
    ("inference_pip_index_url", "https://mirror.example.internal/simple/\n", (CONTROL,)),
    ("inference_pip_index_url", "https://mirror.example.internal/ simple/", ("spaces",)),
    ("inference_pip_index_url", "https://m\u00efrror.example.internal/simple/", ("non-ASCII",)),
    ("inference_python", "/opt/conda/bin/python", ("distribution's Python", "/usr/bin/python3")),
    ("inference_python", "/usr/bin/python3; id", ("distribution's Python",)),
    ("inference_python", "/usr/bin/python3\n", ("distribution's Python",)),
    ("inference_python", "python3", ("distribution's Python",)),
    ("inference_listen_address", "r740-01.example.internal", ("inference_listen_address", "not an IP address")),
    ("inference_listen_address", "10.0.1.256", ("not an IP address", "serving network")),
    ("inference_listen_address", "10.0.1.11; id", ("not an IP address",)),
    ("inference_listen_address", "10.0.1.11:8080", ("not an IP address", "0.0.0.0")),
    ("inference_venv", "/", (SYSTEM_DIR, "/opt/ironserve/venv")),
    ("inference_venv", "/opt", (SYSTEM_DIR,)),
    ("inference_venv", "/opt/ironserve", (SYSTEM_DIR,)),
    ("inference_venv", "/etc/venv", (OUTSIDE,)),
    ("inference_venv", "/opt/ironserve/../../etc", (". or .. segment",)),
    ("inference_venv", "/opt/iron serve/venv", ("characters outside",)),
    ("inference_venv", "/opt/ironserve/venv/", ("trailing slash",)),
    ("inference_model_store_mount", "/", (SYSTEM_DIR, "/data")),
    ("inference_model_store_mount", "data", ("not absolute",)),
    ("inference_model_store_mount", "/home/models", (OUTSIDE,)),
    ("inference_model_store_headroom", 1.5, ("less than 1",)),
    ("inference_model_store_headroom", -0.1, ("greater than or equal to 0",)),
    ("inference_model_store_nvme", "maybe", ("valid boolean",)),
    ("inference_model_name", "../etc", ("not a model name",)),
    ("inference_model_name", "qwen 7b", ("not a model name",)),
    ("inference_model_name", "qwen%n", ("not a model name",)),
    ("inference_model_name", "qwen\n", ("not a model name",)),
    ("inference_model_name", "-qwen", ("not a model name",)),
    ("inference_model_version", "..", (MODEL_VERSION,)),
    ("inference_model_version", ".", (MODEL_VERSION,)),
    ("inference_model_version", "../../../../etc", (MODEL_VERSION,)),
    ("inference_model_version", "$(id)", (MODEL_VERSION,)),
    ("inference_model_version", "v2", (MODEL_VERSION,)),
    ("inference_model_version", "20261301-000000", ("real date and time", MODEL_VERSION)),
    ("inference_model_version", "20260101-246000", ("real date and time",)),
    ("inference_model_version", "20260101-000000\n", (MODEL_VERSION,)),
    ("inference_model_version", "20260101000000", (MODEL_VERSION,)),
    ("inference_model_version", "\uff12\uff10\uff12\uff160101-000000", (MODEL_VERSION,)),
    ("inference_models_root", "/", (SYSTEM_DIR,)),
    ("inference_models_root", "/etc", (SYSTEM_DIR,)),
    ("inference_models_root", "/srv", (SYSTEM_DIR,)),
    ("inference_models_root", "/srv/ai/../../etc", (". or .. segment",)),
    ("inference_models_root", "/home/models", (OUTSIDE,)),
    ("inference_models_root", "/srv/ai//models", ("//",)),
    ("inference_engine_environment", {"A": "x\ry"}, (CONTROL, "U+000D")),
    ("inference_engine_environment", {"A": "x\ny"}, (CONTROL, "U+000A")),
    ("inference_engine_environment", {"A": "x\0y"}, ()),  # the core refuses NUL in any value
    ("inference_engine_environment", {"A": "\x1b[31m"}, (CONTROL, "U+001B")),
    ("inference_engine_environment", {"A": "x\u202ey"}, (CONTROL, "U+202E")),
    ("inference_engine_environment", {"A": "x" * 5000}, ("longer than 4096",)),
    ("inference_engine_environment", {"lower": "1"}, ("not a variable name", "[A-Z_][A-Z0-9_]*")),
    ("inference_engine_environment", {"1A": "1"}, ("not a variable name",)),
    ("inference_engine_environment", {"A B": "1"}, ("not a variable name",)),
    ("inference_engine_environment", {"LD_PRELOAD": "/tmp/x.so"}, ("outside the locked environment",)),
    ("inference_engine_environment", {"PYTHONPATH": "/tmp"}, ("outside the locked environment",)),
    ("inference_engine_environment", {"HOME": "/root"}, ("set by the engine unit",)),
    ("inference_requirements", "/nonexistent/requirements.lock", ("not a file on this machine",)),
    ("inference_service", {"swap": {"run_dir": "/tmp/x"}}, ("which the role derives",)),
    ("inference_prometheus", "maybe", ("valid boolean",)),
]

PREFLIGHT: list[Case] = [
    ("preflight_overrides", ["psu"], ("unknown preflight check", "psu-capacity")),
    ("preflight_overrides", ["psu-capacity\n"], ("unknown preflight check",)),
    ("preflight_overrides", ["psu-capacity", "psu-capacity"], ("more than once",)),
    ("preflight_overrides", "psu-capacity", ("valid tuple",)),
    ("preflight_report_dir", "", ("is empty", "reports/preflight")),
    ("preflight_report_dir", "/", (SYSTEM_DIR,)),
    ("preflight_report_dir", "/etc", (SYSTEM_DIR,)),
    ("preflight_report_dir", "/var/log", (SYSTEM_DIR,)),
    ("preflight_report_dir", "../../etc", (". or .. segment",)),
    ("preflight_report_dir", "reports/../..", (". or .. segment",)),
    ("preflight_report_dir", "./reports", (". or .. segment",)),
    ("preflight_report_dir", "reports//x", ("//",)),
    ("preflight_report_dir", "reports\n", (CONTROL,)),
]

BIOS: list[Case] = [
    ("bios_redfish_address", "http://idrac-01", ("plain http", "bios_ca_file")),
    ("bios_redfish_address", "https://idrac-01/redfish/v1", ("base URL only",)),
    ("bios_redfish_address", "https://idr\u0430c-01", ("not ASCII", "CYRILLIC")),
    ("bios_redfish_address", "ftp://idrac-01", ("https://",)),
    ("bios_redfish_address", "https://idrac-01\n", ("control character",)),
    ("bios_mode", "Apply", ("'check' or 'apply'",)),
    ("bios_mode", "apply ", ("'check' or 'apply'",)),
    ("bios_reboot_policy", "defer", ("'auto' or 'never'",)),
    ("bios_credentials_file", "/nonexistent/idrac-credentials", ("names no file", "not shown")),
    ("bios_credentials_file", "creds\x00", ("NUL",)),
    ("bios_ca_file", "/nonexistent/idrac.pem", ("not a file",)),
    ("bios_tls_fingerprint", "abc", ("64 hex digits",)),
    ("bios_tls_fingerprint", "G" * 64, ("64 hex digits",)),
    ("bios_apply_timeout_s", 0, ("greater than 0",)),
    ("bios_apply_timeout_s", 99999, ("less than or equal to 7200",)),
    ("bios_apply_timeout_s", "900s", ("valid integer",)),
]

NVIDIA: list[Case] = [
    ("nvidia_repo_url", "https://mirror.example/cuda/", ("(https?|file)://",)),
    ("nvidia_repo_url", "mirror.example/cuda", ("(https?|file)://",)),
    ("nvidia_repo_url", "https://mirror.example/cu da", ("(https?|file)://",)),
    ("nvidia_repo_auth_file", "/nonexistent/apt-auth", ("names no file",)),
    ("nvidia_repo_key", "/nonexistent/cuda-archive-keyring.gpg", ("not a file",)),
    ("nvidia_pin_priority", 1000, ("greater than or equal to 1001",)),
    ("nvidia_pin_priority", 40000, ("less than or equal to 32767",)),
    ("nvidia_cuda_home", "/etc", ("system directory", "/usr/local")),
    ("nvidia_cuda_home", "/home/admin/cuda", ("outside the directories", "/usr/local")),
    ("nvidia_cuda_home", "/usr/local/cuda-11.8/../..", (". or .. segment",)),
    ("nvidia_cuda_home", "cuda", ("not absolute",)),
    ("nvidia_kernel_headers", "yes please", ("valid boolean",)),
    ("nvidia_rebuild_initramfs", "maybe", ("valid boolean",)),
    ("nvidia_persistenced", 2, ("valid boolean",)),
    ("nvidia_container_toolkit", "sometimes", ("valid boolean",)),
    ("nvidia_dkms", "x", ("valid boolean",)),
    ("nvidia_cuda_samples_url", "https://github.com/NVIDIA/cuda-samples/archive/v11.8.zip", (".tar",)),
    ("nvidia_cuda_samples_sha256", "xyz", ("[0-9a-f]{64}",)),
    ("nvidia_driver_method", "deb", ("'apt' or 'runfile'",)),
    ("nvidia_runfile_base_url", "https://download.nvidia.com/", ("(https?|file)://",)),
    ("nvidia_runfile_sha256", "0" * 63, ("[0-9a-f]{64}",)),
    ("nvidia_shim_validation_disabled", "ignore", ("'proceed' or 'refuse'",)),
]

KUBERNETES: list[Case] = [
    ("kubernetes_version", "v1.31.4", ("written with a v", "accepted: 1.31.4")),
    ("kubernetes_version", "1.31", ("MAJOR.MINOR.PATCH",)),
    ("kubernetes_version", "1.30.8", ("older than 1.31", "v1beta4")),
    ("kubernetes_version", "1.31.4; rm -rf /", ("MAJOR.MINOR.PATCH",)),
    ("kubernetes_version", "latest", ("MAJOR.MINOR.PATCH",)),
    ("kubernetes_package_revision", "1.1 ", ("pattern",)),
    ("kubernetes_cri_tools_version", "1.31.1-1.1\n", ("pattern",)),
    ("kubernetes_cni_version", "latest", ("pattern",)),
    ("kubernetes_repo_url", "https://pkgs.k8s.io/core:/stable:/", ("pattern",)),
    ("kubernetes_repo_url", "ftp://mirror/k8s", ("pattern",)),
    ("kubernetes_repo_key", "/nonexistent/kubernetes.gpg", ("not a file on this machine",)),
    ("kubernetes_role", "master", ("control-plane", "worker")),
    ("kubernetes_control_plane_endpoint", "k8s api:6443", ("not a host name",)),
    ("kubernetes_control_plane_endpoint", "k8s-api.example:99999", ("1-65535",)),
    ("kubernetes_advertise_address", "r740-01", ("not an IP address",)),
    ("kubernetes_api_server_port", 0, ("greater than or equal to 1",)),
    ("kubernetes_node_name", "R740_01", ("not a Node name",)),
    ("kubernetes_drain_timeout_s", 0, ("greater than 0",)),
    ("kubernetes_drain_timeout_s", "6 minutes", ("valid integer",)),
    ("kubernetes_pod_subnet", "10.244.0.1/16", ("CIDR", "host bits")),
    ("kubernetes_pod_subnet", "10.244.0.0/28", ("fewer than 256",)),
    ("kubernetes_service_subnet", "10.96.0.0/33", ("CIDR",)),
    ("kubernetes_dns_domain", "Cluster.Local", ("pattern",)),
    ("kubernetes_cluster_name", "my cluster", ("pattern",)),
    ("kubernetes_image_repository", "https://registry.k8s.io", ("pattern",)),
    ("kubernetes_kube_proxy", "maybe", ("valid boolean",)),
    ("kubernetes_kubelet", {"cgroupDrivr": "systemd"}, ("cgroupDrivr", "unknown key", "did you mean cgroupDriver")),
    ("kubernetes_kubelet", {"maxPods": "lots"}, ("maxPods", "integer")),
    ("kubernetes_kubelet", {"cgroup_driver": "systemd"}, ("cgroup_driver", "unknown key", "did you mean cgroupDriver")),
    (
        "kubernetes_cluster",
        {"apiServer": {"certSAN": ["k8s.example"]}},
        ("certSAN", "unknown key", "accepted: certSANs"),
    ),
    ("kubernetes_cluster", {"clusterName": "x"}, ("kubernetes_cluster_name",)),
    ("kubernetes_allow_insecure", ["kubelet-anonymous"], ("kubelet-anonymous-auth",)),
    ("kubernetes_allow_local_address", "maybe", ("valid boolean",)),
    ("kubernetes_allow_plain_http", ["https://mirror.example/k8s"], ("pattern",)),
]

CLUSTER_ADDONS: list[Case] = [
    ("cluster_addons_cilium_version", "v1.18.3", ("pattern",)),
    ("cluster_addons_cilium_chart_repo", "ftp://helm.cilium.io", ("pattern",)),
    ("cluster_addons_cilium_routing_mode", "disabled", ("'tunnel' or 'native'",)),
    ("cluster_addons_cilium_tunnel_protocol", "gre", ("'vxlan' or 'geneve'",)),
    ("cluster_addons_cilium_native_routing_cidr", "10.0.0.0/33", ("CIDR", "10.244.0.0/16")),
    ("cluster_addons_cilium_pod_cidr_mask_size", 40, ("less than or equal to 28",)),
    ("cluster_addons_coredns_forward", ["dns.google"], ("not an IP address", "1.1.1.1 8.8.8.8")),
    ("cluster_addons_envoy_gateway_version", "1.6", ("pattern",)),
    ("cluster_addons_envoy_gateway_chart_repo", "docker.io/envoyproxy", ("pattern",)),
    ("cluster_addons_stream_idle_timeout_s", 0, ("greater than or equal to 1",)),
    ("cluster_addons_grpc_web_backend", "svc", ("pattern",)),
    ("cluster_addons_linkerd_chart_version", "edge-24.11.8", ("pattern",)),
    ("cluster_addons_linkerd_chart_repo", "helm.linkerd.io", ("pattern",)),
    ("cluster_addons_linkerd_trust_anchor", "/nonexistent/ca.crt", ("no readable PEM file",)),
    ("cluster_addons_cert_manager_version", "v1.19", ("pattern",)),
    ("cluster_addons_cert_manager_chart_repo", "jetstack", ("pattern",)),
    ("cluster_addons_acme_server", "http://acme.example", ("pattern",)),
    ("cluster_addons_acme_email", "not-an-email", ("pattern",)),
    ("cluster_addons_helm_version", "v3.17", ("pattern",)),
    ("cluster_addons_helm_base_url", "https://ops:hunter2@mirror.example", ("credentials are never inventory values",)),
    ("cluster_addons_helm_sha256", "SHA256:ABC", ("pattern",)),
    ("cluster_addons_dns_zones", ["exa mple.com"], ("not a lower-case DNS name",)),
    ("cluster_addons_tls_dns_names", ["*.*.example.com"], ("not a lower-case DNS name",)),
    ("cluster_addons_cloudflare_token_env", "lower-case", ("pattern",)),
    (
        "cluster_addons_cloudflare_api_token",
        "secret123",
        ("never an inventory value", "IRONSERVE_CLOUDFLARE_API_TOKEN"),
    ),
    ("cluster_addons_device_plugin_version", "0.17.0", ("pattern",)),
    ("cluster_addons_device_plugin_image", "nvcr.io/nvidia/k8s-device-plugin:v0.17.0", ("pattern",)),
    ("cluster_addons_allow_plain_http", ["ftp://mirror.example/charts"], ("pattern",)),
    ("cluster_addons_acme_staging", "maybe", ("valid boolean",)),
]

# --- issue 33's classes: values that change meaning silently, ports that collide, secrets, messages ------------------

ONE_PLAN = "accepted: one port per listener on a host"
BOOLEAN = "a boolean is not a number"
NOT_DURATION = "is not a Prometheus duration"
OFFLOAD = "CPU offload is not allowed"
ALL_SECTIONS = (
    "accepted: chaos, engine, exporter, gpu_health, kubernetes, quality, readiness, release, scaler, slo, swap"
)


def _service(section: str, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {section: values}


# (class, case): the class names what the closing note counts.
MONITORING: list[Case] = [
    ("monitoring_alertmanager", "yes please", ("valid boolean",)),
    ("monitoring_alertmanager_urls", ["http://10.0.0.5:9093/alertmanager"], ("has a path", "Alertmanager's root")),
    ("monitoring_alertmanager_port", 0, ("greater than or equal to 1",)),
    ("monitoring_node_exporter_port", 70000, ("less than or equal to 65535",)),
    ("monitoring_watch_hosts", {"gpu2": "10.0.0.7 && reboot"}, ("gpu2", "not a host name")),
    ("monitoring_webhook_urls", ["https://ops:hunter2@chat.example.internal/hook"], ("credential",)),
    ("monitoring_allow_plain_http", "http://chat.example.internal/hook", ("valid tuple",)),
    ("monitoring_email_to", ["oncall"], ("one e-mail address",)),
    ("monitoring_email_from", "alerts at example.com", ("one e-mail address",)),
    ("monitoring_smtp_smarthost", "smtp.example.com", ("HOST:PORT",)),
    ("monitoring_smtp_username", "ops team", ("pattern",)),
    ("monitoring_smtp_password_env", "smtp-password", ("environment variable name",)),
    ("monitoring_pagerduty", "maybe", ("valid boolean",)),
    ("monitoring_pagerduty_routing_key_env", "$KEY", ("environment variable name",)),
    ("monitoring_group_by", ["host", "team"], ("team", "accepted")),
    ("monitoring_group_wait", "30 seconds", ("not a Prometheus duration", "such as 5m")),
    ("monitoring_group_interval", "-5m", ("not a Prometheus duration",)),
    ("monitoring_repeat_interval", "0s", ("not a Prometheus duration",)),
    ("monitoring_grafana", "on-site", ("valid boolean",)),
    ("monitoring_disk_free_min_ratio", 10, ("less than 1",)),
]


SILENT_TYPES: list[Case] = [
    ("ironserve_reboot_timeout_s", True, (BOOLEAN, "600")),
    ("bios_apply_timeout_s", True, (BOOLEAN,)),
    ("security_uid", False, (BOOLEAN,)),
    ("security_cpu_weight", True, (BOOLEAN,)),
    ("nvidia_pin_priority", True, (BOOLEAN,)),
    ("kubernetes_api_server_port", True, (BOOLEAN,)),
    ("kubernetes_drain_timeout_s", True, (BOOLEAN,)),
    ("inference_service", _service("swap", {"green_port": True}), ("swap.green_port", BOOLEAN)),
    ("inference_service", _service("engine", {"max_num_seqs": True}), ("engine.max_num_seqs", BOOLEAN)),
    ("inference_service", _service("slo", {"fast_window": "1 minute"}), ("slo.fast_window", NOT_DURATION)),
    ("inference_service", _service("slo", {"slo_window": "5m]) or vector(1"}), ("slo.slo_window", NOT_DURATION)),
    ("inference_service", _service("slo", {"leak_window": "0h"}), ("slo.leak_window", NOT_DURATION)),
    ("inference_service", _service("slo", {"target_down_for": "1.5m"}), ("slo.target_down_for", NOT_DURATION)),
    ("inference_service", _service("slo", {"latency_metric": "x{job=~'.*'}"}), ("not a Prometheus metric name",)),
    ("inference_service", _service("slo", {"job": 'a"} or vector(1) #'}), ("not a plain label value",)),
    ("inference_service", _service("engine", {"extra_args": ["--cpu-offload-gb", "4"]}), (OFFLOAD,)),
    ("inference_service", _service("engine", {"extra_args": ["--cpu-offload-gb=4"]}), (OFFLOAD,)),
    ("inference_service", _service("engine", {"extra_args": ["--cpu_offload_gb=4"]}), (OFFLOAD,)),
    ("inference_service", _service("engine", {"extra_args": ["--cpu-offload", "4"]}), (OFFLOAD,)),
    ("inference_service", _service("engine", {"extra_args": ["--kv-offloading-size=4"]}), (OFFLOAD,)),
    ("inference_service", _service("engine", {"extra_args": ["--config", "/tmp/x.yaml"]}), ("config file",)),
    ("inference_service", _service("engine", {"extra_args": ["--host", "0.0.0.0"]}), ("engine.host",)),
    ("inference_service", _service("engine", {"extra_args": ["--port=9000"]}), ("engine.port",)),
    ("inference_service", _service("engine", {"extra_args": ["-tp", "8"]}), ("engine.tensor_parallel_size",)),
    ("inference_service", _service("engine", {"extra_args": ["--tensor_parallel_size=8"]}), ("engine.tensor_para",)),
    ("inference_service", _service("engine", {"extra_args": ["--max-num-seqs 9"]}), ("not one flag",)),
]

PORTS_ON_ONE_HOST: list[Case] = [
    ("inference_service", _service("swap", {"listen_port": 2379}), ("swap.listen_port", "2379", "etcd", ONE_PLAN)),
    ("inference_service", _service("swap", {"listen_port": 9090}), ("Prometheus", "inference_prometheus", ONE_PLAN)),
    ("inference_service", _service("exporter", {"port": 8080}), ("8080", "Envoy's listener", "exporter.port")),
    ("inference_service", _service("quality", {"mirror_port": 2379}), ("quality.mirror_port", "etcd", ONE_PLAN)),
    ("inference_service", _service("quality", {"mirror_port": 8001}), ("green engine", "quality sink", ONE_PLAN)),
    ("inference_service", _service("swap", {"admin_port": 9400}), ("admin interface", "exporter", ONE_PLAN)),
    ("inference_service", _service("swap", {"blue_port": 2380}), ("blue engine", "etcd (peer)", ONE_PLAN)),
]

LISTEN_ADDRESSES: list[Case] = [
    ("inference_listen_address", "fe80::1%eth0", ("with a scope", "serving network")),
    ("inference_listen_address", "fe80::1", ("link-local",)),
    ("inference_listen_address", "169.254.10.1", ("link-local",)),
]

SECRETS_ECHOED: list[Case] = [
    ("inference_api_key", "sk-" + "a1" * 20, ("unknown key (got ***)",)),
    ("inference_service", _service("swap", {"api_key": "sk-" + "b2" * 20}), ("unknown key 'api_key'",)),
    ("host_tuning_access_token", "ghp_" + "c3" * 18, ("unknown key (got ***)",)),
    ("ironserve_note", "Bearer " + "d4" * 20, ("unknown key (got '***')",)),
    ("ironserve_ca", "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----", ("(got '***')",)),
]

UNHELPFUL_MESSAGES: list[Case] = [
    ("inference_service", {"swpa": {"listen_port": 8081}}, ("unknown section 'swpa'", ALL_SECTIONS)),
    ("inference_service", {"bogus": 1}, ("unknown section 'bogus'", ALL_SECTIONS)),
    ("inference_service", _service("swap", {"listen_prot": 8081}), ("in section swap", "accepted: admin_port")),
    ("inference_service", _service("swap", {"routing": {"stagng": []}}), ("in section swap.routing", "accepted:")),
    ("inference_service", _service("slo", {"window": "5m"}), ("in section slo", "fast_window")),
]

PLAIN_HTTP: list[Case] = [
    ("nvidia_repo_url", "http://mirror.example.internal/cuda", ("plain http", "nvidia_allow_plain_http")),
    ("nvidia_runfile_base_url", "http://mirror.example.internal", ("plain http", "nvidia_allow_plain_http")),
    ("inference_pip_index_url", "http://mirror.example.internal/simple/", ("plain http", "inference_allow_plain_http")),
    ("nvidia_allow_plain_http", ["https://mirror.example.internal/cuda"], ("pattern",)),
    ("inference_allow_plain_http", ["mirror.example.internal"], ("pattern",)),
]

ROUND_TWO = SILENT_TYPES + PORTS_ON_ONE_HOST + LISTEN_ADDRESSES + SECRETS_ECHOED + UNHELPFUL_MESSAGES + PLAIN_HTTP
CASES = (
    SECURITY
    + HOST_TUNING
    + CONTAINER_RUNTIME
    + KUBERNETES
    + CLUSTER_ADDONS
    + MONITORING
    + INFERENCE
    + PREFLIGHT
    + BIOS
    + NVIDIA
) + ROUND_TWO


def _id(case: Case) -> str:
    key, value, _ = case
    return f"{key}={value!r}"[:80]


def test_the_table_is_large_and_covers_every_key_of_every_role() -> None:
    assert len(CASES) >= 150
    from roles import REGISTRY

    keys = {key for key, _, _ in CASES}
    for role in REGISTRY.roles:
        fields = {f.alias for f in role.settings.model_fields.values()}
        # inference_model_source has its own table below (sealed directories on this machine)
        assert fields - keys - {"inference_model_source"} == set(), role.name


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_one_mistake_is_refused_naming_the_key_and_what_is_accepted(case: Case) -> None:
    key, value, words = case
    with pytest.raises(ConfigError) as raised:
        stack_config("r740-01", {key: value})
    message = str(raised.value)
    assert message.startswith("host r740-01: "), message
    assert key in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize("case", SECRETS_ECHOED, ids=_id)
def test_a_value_shaped_like_a_credential_never_reaches_the_message(case: Case) -> None:
    key, value, _ = case
    with pytest.raises(ConfigError) as raised:
        stack_config("r740-01", {key: value})
    for secret in ("a1a1a1a1", "b2b2b2b2", "c3c3c3c3", "d4d4d4d4", "MIIE"):
        assert secret not in str(raised.value)


def test_every_problem_of_one_value_is_a_line_of_its_own() -> None:
    value = {"swap": {"green_port": True, "blue_port": 0, "listen_prot": 1}, "slo": {"fast_window": "1 minute"}}
    with pytest.raises(ConfigError) as raised:
        stack_config("r740-01", {"inference_service": value, "ironserve_reboot_timeout_s": True})
    lines = str(raised.value).splitlines()
    assert len(lines) == 5, lines
    for words in ("listen_prot", "swap.green_port: a boolean", "swap.blue_port", "slo.fast_window", "reboot_timeout"):
        assert any(words in line for line in lines), (words, lines)
    assert all(line.startswith("host r740-01: ") for line in lines)


def test_every_collision_of_the_port_plan_is_named() -> None:
    value = {"swap": {"listen_port": 2379, "admin_port": 9090}, "exporter": {"port": 8000}}
    with pytest.raises(ConfigError) as raised:
        stack_config("r740-01", {"inference_service": value})
    lines = str(raised.value).splitlines()
    assert len(lines) == 3, lines
    assert all(ONE_PLAN in line for line in lines)


def test_a_widened_ephemeral_range_is_accepted_over_the_ports_the_service_reserves() -> None:
    wide = {"net.ipv4.ip_local_port_range": "1024 65000"}
    config = stack_config("r740-01", {"host_tuning_sysctls": wide, "inference_service": _service("swap", {})})
    assert all(listener.reserved for listener in config.inference.listeners())
    assert {8080, 9901, 8000, 8001, 9400, 9401, 2379, 2380, 9090} == {x.port for x in config.inference.listeners()}


# --- sealed model sources: what the upload carries is read and validated on the admin's machine ------------------


def _sealed(root: Path, name: str, release: object = None, manifest: str | None = None) -> Path:
    model = root / name
    model.mkdir()
    (model / "config.json").write_text("{}")
    seal_model_dir(model, datetime(2026, 1, 1, tzinfo=UTC))
    if release is not None:
        (model / "release.json").write_text(release if isinstance(release, str) else json.dumps(release))
    if manifest is not None:
        (model / "MANIFEST.sha256").write_text(manifest)
    return model


GOOD_SHA = "0" * 64
SOURCES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("version-command", {"release": {"version": "$(id)", "sha256": GOOD_SHA}}, (MODEL_VERSION, "'$(id)'")),
    ("version-dotdot", {"release": {"version": "..", "sha256": GOOD_SHA}}, (MODEL_VERSION,)),
    ("version-path", {"release": {"version": "../../../../etc", "sha256": GOOD_SHA}}, (MODEL_VERSION,)),
    ("version-newline", {"release": {"version": "20260101-000000\n", "sha256": GOOD_SHA}}, (MODEL_VERSION,)),
    ("version-number", {"release": {"version": 20260101, "sha256": GOOD_SHA}}, ("no version string",)),
    ("no-version", {"release": {"sha256": GOOD_SHA}}, ("no version string",)),
    ("bad-sha", {"release": {"version": "20260101-000000", "sha256": "abc"}}, ("sha256 content hash",)),
    ("not-json", {"release": "{version: 1"}, ("not readable JSON",)),
    ("not-object", {"release": "[1, 2]"}, ("no version string",)),
    ("manifest-escape", {"manifest": GOOD_SHA + "  ../../etc/passwd\n"}, ("outside the model directory",)),
    ("manifest-garbage", {"manifest": "hello\n"}, ("not '<sha256>  <file>'",)),
]


@pytest.mark.parametrize(("name", "files", "words"), SOURCES, ids=[s[0] for s in SOURCES])
def test_a_hostile_sealed_source_is_refused_at_config_time(
    tmp_path: Path, name: str, files: dict[str, Any], words: tuple[str, ...]
) -> None:
    source = _sealed(tmp_path, name, files.get("release"), files.get("manifest"))
    with pytest.raises(ConfigError) as raised:
        stack_config("r740-01", {"inference_model_source": str(source)})
    message = str(raised.value)
    assert "inference_model_source" in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_the_version_must_be_the_one_the_source_records(tmp_path: Path) -> None:
    source = _sealed(tmp_path, "v1")
    with pytest.raises(ConfigError, match=r"inference_model_version: 20260102-000000 differs from .*20260101-000000"):
        stack_config("h", {"inference_model_source": str(source), "inference_model_version": "20260102-000000"})
    config = stack_config("h", {"inference_model_source": str(source), "inference_model_version": "20260101-000000"})
    assert config.inference.version() == "20260101-000000"


def test_an_unsealed_or_missing_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"inference_model_source: .*not a sealed model version"):
        stack_config("h", {"inference_model_source": str(tmp_path)})


# --- what only the deploy check sees (the models root against the service's own directories, service ports) --------


@pytest.fixture
def deployable(tmp_path: Path) -> dict[str, Any]:
    lock = tmp_path / "requirements.lock"
    lock.write_text("torch==2.1.2 --hash=sha256:" + GOOD_SHA + "\n")
    return {
        "ironserve_roles": "security,inference",
        "inference_pip_index_url": "https://mirror.example.internal/simple/",
        "inference_requirements": str(lock),
        "inference_model_source": str(_sealed(tmp_path, "model")),
        "inference_listen_address": "10.0.1.11",
    }


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"inference_models_root": "/var/lib/ai-service/models"}, ("inference_models_root", "overlaps")),
        ({"inference_models_root": "/var/lib/ai-service"}, ("inference_models_root", "overlaps")),
        ({"inference_venv": "/var/lib/ai-service/venv"}, ("inference_venv", "overlaps", "/var/lib/ai-service")),
        ({"inference_service": {"swap": {"listen_port": 70000}}}, ("inference_service", "listen_port", "65535")),
        ({"inference_service": {"exporter": {"port": 0}}}, ("inference_service", "exporter.port")),
        # The profile's serving GPUs bound the engine's parallelism (r740-a10: two x16 slots).
        (
            {"inference_service": {"engine": {"tensor_parallel_size": 4}}},
            ("engine.tensor_parallel_size 4", "2 serving GPUs of profile r740-a10", "accepted: 1 to 2"),
        ),
        ({"security_service_units": ["ai-service.service"]}, ("security_service_units", "ai-service@.service")),
    ],
)
def test_deploy_check_refusals(deployable: dict[str, Any], data: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as raised:
        check_deployable(stack_config("r740-01", {**deployable, **data}))
    for word in words:
        assert word in str(raised.value), str(raised.value)


# --- what stays accepted ---------------------------------------------------------------------------------------------


def test_unusual_but_legitimate_values_are_accepted(deployable: dict[str, Any]) -> None:
    config = stack_config(
        "r740-01",
        {
            **deployable,
            "security_user": "llm-svc",
            "security_group": "llm-svc",
            "security_model_dir": "/data/nvme0/models",
            "security_state_dir": "/var/lib/llm-svc",
            "security_log_dir": "/var/log/llm-svc",
            "security_slice": "ai-inference.slice",
            "security_capabilities": ["CAP_SYS_NICE", "CAP_IPC_LOCK", "CAP_NET_BIND_SERVICE"],
            "security_service_units": ["ai-service@.service", "ai-service-batch.service"],
            "host_tuning_allow_sysctl_keys": ["net.core.somaxconn"],
            "host_tuning_sysctls": {"net.core.somaxconn": "4096", RMEM: 26214400, PORT_RANGE: "32768\t60999"},
            "host_tuning_allow_kernel_args": ["pcie_port_pm"],
            "host_tuning_kernel_args": [CGROUP, "iommu=pt", "intel_iommu=on", "pcie_port_pm=off", "ironserve.probe=1"],
            "host_tuning_ntp_servers": ["ntp1.example.internal", "10.0.0.1", "fd00::1"],
            "container_runtime_cni_bin_dir": "/usr/lib/cni",
            "container_runtime_nvidia_binary": "/usr/local/nvidia/toolkit/nvidia-container-runtime.cdi",
            "inference_python": "/usr/bin/python3.11",
            "inference_engine_environment": {"VLLM_EXTRA": 'a "quoted" value with spaces, 100% \\ fine'},
            "preflight_report_dir": "/srv/reports/preflight",
        },
    )
    check_deployable(config)
    assert config.host_tuning.sysctls["net.core.somaxconn"] == "4096"
    assert config.inference.version() == "20260101-000000"


# --- nothing reaches a shell or a unit file unquoted ------------------------------------------------------------------

ENGINE_TEMPLATE = role_template("inference", "engine.service.j2")


def _engine_unit(environment: dict[str, str]) -> str:
    from pyinfra.api.util import get_template

    from roles.inference import environment_assignments

    return get_template(str(ENGINE_TEMPLATE)).render(
        venv="/opt/ironserve/venv",
        config="/etc/ironserve/service.yaml",
        model_name="qwen2-7b",
        run_dir="/run/ironserve",
        state_dir="/var/lib/ai-service",
        environment=environment_assignments(environment),
        stop_timeout_s=60,
    )


def test_engine_environment_is_one_quoted_assignment_per_variable() -> None:
    unit = _engine_unit({"VLLM_CPU_KVCACHE_SPACE": "1", "EXTRA": 'say "hi" at 100% \\ now'})
    lines = [line for line in unit.splitlines() if line.startswith("Environment=")]
    assert lines == [
        "Environment=HOME=/var/lib/ai-service XDG_CACHE_HOME=/var/lib/ai-service/cache",
        'Environment="VLLM_CPU_KVCACHE_SPACE=1"',
        # systemd.exec(5): C escapes inside double quotes, % specifiers doubled, so the value arrives verbatim.
        'Environment="EXTRA=say \\"hi\\" at 100%% \\\\ now"',
    ]
    sections = [line for line in unit.splitlines() if line.startswith("[")]
    assert sections == ["[Unit]", "[Service]"]  # no section or directive smuggled in


@pytest.mark.parametrize("value", ["1\rExecStartPre=/bin/sh -c id", "1\nUser=root", "1\x00", "1\x1b[2J"])
def test_the_unit_renderer_refuses_a_value_that_would_add_a_directive(value: str) -> None:
    with pytest.raises(ValueError, match="control characters"):
        _engine_unit({"A": value})


def test_systemd_quoted() -> None:
    from ironserve.validators import systemd_quoted

    assert systemd_quoted("A=b") == '"A=b"'
    assert systemd_quoted('A=%i "x" \\') == '"A=%%i \\"x\\" \\\\"'


def _commands(operation: Any, facts: list[dict[str, Any]], **kwargs: Any) -> list[Any]:
    from tests.unit.operation_harness import FakeHost, FakeState, facts_table, run_operation

    return run_operation(operation, FakeHost(facts_table(facts)), FakeState(), **kwargs)


ODD_VENV = "/opt/iron serve/venv;id"  # never a valid inventory value: the operations quote it anyway


def test_every_path_and_name_the_inference_operations_pass_to_a_shell_is_quoted() -> None:
    from roles.inference.operations import locked_environment, service_package, serving

    pip = {"fact": "roles.inference.facts.VenvPackages", "kwargs": {"venv": ODD_VENV}}
    created = _commands(
        locked_environment,
        [{**pip, "value": None}],
        venv=ODD_VENV,
        python="/usr/bin/python3 x",
        lock="/opt/ironserve/requirements.lock",
        pins={"torch": "2.1.2"},
        index_url="https://mirror.example.internal/simple/",
    )
    assert created[0] == "'/usr/bin/python3 x' -m venv '/opt/iron serve/venv;id'"
    assert created[1]["raw"].startswith("'/opt/iron serve/venv;id/bin/pip' install")
    installed = _commands(
        service_package,
        [{**pip, "value": {}}],
        venv=ODD_VENV,
        wheel="/opt/ironserve/wheels/w.whl",
        digest="abc",
    )
    assert installed[1] == (
        "rm -f '/opt/iron serve/venv;id'/.ironserve-service-* && touch '/opt/iron serve/venv;id/.ironserve-service-abc'"
    )
    status = {
        "fact": "roles.inference.facts.ServingStatus",
        "kwargs": {"venv": ODD_VENV, "config": "/etc/ironserve/service.yaml"},
        "value": None,
    }
    swap = _commands(
        serving, [status], venv=ODD_VENV, config="/etc/ironserve/service.yaml", model="m; id", version="$(id)"
    )
    assert swap == [
        "'/opt/iron serve/venv;id/bin/ironserve-service' swap 'm; id' '$(id)' --config /etc/ironserve/service.yaml"
    ]


@pytest.mark.parametrize("arg", ["a=$(id)", "a=`id`", 'a="x"', "a=\\x"])
def test_grub_line_never_carries_shell_characters(arg: str) -> None:
    from pyinfra.api.exceptions import OperationError

    from roles.host_tuning import grub_assignment

    assert grub_assignment(["quiet", CGROUP]) == f'GRUB_CMDLINE_LINUX="quiet {CGROUP}"'
    with pytest.raises(OperationError, match="shell characters"):
        grub_assignment(["quiet", arg])


# --- nothing is deleted outside its own directory ------------------------------------------------------------------


def test_the_deletion_guard_accepts_a_version_directory_of_the_models_root() -> None:
    from roles.inference.operations import model_version_dir

    assert model_version_dir("/srv/ai/models/qwen2-7b", "20260101-000000") == "/srv/ai/models/qwen2-7b/20260101-000000"
    assert model_version_dir("/data/nvme0/m", "20260102-030405") == "/data/nvme0/m/20260102-030405"


@pytest.mark.parametrize(
    ("root", "version"),
    [
        ("/", "20260101-000000"),
        ("/etc", "20260101-000000"),
        ("/srv", "20260101-000000"),
        ("/var/lib", "20260101-000000"),
        ("/home/models", "20260101-000000"),
        ("/srv/ai/models/../../../etc", "20260101-000000"),
        ("/srv/ai/models/qwen2-7b/", "20260101-000000"),
        ("srv/ai/models", "20260101-000000"),
        ("/srv/ai/models/qwen2-7b", ".."),
        ("/srv/ai/models/qwen2-7b", "."),
        ("/srv/ai/models/qwen2-7b", ""),
        ("/srv/ai/models/qwen2-7b", "../../../../etc"),
        ("/srv/ai/models/qwen2-7b", "20260101-000000/../.."),
        ("/srv/ai/models/qwen2-7b", "/etc"),
        ("/srv/ai/models/qwen2-7b", "$(id)"),
    ],
)
def test_the_deletion_guard_refuses_anything_else(root: str, version: str) -> None:
    from pyinfra.api.exceptions import OperationError

    from roles.inference.operations import model_version_dir

    with pytest.raises(OperationError, match="model sync with deletion refused"):
        model_version_dir(root, version)


def test_the_deploy_checks_the_destination_right_before_the_sync(
    deployable: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """_install_model asks the guard first and syncs (delete=True) only into the directory the guard returned;
    a version that slipped past validation stops the deploy before any operation."""
    from pyinfra.api.exceptions import OperationError

    inference_role = importlib.import_module("roles.inference")  # `roles.inference` is also the deploy function

    calls: list[tuple[str, Any]] = []
    real_guard = inference_role.model_version_dir
    monkeypatch.setattr(
        inference_role, "model_version_dir", lambda r, v: calls.append(("guard", (r, v))) or real_guard(r, v)
    )
    monkeypatch.setattr(inference_role, "owned_directory", lambda **kw: calls.append(("directory", kw["path"])))
    monkeypatch.setattr(inference_role.files, "sync", lambda **kw: calls.append(("sync", (kw["dest"], kw["delete"]))))
    config = stack_config("r740-01", deployable)
    settings = config.inference.service_settings(
        config.security.model_dir, config.security.group, config.security.slice
    )
    inference_role._install_model(config, settings, config.inference.version())
    root = "/srv/ai/models/qwen2-7b"
    assert calls == [
        ("guard", (root, "20260101-000000")),
        ("directory", root),
        ("sync", (f"{root}/20260101-000000", True)),
    ]
    calls.clear()
    with pytest.raises(OperationError, match="model sync with deletion refused"):
        inference_role._install_model(config, settings, "..")
    assert [name for name, _ in calls] == ["guard"]


def test_a_release_version_is_validated_again_when_the_deploy_reads_it(tmp_path: Path) -> None:
    source = _sealed(tmp_path, "m")
    config = stack_config("h", {"inference_model_source": str(source)})
    (source / "release.json").write_text(json.dumps({"version": "$(id)", "sha256": GOOD_SHA}))  # after validation
    with pytest.raises(ValueError, match=MODEL_VERSION):
        config.inference.version()
