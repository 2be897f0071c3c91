"""Public API of the nvidia role: every inventory key it reads, with its default.

Plain data only (no imports), so the configuration model can read it without importing pyinfra.
The versions themselves are not settings: they come from the profile's `lock` and `packages`.
"""

DEFAULTS: dict[str, object] = {
    # Base URL of NVIDIA's CUDA apt repositories or of the site's mirror of them (air-gapped sites); the
    # role appends `<distro>/x86_64/` (debian12, ubuntu2204). Required: there is no built-in default.
    "nvidia_repo_url": None,
    # Path, on the machine running the deploy, of the repository's signing key as a binary keyring
    # (NVIDIA's cuda-archive-keyring.gpg, or `gpg --dearmor` of an .asc); installed as the `signed-by` key.
    "nvidia_repo_key": None,
    # apt pin priority of the locked versions: above 1000 so apt also downgrades to them (drv-version).
    "nvidia_pin_priority": 1001,
    # CUDA_HOME exported system-wide (cuda-home-env); None: /usr/local/cuda-<lock's CUDA major.minor>.
    "nvidia_cuda_home": None,
    # Install linux-headers for the running kernel (DKMS builds the driver module against them). False where
    # the module comes prebuilt (Ubuntu's linux-modules-nvidia-<branch>-<flavour>) or the image carries them.
    "nvidia_kernel_headers": True,
    # Rebuild the initramfs (update-initramfs -u -k all) when an initrd predates the nouveau blacklist.
    "nvidia_rebuild_initramfs": True,
    # Enable and start nvidia-persistenced (keeps the driver initialised between CUDA processes).
    "nvidia_persistenced": True,
}
