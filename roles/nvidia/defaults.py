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
    # Install linux-headers for the running kernel and every installed kernel lacking the DKMS module (DKMS builds
    # the module against them). False where the module comes prebuilt (Ubuntu's linux-modules-nvidia-<branch>-
    # <flavour>) or the image carries them.
    "nvidia_kernel_headers": True,
    # Rebuild the initramfs (update-initramfs -u -k all) when an initrd predates the nouveau blacklist.
    "nvidia_rebuild_initramfs": True,
    # Enable and start nvidia-persistenced (keeps the driver initialised between CUDA processes).
    "nvidia_persistenced": True,
    # Install the profile's NVIDIA container toolkit (component container_toolkit), pinned and held with the lock.
    "nvidia_container_toolkit": True,
    # Verify the driver module is DKMS-built for every installed kernel and `dkms autoinstall -k` any that lacks it;
    # False where the module comes prebuilt (Ubuntu's linux-modules-nvidia-<branch>-<flavour>).
    "nvidia_dkms": True,
    # URL of the NVIDIA/cuda-samples source tarball for the lock's CUDA line (GitHub's archive of tag v11.8, or a
    # site mirror of it), unpacked into /opt/cuda-samples-<X.Y> for deviceQuery; None: not staged.
    "nvidia_cuda_samples_url": None,
    # SHA-256 of that tarball (64 lowercase hex digits); required with nvidia_cuda_samples_url.
    "nvidia_cuda_samples_sha256": None,
    # How the driver is installed: "apt" (the profile's driver packages, pinned and held) or "runfile" (NVIDIA's
    # NVIDIA-Linux-x86_64-<driver>.run with --silent --dkms --no-opengl-files --no-x-check, SHA-256 checked).
    "nvidia_driver_method": "apt",
    # Base URL of NVIDIA's driver downloads or a mirror of them; the role appends
    # XFree86/Linux-x86_64/<driver>/NVIDIA-Linux-x86_64-<driver>.run (the lock's driver).
    "nvidia_runfile_base_url": "https://us.download.nvidia.com",
    # SHA-256 of that runfile (64 lowercase hex digits); required with nvidia_driver_method runfile.
    "nvidia_runfile_sha256": None,
}
