"""Public API of the container_runtime role: every inventory key it reads, with its default.

Plain data only (no imports), so the configuration model can read it without importing pyinfra.
"""

DEFAULTS: dict[str, object] = {
    # Debian packages, pinned to exact versions (apt preferences + hold): package -> version.
    "container_runtime_packages": {
        "containerd": "1.6.20~ds1-1+deb12u3",
        "runc": "1.1.5+ds1-1+deb12u1",
    },
    # cri-nvidia-runtime: the runtime the CRI uses when a pod names none: runc or nvidia.
    "container_runtime_default_runtime": "runc",
    # cri-nvidia-runtime: the NVIDIA runtime binary registered as runtime "nvidia".
    "container_runtime_nvidia_binary": "/usr/bin/nvidia-container-runtime",
    # cri-devmapper-snapshotter (correction): overlayfs by default; devmapper needs a provisioned thin-pool.
    "container_runtime_snapshotter": "overlayfs",
    # devmapper only: the LVM thin-pool (dm name), its metadata folder and each image's base size.
    "container_runtime_devmapper_pool_name": None,
    "container_runtime_devmapper_root_path": "/var/lib/containerd/devmapper",
    "container_runtime_devmapper_base_image_size": "40GB",
    # CNI plugin binaries and network configs, where the Kubernetes network add-on installs them.
    "container_runtime_cni_bin_dir": "/opt/cni/bin",
    "container_runtime_cni_conf_dir": "/etc/cni/net.d",
    # Kernel modules containers and Kubernetes need, loaded now and at every boot.
    "container_runtime_kernel_modules": ["overlay", "br_netfilter"],
    # Sysctls for pod networking, persisted in sysctl.d and applied live.
    "container_runtime_sysctls": {
        "net.ipv4.ip_forward": 1,
        "net.bridge.bridge-nf-call-iptables": 1,
    },
    # The kubelet refuses to start with swap on: turn it off and comment it out of /etc/fstab.
    "container_runtime_swap_off": True,
}
