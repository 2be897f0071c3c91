"""pyinfra inventory groups for the running lab."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ironserve_lab import aptrepo, charts, state
from ironserve_lab import inference as lab_inference
from ironserve_lab.paths import lab_dir

HostEntry = tuple[str, dict[str, Any]]
SAMPLES_TAG = "v11.8"  # the lab hosts' profile (r740-a10) locks CUDA 11.8


def _entry(host: state.LabHost) -> HostEntry:
    data: dict[str, Any] = {
        "ssh_hostname": host.ssh_address,
        "ssh_port": host.ssh_port,
        "ssh_user": host.ssh_user,
        "ssh_key": str(state.ssh_key_path()),
        "ssh_known_hosts_file": str(state.known_hosts_path()),
        "ssh_strict_host_key_checking": "yes",
        "ssh_allow_agent": False,
        "ssh_look_for_keys": False,
        "ironserve_profile": "r740-a10",
        # A container's kernel is the machine's: never reboot it. VMs prove the reboot for real.
        "ironserve_reboot_policy": "auto" if host.kind == "vm" else "defer",
    }
    if host.extra.get("redfish_url"):  # the simulated iDRAC beside the host (edge.py)
        data["bios_redfish_address"] = host.extra["redfish_url"]
        data["bios_credentials_file"] = str(lab_dir() / "redfish-credentials")
        # Its self-signed certificate, trusted both ways a site can: as the CA file and by its pinned fingerprint.
        data["bios_ca_file"] = host.extra.get("redfish_ca_file")
        data["bios_tls_fingerprint"] = host.extra.get("redfish_tls_fingerprint")
    if host.extra.get("aptrepo_url"):  # the lab NVIDIA mirror (aptrepo.py), as an air-gapped site's
        data["nvidia_repo_url"] = host.extra["aptrepo_url"]
        data["nvidia_repo_key"] = host.extra["aptrepo_key"]
        # The mirror also stands in for GitHub's cuda-samples archive and NVIDIA's runfile download server.
        data["nvidia_cuda_samples_url"] = f"{host.extra['aptrepo_url']}/{aptrepo.cuda_samples_path(SAMPLES_TAG)}"
        data["nvidia_cuda_samples_sha256"] = aptrepo.cuda_samples_sha256(SAMPLES_TAG)
        data["nvidia_runfile_base_url"] = host.extra["aptrepo_url"]
        data["nvidia_allow_plain_http"] = [
            data["nvidia_repo_url"],
            data["nvidia_cuda_samples_url"],
            data["nvidia_runfile_base_url"],
        ]
        # And for pkgs.k8s.io, signed by the same key: the base the kubernetes role appends /v<minor>/deb/ to.
        data["kubernetes_repo_url"] = f"{host.extra['aptrepo_url']}/{aptrepo.KUBERNETES_BASE}"
        data["kubernetes_repo_key"] = host.extra["aptrepo_key"]
        # The lab mirror serves plain http on the lab's own bridge: each URL allowed by name, as a site would.
        data["kubernetes_allow_plain_http"] = [data["kubernetes_repo_url"]]
        # And for Helm's release server and the add-ons' chart repositories (charts.py).
        data["cluster_addons_helm_base_url"] = f"{host.extra['aptrepo_url']}/{charts.HELM_DIR}"
        data["cluster_addons_helm_sha256"] = charts.helm_sha256(aptrepo.repo_dir() / "www")
        for chart_repo in ("cilium", "cert_manager", "envoy_gateway", "linkerd"):
            data[f"cluster_addons_{chart_repo}_chart_repo"] = f"{host.extra['aptrepo_url']}/{charts.CHARTS_DIR}"
        data["cluster_addons_allow_plain_http"] = [
            data["cluster_addons_helm_base_url"],
            f"{host.extra['aptrepo_url']}/{charts.CHARTS_DIR}",
        ]
    if host.extra.get("pip_index_url"):  # the lab pip index of the engine lock (wheelhouse.py)
        data["inference_pip_index_url"] = host.extra["pip_index_url"] + "/simple/"
        data["inference_allow_plain_http"] = [data["inference_pip_index_url"]]
    data.update(lab_inference.inventory_data())  # the CPU engine and the tiny model's sealed versions
    data["inference_listen_address"] = host.ssh_address  # the lab bridge is the hosts' serving network too
    if host.kind == "vm":
        # Under software emulation unpacking linux-headers and mkinitramfs each take over 10 minutes
        # (measured); the VM hosts are for GRUB and reboots, so the NVIDIA role skips both there.
        data["nvidia_kernel_headers"] = False
        data["nvidia_rebuild_initramfs"] = False
        data["nvidia_dkms"] = False  # without headers DKMS cannot build; the stand-in driver has no module
    return host.name, data


def lab_groups() -> tuple[list[HostEntry], list[HostEntry]]:
    hosts = state.load().hosts
    containers = [_entry(h) for h in hosts if h.kind == "container"]
    vms = [_entry(h) for h in hosts if h.kind == "vm"]
    return containers, vms


FLEET_INVENTORY = """\
from ironserve.inventory import site
from ironserve_lab.inventory import lab_groups

_containers, _vms = lab_groups()
_data = dict(_containers + _vms)
fleet = site([(name, _data[name]) for name in {names!r}])
"""


def write_fleet_inventory(path: Path, names: list[str]) -> Path:
    """An inventory file of these running lab hosts only, in this order (others may run lab hosts meanwhile): what a
    rollout over part of the lab is given."""
    path.write_text(FLEET_INVENTORY.format(names=names), encoding="utf-8")
    return path
