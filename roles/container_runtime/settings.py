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
        description="Debian packages, pinned to exact versions (apt preferences + hold): package -> version.",
    )
    default_runtime: Literal["runc", "nvidia"] = Field(
        "runc",
        alias="container_runtime_default_runtime",
        description="cri-nvidia-runtime: the runtime the CRI uses when a pod names none.",
    )
    nvidia_binary: str = Field(
        "/usr/bin/nvidia-container-runtime",
        alias="container_runtime_nvidia_binary",
        pattern=ABS_PATH,
        description='cri-nvidia-runtime: the NVIDIA runtime binary registered as runtime "nvidia".',
    )
    snapshotter: Literal["overlayfs", "devmapper"] = Field(
        "overlayfs",
        alias="container_runtime_snapshotter",
        description="cri-devmapper-snapshotter (correction): overlayfs by default; devmapper needs a provisioned "
        "thin-pool.",
    )
    devmapper_pool_name: str | None = Field(
        None,
        alias="container_runtime_devmapper_pool_name",
        pattern=r"^[\w.-]+$",
        description="devmapper only: the LVM thin-pool's device-mapper name.",
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
        description="CNI plugin binaries, where the Kubernetes network add-on installs them.",
    )
    cni_conf_dir: str = Field(
        "/etc/cni/net.d",
        alias="container_runtime_cni_conf_dir",
        pattern=ABS_PATH,
        description="CNI network configs, where the Kubernetes network add-on writes them.",
    )
    kernel_modules: tuple[Annotated[str, Field(pattern=r"^[a-z0-9_]+$")], ...] = Field(
        ("overlay", "br_netfilter"),
        alias="container_runtime_kernel_modules",
        description="Kernel modules containers and Kubernetes need, loaded now and at every boot.",
    )
    sysctls: dict[str, str] = Field(
        default_factory=lambda: {"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"},
        alias="container_runtime_sysctls",
        description="Sysctls for pod networking, persisted in sysctl.d and applied live.",
    )
    swap_off: bool = Field(
        True,
        alias="container_runtime_swap_off",
        description="The kubelet refuses to start with swap on: turn it off and comment it out of /etc/fstab.",
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
