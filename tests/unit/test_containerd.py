"""containerd config.toml: rendered from the typed config, refused on unknown or mistyped keys."""

from __future__ import annotations

import tomllib

import pytest
from test_fact_data import real_sample

from ironserve.config import ConfigError
from ironserve.modprobe import blocks
from ironserve_lab.aptrepo import CONTAINER_TOOLKIT_CONFIG
from roles import stack_config
from roles.container_runtime.facts import config_argument
from roles.container_runtime.render import (
    DEVMAPPER,
    ContainerdConfigError,
    check_config,
    hosts_toml,
    nvidia_cli_keeps_cgroups,
    render_config,
)

SETTINGS = stack_config("h", {}).container_runtime
RUNTIMES = 'plugins."io.containerd.grpc.v1.cri".containerd.runtimes'


def test_default_render() -> None:
    text = render_config(SETTINGS)
    data = tomllib.loads(text)
    cri = data["plugins"]["io.containerd.grpc.v1.cri"]
    assert data["version"] == 2
    assert cri["containerd"]["snapshotter"] == "overlayfs"
    assert cri["containerd"]["default_runtime_name"] == "runc"
    runtimes = cri["containerd"]["runtimes"]
    assert runtimes["runc"]["options"] == {"SystemdCgroup": True}
    assert runtimes["nvidia"]["options"] == {"SystemdCgroup": True, "BinaryName": "/usr/bin/nvidia-container-runtime"}
    assert cri["cni"] == {"bin_dir": "/opt/cni/bin", "conf_dir": "/etc/cni/net.d"}
    assert DEVMAPPER not in data["plugins"]
    assert f"[{RUNTIMES}.runc.options]\nSystemdCgroup = true\n" in text


def test_the_sandbox_image_and_the_registry_config_path_are_the_kubelets() -> None:
    cri = tomllib.loads(render_config(SETTINGS))["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.10"  # kubeadm 1.31's pause, the site's mirror by setting
    assert cri["registry"] == {"config_path": "/etc/containerd/certs.d"}
    mirrored = stack_config(
        "h", {"container_runtime_sandbox_image": "mirror.example:5000/pause:3.10"}
    ).container_runtime
    assert 'sandbox_image = "mirror.example:5000/pause:3.10"' in render_config(mirrored)


@pytest.mark.parametrize(
    ("registry", "upstream"),
    [("registry.k8s.io", "https://registry.k8s.io"), ("docker.io", "https://registry-1.docker.io")],
)
def test_a_mirror_is_tried_first_then_the_registry(registry: str, upstream: str) -> None:
    # containerd's hosts.toml (docs/hosts.md): `server` is the registry itself, each [host."..."] a mirror.
    data = tomllib.loads(hosts_toml(registry, "https://mirror.example:5000"))
    assert data == {"server": upstream, "host": {"https://mirror.example:5000": {"capabilities": ["pull", "resolve"]}}}


def test_nvidia_default_and_devmapper() -> None:
    settings = stack_config(
        "h",
        {
            "container_runtime_default_runtime": "nvidia",
            "container_runtime_snapshotter": "devmapper",
            "container_runtime_devmapper_pool_name": "containerd-pool",
        },
    ).container_runtime
    data = tomllib.loads(render_config(settings))
    assert data["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "nvidia"
    assert data["plugins"][DEVMAPPER] == {
        "pool_name": "containerd-pool",
        "root_path": "/var/lib/containerd/devmapper",
        "base_image_size": "40GB",
    }


def test_devmapper_without_a_pool_is_refused_naming_the_keys() -> None:
    with pytest.raises(ConfigError, match="container_runtime_devmapper_pool_name") as raised:
        stack_config("r740-01", {"container_runtime_snapshotter": "devmapper"})
    assert "host r740-01" in str(raised.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("container_runtime_default_runtime", "crun"),
        ("container_runtime_snapshotter", "zfs"),
        ("container_runtime_packages", {"runc": "1.1.5"}),
        ("container_runtime_sysctls", {"net.ipv4.ip_forward": "on"}),
        ("container_runtime_snapshoter", "overlayfs"),
    ],
)
def test_bad_runtime_settings_refused(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match="host r740-01"):
        stack_config("r740-01", {key: value})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("SystemdCgroup = true", "SystemdCgrup = true"), "SystemdCgrup: Extra inputs are not permitted"),
        (("SystemdCgroup = true", 'SystemdCgroup = "true"'), "SystemdCgroup: Input should be a valid boolean"),
        (('snapshotter = "overlayfs"', 'snapshoter = "overlayfs"'), "snapshoter: Extra inputs"),
        (("version = 2", "version = 3"), "version"),
        (("[grpc]", "[grcp]"), "grcp"),
    ],
)
def test_schema_refuses_what_containerd_would_accept_silently(edit: tuple[str, str], message: str) -> None:
    text = render_config(SETTINGS).replace(*edit, 1)
    with pytest.raises(ContainerdConfigError, match=message):
        check_config(text)


def test_not_toml() -> None:
    with pytest.raises(ContainerdConfigError, match="not TOML"):
        check_config("version = = 2")


def test_nvidia_cli_config_uncomments_the_shipped_default_in_its_table() -> None:
    edited = nvidia_cli_keeps_cgroups(CONTAINER_TOOLKIT_CONFIG)
    assert tomllib.loads(edited)["nvidia-container-cli"]["no-cgroups"] is False
    pairs = zip(CONTAINER_TOOLKIT_CONFIG.splitlines(), edited.splitlines(), strict=True)
    changed = [(a, b) for a, b in pairs if a != b]
    assert changed == [("#no-cgroups = false", "no-cgroups = false")]  # in place, under [nvidia-container-cli]
    assert nvidia_cli_keeps_cgroups(edited) == edited  # a second run changes nothing


@pytest.mark.parametrize(
    "text",
    [
        '[nvidia-container-cli]\nno-cgroups = true\nload-kmods = true\n[nvidia-ctk]\npath = "nvidia-ctk"\n',
        '[nvidia-container-cli]\nload-kmods = true\n\n[nvidia-ctk]\npath = "nvidia-ctk"\n',
        '[nvidia-ctk]\npath = "nvidia-ctk"\n',
        "[nvidia-ctk]\n# no-cgroups = true\n[nvidia-container-cli]\nno-cgroups = true\n",
    ],
)
def test_nvidia_cli_no_cgroups_lands_under_its_table(text: str) -> None:
    parsed = tomllib.loads(nvidia_cli_keeps_cgroups(text))
    assert parsed["nvidia-container-cli"]["no-cgroups"] is False
    assert "no-cgroups" not in parsed.get("nvidia-ctk", {})


def test_nvidia_cli_config_that_is_not_toml_is_refused() -> None:
    with pytest.raises(ContainerdConfigError, match="not valid TOML"):
        nvidia_cli_keeps_cgroups("[nvidia-container-cli\nno-cgroups = true\n")


# --- /etc/nvidia-container-runtime/config.toml as NVIDIA's packages shipped it (../shared/samples/realworld) ---------

SHIPPED_CONFIGS = [
    "nvidia_ctk_config/toolkit-1.10-ubuntu-shipped.txt",
    "nvidia_ctk_config/toolkit-2019-centos-shipped.txt",
    "nvidia_ctk_config/toolkit-debian-shipped.txt",
]


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_nvidia_cli_config_as_nvidia_shipped_it_changes_one_line(name: str) -> None:
    shipped = real_sample(name).read_text()
    edited = nvidia_cli_keeps_cgroups(shipped)
    assert tomllib.loads(edited)["nvidia-container-cli"]["no-cgroups"] is False
    pairs = zip(shipped.splitlines(), edited.splitlines(), strict=True)
    assert [(a, b) for a, b in pairs if a != b] == [("#no-cgroups = false", "no-cgroups = false")]
    assert nvidia_cli_keeps_cgroups(edited) == edited


def _cli_table(text: str) -> dict[str, str]:
    """[nvidia-container-cli] keys -> their line without the comment mark: what the table sets or documents."""
    lines = text.splitlines()
    start = lines.index("[nvidia-container-cli]") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    entries = (line.lstrip("#").strip() for line in lines[start:end] if "=" in line)
    return {entry.split("=", 1)[0].strip(): entry for entry in entries}


def test_lab_toolkit_config_carries_the_shipped_cli_table() -> None:
    """The lab's stand-in config.toml documents and sets [nvidia-container-cli] as NVIDIA's Debian package does."""
    shipped = _cli_table(real_sample("nvidia_ctk_config/toolkit-debian-shipped.txt").read_text())
    assert _cli_table(CONTAINER_TOOLKIT_CONFIG) == shipped


@pytest.mark.parametrize(
    ("argv", "config"),
    [
        (["/usr/bin/containerd"], "/etc/containerd/config.toml"),
        (["/usr/bin/containerd", "--config", "/etc/containerd/other.toml"], "/etc/containerd/other.toml"),
        (["/usr/bin/containerd", "--config=/srv/c.toml", "--log-level", "debug"], "/srv/c.toml"),
        (["/usr/bin/containerd", "-c", "/srv/c.toml"], "/srv/c.toml"),
    ],
)
def test_the_config_a_running_containerd_was_started_with(argv: list[str], config: str) -> None:
    # /proc/<MainPID>/cmdline split at its NUL bytes, as the gate reads it.
    assert config_argument(argv, "/etc/containerd/config.toml") == config


@pytest.mark.parametrize(
    ("line", "blocked"),
    [
        ("blacklist nvidia", "nvidia"),
        ("install nvidia-uvm /bin/false", "nvidia_uvm"),
        ("install br_netfilter /usr/bin/true", "br_netfilter"),
        ("install overlay /sbin/modprobe --ignore-install overlay", None),  # loads it, with options
        ("blacklist nvidia_drm", None),
        ("blacklist nouveau", None),
        ("options nvidia NVreg_PreserveVideoMemoryAllocations=1", None),
    ],
)
def test_a_modprobe_rule_blocks_a_module_the_stack_needs(line: str, blocked: str | None) -> None:
    # A line of `modprobe --showconfig` or of a modprobe.d file, as the gate and the deploy read them.
    assert blocks(line, ["nvidia", "nvidia_uvm", "br_netfilter", "overlay"]) == blocked
