"""Example inventory for a site of Dell R740 servers (copy to inventory/<site>.py and edit).

Run: `ironserve deploy inventory/<site>.py`, or directly `pyinfra inventory/<site>.py deploy.py`. Either
way `site()` validates every host when the file is loaded, before pyinfra connects to any: a mistake
stops the run with one report naming each host, key, value and what is accepted. Relative paths
(`site/...`, `keys/...`) are read from this file's folder, whatever the working directory.
Keys are documented in README.md and each role's README.
"""

from ironserve.inventory import site

gpu_servers = site(
    [
        # Each host's iDRAC for the BIOS role; credentials come from IRONSERVE_REDFISH_USER/_PASSWORD.
        (
            "r740-01.example.internal",
            {
                "ssh_user": "root",
                "bios_redfish_address": "https://idrac-r740-01.example.internal",
                # Envoy's listener: this host's address on the serving network, not every interface.
                "inference_listen_address": "10.20.0.11",
            },
        ),
        (
            "r740-02.example.internal",
            {
                "ssh_user": "root",
                "bios_redfish_address": "https://idrac-r740-02.example.internal",
                "inference_listen_address": "10.20.0.12",
            },
        ),
    ],
    {
        "ironserve_profile": "r740-a10",
        # The OS the servers run: one the profile's lock is published for (ubuntu2204, or debian12 from NVIDIA's
        # debian11 directory); declared, a mistake is refused before any server is contacted.
        "ironserve_os": "ubuntu2204",
        "ironserve_reboot_policy": "auto",
        "host_tuning_ntp_servers": ["ntp1.example.internal", "ntp2.example.internal"],
        # NVIDIA's CUDA repositories or the site's mirror of them (roles/nvidia appends <os>/x86_64/),
        # and the repository's signing key as a binary keyring on this machine.
        "nvidia_repo_url": "https://mirror.example.internal/cuda/repos",
        "nvidia_repo_key": "keys/cuda-archive-keyring.gpg",
        # The service's Python environment: the site's PyPI/PyTorch mirror, and the hash-locked CUDA 11.8
        # build of vLLM + torch the site generated with scripts/lock-engine.py (see roles/inference/README.md).
        "inference_pip_index_url": "https://mirror.example.internal/pypi/simple/",
        "inference_requirements": "site/requirements-cu118.lock",
        # A sealed model version (`ironserve-service seal DIR`) on this machine, uploaded to the hosts.
        "inference_model_source": "site/models/qwen2-7b/20260101-000000",
        # Model versions on the NVMe drive mounted at /data: an unmounted drive stops the deploy instead of
        # filling the system disk.
        "security_model_dir": "/data/models",
        "inference_model_store_mount": "/data",
    },
)
