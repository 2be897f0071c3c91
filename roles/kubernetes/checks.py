"""Pure checks of what is in force on a node, shared by the deploy and the acceptance gate."""

from __future__ import annotations

import tomllib
from typing import Any

import yaml

CRI_PLUGIN = "io.containerd.grpc.v1.cri"
# The kubelet's own default when its config names no driver (kubelet.config.k8s.io/v1beta1 defaults.go).
KUBELET_DEFAULT_DRIVER = "cgroupfs"


def containerd_runtime_drivers(containerd_config: str) -> dict[str, str]:
    """Each CRI runtime of a containerd config (config.toml or `containerd config dump`) -> its cgroup driver.
    SystemdCgroup unset means cgroupfs (containerd's runc shim default)."""
    data: dict[str, Any] = tomllib.loads(containerd_config)
    runtimes = data.get("plugins", {}).get(CRI_PLUGIN, {}).get("containerd", {}).get("runtimes", {})
    return {
        name: "systemd" if runtime.get("options", {}).get("SystemdCgroup") is True else "cgroupfs"
        for name, runtime in runtimes.items()
        if isinstance(runtime, dict)
    }


def kubelet_driver(kubelet_config: str) -> str:
    """The cgroup driver a kubelet config file makes the kubelet use."""
    documents = [d for d in yaml.safe_load_all(kubelet_config) if isinstance(d, dict)]
    kubelet = next((d for d in documents if d.get("kind") == "KubeletConfiguration"), {})
    return str(kubelet.get("cgroupDriver") or KUBELET_DEFAULT_DRIVER)


def cgroup_driver_problem(containerd_config: str, kubelet_config: str) -> str | None:
    """Why this kubelet would fight containerd over cgroups (kubernetes/kubernetes#110177: pods restarted in a
    loop), or None when every CRI runtime uses the kubelet's driver. Unreadable files are a problem too."""
    try:
        runtimes = containerd_runtime_drivers(containerd_config)
    except tomllib.TOMLDecodeError as exc:
        return f"containerd's config is not TOML ({exc})"
    try:
        driver = kubelet_driver(kubelet_config)
    except yaml.YAMLError as exc:
        return f"the kubelet's config is not YAML ({str(exc).splitlines()[0]})"
    if not runtimes:
        return f'containerd registers no CRI runtime (plugins."{CRI_PLUGIN}".containerd.runtimes is empty)'
    apart = {name: used for name, used in runtimes.items() if used != driver}
    if not apart:
        return None
    shown = ", ".join(f"{name} uses {used}" for name, used in sorted(apart.items()))
    return (
        f"the kubelet's cgroupDriver is {driver} but containerd's runtime {shown} (SystemdCgroup): the kubelet "
        "would restart pods in a loop; both must use one driver (container_runtime renders SystemdCgroup = true)"
    )
