"""Public API of the security role: every inventory key it reads, with its default.

Plain data only (no imports), so the configuration model can read it without importing pyinfra.
"""

DEFAULTS: dict[str, object] = {
    # sec-ai-runner-user / sec-ai-runner-group: the system account and group the service runs as.
    "security_user": "ai-runner",
    "security_group": "ai-runner",
    # sec-ai-runner-user: no login shell (the catalog's /bin/false); the password stays locked.
    "security_shell": "/bin/false",
    # Model files: owned by root, readable by the service group only (0750); the service cannot alter them.
    "security_model_dir": "/srv/ai/models",
    # Service state (caches, compiled kernels): the service user only (0700).
    "security_state_dir": "/var/lib/ai-service",
    # Service logs: written by the service, readable by its group (0750).
    "security_log_dir": "/var/log/ai-service",
    # cgroup-ai-service-memory-max: the slice every service unit runs in, and its memory ceiling.
    "security_slice": "ai-service.slice",
    "security_memory_max": "24G",
    # CPU weight of the slice against system.slice (default 100): the service wins under contention.
    "security_cpu_weight": 1000,
    # cgroup-ai-service-devices-deny (correction): DevicePolicy=closed and only these NVIDIA nodes allowed.
    "security_device_allow": [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia0",
        "/dev/nvidia1",
    ],
    # sec-cap-sys-nice (correction): the only capability, granted per service, never on the interpreter.
    "security_capabilities": ["CAP_SYS_NICE"],
    # Units that get the hardening drop-in (user, capabilities, seccomp filter, slice); ai-service@.service is
    # the inference role's blue/green engine template (the drop-in applies to every colour).
    "security_service_units": ["ai-service.service", "ai-service@.service"],
    # sec-seccomp-profile: where the kubelet reads Localhost profiles (localhostProfile: profiles/ai-service.json).
    "security_kubelet_seccomp_dir": "/var/lib/kubelet/seccomp/profiles",
}
