"""Settings of the container_runtime role: its public API, every inventory key it reads with its default."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ironserve.config import RoleSettings, prefixed
from ironserve.validators import (
    PackageName,
    PackageVersion,
    PlainHttpUrl,
    canonical_sysctls,
    check_allowed_sysctl_key,
    check_path,
    fullmatch,
    path_rule,
    plain_http_refused,
)

# modprobe names: a-z 0-9 _ (MODULE_NAME_LEN is 56 with the NUL).
MODULE = re.compile(r"[a-z0-9_]{1,55}")
# A device-mapper name (dmsetup(8): no /, at most 127 characters).
DM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,126}")
SIZE = re.compile(r"[1-9][0-9]{0,5}(MB|GB|TB)")
# containerd runs the runtime binary as root for every GPU pod: only where the NVIDIA container toolkit installs
# it (the package: /usr/bin; a tarball or the GPU operator: /usr/local/bin, /usr/local/nvidia/toolkit), with its
# mode suffixes (.cdi, .legacy).
NVIDIA_RUNTIME = re.compile(r"(/usr/bin|/usr/local/bin|/usr/local/nvidia/toolkit)/nvidia-container-runtime(\.[a-z]+)?")

# containerd's CRI socket and the cgroup driver of every runtime ironserve registers (SystemdCgroup = true,
# cri-systemd-cgroup): what the kubelet is configured with, from here.
SOCKET = "/run/containerd/containerd.sock"
CGROUP_DRIVER = "systemd"
REGISTRY_CONFIG_PATH = "/etc/containerd/certs.d"
# An image reference: registry host[:port], path, tag (the distribution reference grammar, without digests).
IMAGE = re.compile(r"[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
REGISTRY = re.compile(r"[a-z0-9.-]+(:[0-9]+)?")
MIRROR_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~/-]*)?")
# An entry of a plain-http allowance: the one http:// URL it lets through, as the setting gives it.

DevmapperRoot = Annotated[str, path_rule(("/var/lib/containerd",), example="/var/lib/containerd/devmapper")]


def _nvidia_runtime(value: str) -> str:
    check_path(value)
    if not fullmatch(NVIDIA_RUNTIME, value):
        raise ValueError(
            "is not where the NVIDIA container toolkit installs its runtime; accepted: /usr/bin, /usr/local/bin or "
            "/usr/local/nvidia/toolkit + /nvidia-container-runtime[.cdi|.legacy]"
        )
    return value


def _module(value: str) -> str:
    if not fullmatch(MODULE, value):
        raise ValueError("is not a kernel module name; accepted: a-z 0-9 _ (at most 55), such as br_netfilter")
    return value


def _dm_name(value: str) -> str:
    if not fullmatch(DM_NAME, value):
        raise ValueError("is not a device-mapper name; accepted: A-Z a-z 0-9 _ . + - (no /), such as containerd-pool")
    return value


def _image(value: str) -> str:
    if not fullmatch(IMAGE, value):
        raise ValueError("is not an image reference; accepted: REGISTRY/PATH:TAG such as registry.k8s.io/pause:3.10")
    return value


def _registry(value: str) -> str:
    if not fullmatch(REGISTRY, value):
        raise ValueError("is not a registry host; accepted: HOST or HOST:PORT such as registry.k8s.io")
    return value


def _mirror(value: str) -> str:
    if not fullmatch(MIRROR_URL, value):
        raise ValueError(
            "is not a mirror URL; accepted: http(s)://HOST[:PORT][/PATH] such as https://mirror.example:5000"
        )
    return value


def _size(value: str) -> str:
    if not fullmatch(SIZE, value):
        raise ValueError("is not a size; accepted: a number of up to 6 digits then MB, GB or TB, such as 40GB")
    return value


# containerd and runc from the OS's own archive, per OS (/etc/os-release's ID and VERSION_ID): a Debian revision
# does not exist on Ubuntu. Each version shown real by a capture of that archive:
# debian12: bookworm's containerd 1.6.20~ds1-1+deb12u3 and runc 1.1.5+ds1-1+deb12u1 (`apt-cache policy`,
#   tests/data/realworld/apt/containerd-runc-policy-debian12-local);
# ubuntu2204: jammy-updates' containerd 1.7.12-0ubuntu2~22.04.1 and runc 1.1.12-0ubuntu2~22.04.1 (an apt install
#   log, tests/data/realworld/apt/containerd-1.7.12-runc-1.1.12-jammy-updates-install-log). jammy-updates carries
#   only its newest build, so a site keeps this one on its mirror or names its own in container_runtime_packages.
OS_PACKAGES: dict[str, dict[str, str]] = {
    "debian12": {"containerd": "1.6.20~ds1-1+deb12u3", "runc": "1.1.5+ds1-1+deb12u1"},
    "ubuntu2204": {"containerd": "1.7.12-0ubuntu2~22.04.1", "runc": "1.1.12-0ubuntu2~22.04.1"},
}


class ContainerRuntimeSettings(RoleSettings):
    """Settings of roles/container_runtime."""

    model_config = ConfigDict(alias_generator=prefixed("container_runtime"))

    packages: dict[PackageName, PackageVersion] | None = Field(
        None,
        description="OS packages at exact versions: apt preferences (priority 1001, so apt also downgrades), one "
        "install of the set, `apt-mark hold`. None: the host's OS's own (debian12: containerd "
        "1.6.20~ds1-1+deb12u3, runc 1.1.5+ds1-1+deb12u1; ubuntu2204: containerd 1.7.12-0ubuntu2~22.04.1, runc "
        "1.1.12-0ubuntu2~22.04.1).",
    )
    default_runtime: Literal["runc", "nvidia"] = Field(
        "runc",
        description="cri-nvidia-runtime: containerd's `default_runtime_name`, the runtime a pod that names "
        "none gets: runc or nvidia.",
    )
    nvidia_binary: Annotated[str, AfterValidator(_nvidia_runtime)] = Field(
        "/usr/bin/nvidia-container-runtime",
        description='cri-nvidia-runtime: `BinaryName` of the runtime "nvidia" (always registered), run as root by '
        "containerd: nvidia-container-runtime[.cdi|.legacy] in /usr/bin, /usr/local/bin or /usr/local/nvidia/toolkit.",
    )
    snapshotter: Literal["overlayfs", "devmapper"] = Field(
        "overlayfs",
        description="cri-devmapper-snapshotter (correction): overlayfs by default; devmapper needs the "
        "thin-pool below.",
    )
    devmapper_pool_name: Annotated[str, AfterValidator(_dm_name)] | None = Field(
        None,
        description="devmapper only: the LVM thin-pool's device-mapper name; required when devmapper is chosen.",
    )
    devmapper_root_path: DevmapperRoot = Field(
        "/var/lib/containerd/devmapper",
        description="devmapper only: the snapshotter's metadata folder, inside /var/lib/containerd (containerd's "
        "root).",
    )
    devmapper_base_image_size: Annotated[str, AfterValidator(_size)] = Field(
        "40GB",
        description="devmapper only: each image's base size.",
    )
    sandbox_image: Annotated[str, AfterValidator(_image)] = Field(
        "registry.k8s.io/pause:3.10",
        description="The pause image of every pod (CRI `sandbox_image`), as kubeadm 1.31 expects it; a site "
        "names its registry mirror's copy.",
    )
    allow_plain_http: tuple[PlainHttpUrl, ...] = Field(
        (),
        description="Opt-in: http:// mirror URLs container_runtime_registry_mirrors may name, each exactly as "
        "given there (containerd pulls from them by tag with nothing checked: for a lab or an isolated network).",
    )
    registry_mirrors: dict[Annotated[str, AfterValidator(_registry)], Annotated[str, AfterValidator(_mirror)]] = Field(
        default_factory=dict,
        description="Registry host -> mirror URL pulls go to first (containerd's hosts.toml under "
        "/etc/containerd/certs.d, CRI `config_path`), e.g. `{registry.k8s.io: https://mirror.example:5000}`.",
    )
    cni_bin_dir: Annotated[
        str, path_rule(("/opt/cni", "/usr/lib/cni", "/usr/libexec/cni"), inclusive=True, example="/opt/cni/bin")
    ] = Field(
        "/opt/cni/bin",
        description="CNI plugin binaries (created root 0755; the Kubernetes network add-on fills it): /opt/cni/..., "
        "or Debian's /usr/lib/cni or /usr/libexec/cni.",
    )
    cni_conf_dir: Annotated[str, path_rule(("/etc/cni",), example="/etc/cni/net.d")] = Field(
        "/etc/cni/net.d",
        description="CNI network configs (created root 0755; the Kubernetes network add-on fills it), inside /etc/cni.",
    )
    kernel_modules: tuple[Annotated[str, AfterValidator(_module)], ...] = Field(
        ("overlay", "br_netfilter"),
        description="Kernel modules containers and Kubernetes need: loaded now and listed in "
        "/etc/modules-load.d/ironserve-containers.conf.",
    )
    allow_sysctl_keys: tuple[Annotated[str, AfterValidator(check_allowed_sysctl_key)], ...] = Field(
        (),
        description="Opt-in: sysctl keys outside the catalog's that container_runtime_sysctls may set (each a "
        "bounded integer, 0 to 2147483647).",
    )
    sysctls: dict[str, str] = Field(
        default_factory=lambda: {"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"},
        description="Pod-networking sysctls: /etc/sysctl.d/91-ironserve-containers.conf, applied live; ASCII "
        "integers in the kernel's bounds, keys from the catalog (the host_tuning README lists them) or "
        "container_runtime_allow_sysctl_keys.",
    )
    swap_off: bool = Field(
        True,
        description="The kubelet refuses swap: `swapoff -a` and the swap lines of /etc/fstab commented out.",
    )

    @property
    def cgroup_driver(self) -> str:
        """The cgroup driver of containerd's runtimes, which the kubelet must use too."""
        return CGROUP_DRIVER

    @property
    def socket(self) -> str:
        return SOCKET

    @field_validator("sysctls", mode="before")
    @classmethod
    def _sysctls(cls, raw: object, info: ValidationInfo) -> dict[str, str]:
        return canonical_sysctls(raw, info.data.get("allow_sysctl_keys"), "container_runtime_allow_sysctl_keys")

    @field_validator("registry_mirrors")
    @classmethod
    def _mirrors_over_tls(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        for registry, url in value.items():
            plain_http_refused(
                url,
                info.data.get("allow_plain_http", ()),
                "container_runtime_allow_plain_http",
                f"containerd pulls {registry}'s images from it by tag with nothing checked, so anyone on the path "
                "serves the hosts any image under that name",
            )
        return value

    @field_validator("packages")
    @classmethod
    def _containerd_listed(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and "containerd" not in value:
            raise ValueError("containerd must be listed with its pinned version")
        return value

    def packages_for(self, os_key: str) -> dict[str, str]:
        """The pinned set on a host of `os_key`; ValueError naming the key when none is known for that OS."""
        if self.packages is not None:
            return self.packages
        if os_key not in OS_PACKAGES:
            raise ValueError(
                f"no containerd and runc versions are known for {os_key or 'this OS'} (known: "
                f"{', '.join(OS_PACKAGES)}); name them in container_runtime_packages"
            )
        return OS_PACKAGES[os_key]

    @model_validator(mode="after")
    def _devmapper_has_pool(self) -> ContainerRuntimeSettings:
        if self.snapshotter == "devmapper" and not self.devmapper_pool_name:
            raise ValueError(
                "container_runtime_snapshotter devmapper needs container_runtime_devmapper_pool_name "
                "(a provisioned LVM thin-pool); accepted without one: overlayfs"
            )
        return self
