"""Settings of the container_runtime role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ironserve.config import RoleSettings
from ironserve.validators import ABS_PATH, PackageName, PackageVersion, canonical_sysctls


class ContainerRuntimeSettings(RoleSettings):
    """Settings of roles/container_runtime."""

    packages: dict[PackageName, PackageVersion] = Field(
        default_factory=lambda: {"containerd": "1.6.20~ds1-1+deb12u3", "runc": "1.1.5+ds1-1+deb12u1"},
        alias="container_runtime_packages",
        description="Debian packages at exact versions: apt preferences (priority 1001, so apt also "
        "downgrades), one install of the set, `apt-mark hold`.",
    )
    default_runtime: Literal["runc", "nvidia"] = Field(
        "runc",
        alias="container_runtime_default_runtime",
        description="cri-nvidia-runtime: containerd's `default_runtime_name`, the runtime a pod that names "
        "none gets: runc or nvidia.",
    )
    nvidia_binary: str = Field(
        "/usr/bin/nvidia-container-runtime",
        alias="container_runtime_nvidia_binary",
        pattern=ABS_PATH,
        description='cri-nvidia-runtime: `BinaryName` of the runtime "nvidia" (always registered).',
    )
    snapshotter: Literal["overlayfs", "devmapper"] = Field(
        "overlayfs",
        alias="container_runtime_snapshotter",
        description="cri-devmapper-snapshotter (correction): overlayfs by default; devmapper needs the "
        "thin-pool below.",
    )
    devmapper_pool_name: str | None = Field(
        None,
        alias="container_runtime_devmapper_pool_name",
        pattern=r"^[\w.-]+$",
        description="devmapper only: the LVM thin-pool's device-mapper name; required when devmapper is chosen.",
    )
    devmapper_root_path: str = Field(
        "/var/lib/containerd/devmapper",
        alias="container_runtime_devmapper_root_path",
        pattern=ABS_PATH,
        description="devmapper only: the snapshotter's metadata folder.",
    )
    devmapper_base_image_size: str = Field(
        "40GB",
        alias="container_runtime_devmapper_base_image_size",
        pattern=r"^[1-9][0-9]*(MB|GB|TB)$",
        description="devmapper only: each image's base size.",
    )
    cni_bin_dir: str = Field(
        "/opt/cni/bin",
        alias="container_runtime_cni_bin_dir",
        pattern=ABS_PATH,
        description="CNI plugin binaries (created; the Kubernetes network add-on fills it).",
    )
    cni_conf_dir: str = Field(
        "/etc/cni/net.d",
        alias="container_runtime_cni_conf_dir",
        pattern=ABS_PATH,
        description="CNI network configs (created; the Kubernetes network add-on fills it).",
    )
    kernel_modules: tuple[Annotated[str, Field(pattern=r"^[a-z0-9_]+$")], ...] = Field(
        ("overlay", "br_netfilter"),
        alias="container_runtime_kernel_modules",
        description="Kernel modules containers and Kubernetes need: loaded now and listed in "
        "/etc/modules-load.d/ironserve-containers.conf.",
    )
    sysctls: dict[str, str] = Field(
        default_factory=lambda: {"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"},
        alias="container_runtime_sysctls",
        description="Pod-networking sysctls: /etc/sysctl.d/91-ironserve-containers.conf, applied live.",
    )
    swap_off: bool = Field(
        True,
        alias="container_runtime_swap_off",
        description="The kubelet refuses swap: `swapoff -a` and the swap lines of /etc/fstab commented out.",
    )

    @field_validator("sysctls", mode="before")
    @classmethod
    def _sysctls(cls, raw: object) -> dict[str, str]:
        return canonical_sysctls(raw)

    @field_validator("packages")
    @classmethod
    def _containerd_listed(cls, value: dict[str, str]) -> dict[str, str]:
        if "containerd" not in value:
            raise ValueError("containerd must be listed with its pinned version")
        return value

    @model_validator(mode="after")
    def _devmapper_has_pool(self) -> ContainerRuntimeSettings:
        if self.snapshotter == "devmapper" and not self.devmapper_pool_name:
            raise ValueError(
                "container_runtime_snapshotter devmapper needs container_runtime_devmapper_pool_name "
                "(a provisioned LVM thin-pool); accepted without one: overlayfs"
            )
        return self
