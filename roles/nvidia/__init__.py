"""NVIDIA stack as one pinned lock: driver, CUDA toolkit, cuDNN, TensorRT from a signed apt repository.

Order (drv-install-sequence, with the apt method): Secure Boot gate, kernel headers, repository
(signed-by keyring, the mirror's login in apt's auth.conf.d at 0600, exact-version pins,
unattended-upgrades blacklist), nouveau blacklisted and the
initramfs rebuilt, the pinned packages (driver with its DKMS source, toolkit, cuDNN, TensorRT, container
toolkit) installed (downgrading when needed) and held, the module DKMS-built for every installed kernel,
nvidia-persistenced, CUDA_HOME, the cuda-samples source for deviceQuery, then verification of what is on
disk and what nvidia-smi reports against the lock. A loaded module older than the installed driver is a
reboot need, honoured once at the end of the deploy (ironserve.reboot).

Every step reads state through facts and changes only what differs, so a second run reports zero
changes and a drifted host (a package moved, a hold or the pin file removed) is put back.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyinfra.api.deploy import deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from ironserve.apt import (
    ClosedSet,
    apt_updated,
    held,
    installed,
    pinned_install,
    pins_in_force,
    preferences,
    repository_fetched,
    repository_offers,
    unattended_blacklist,
)
from ironserve.aptindex import upstream
from ironserve.dropins import foreign_dropins_moved_aside
from ironserve.facts import ContainerKind, OsDistro
from ironserve.modprobe import modules_not_blocked
from ironserve.operations import line_replaced, service_state, stop_host
from ironserve.owned import (
    DOWNLOADS,
    downloaded,
    downloads_ready,
    owned_absent,
    owned_file,
    owned_link,
    unmasked,
)
from ironserve.packages import pinned_packages
from ironserve.reboot import RebootCheck, read_on
from ironserve.run import HostRun
from ironserve.secrets import secret_upload
from ironserve.speed.reads import Read, read
from roles.nvidia.facts import MODULE_VERSION_COMMAND, LoadedModule, driver_reboot_reason, parse_module_version
from roles.nvidia.operations import (
    NOUVEAU_BLACKLIST,
    dkms_every_kernel,
    foreign_cuda_home_disabled,
    foreign_sources_disabled,
    kernel_headers,
    rebuild_initramfs,
    refuse_secure_boot,
    remove_runfile_driver,
    remove_strays,
    runfile_install,
    runfile_name,
    runfile_options,
    runfile_url,
    stage_cuda_samples,
    verify_stack,
)
from roles.nvidia.settings import APT_AUTH

if TYPE_CHECKING:  # the registry imports this package
    from roles import StackConfig

OWNER = "roles/nvidia"
KEYRING = "/usr/share/keyrings/ironserve-nvidia.gpg"
SOURCES_LIST = "/etc/apt/sources.list.d/ironserve-nvidia.list"
PREFERENCES = "/etc/apt/preferences.d/ironserve-nvidia.pref"
UNATTENDED_BLACKLIST = "/etc/apt/apt.conf.d/51ironserve-nvidia-blacklist"
CUDA_PROFILE = "/etc/profile.d/cuda.sh"
PERSISTENCED_UNIT = "/etc/systemd/system/nvidia-persistenced.service"
# The modules CUDA needs loaded (the driver and its unified-memory module); a modprobe.d rule must not keep them out.
NVIDIA_MODULES = ("nvidia", "nvidia_uvm")
# NVIDIA's sample unit for a runfile install (nvidia-persistenced-init in the driver's samples): the daemon forks.
PERSISTENCED_RUNFILE_UNIT = """# Managed by ironserve (roles/nvidia): the runfile ships no unit (NVIDIA's sample)
[Unit]
Description=NVIDIA Persistence Daemon
Wants=syslog.target

[Service]
Type=forking
PIDFile=/run/nvidia-persistenced/nvidia-persistenced.pid
Restart=always
ExecStart=/usr/bin/nvidia-persistenced --verbose
ExecStopPost=/bin/rm -rf /run/nvidia-persistenced

[Install]
WantedBy=multi-user.target
"""


def repository_url(repo_url: str, directory: str) -> str:
    return f"{repo_url}/{directory}/x86_64/"


def sources_line(repo_url: str, directory: str) -> str:
    return f"deb [signed-by={KEYRING}] {repository_url(repo_url, directory)} /\n"


def locked_set(config: StackConfig, roots: dict[str, str]) -> ClosedSet:
    """`roots` closed by the metadata of the repositories under nvidia_repo_url, read at the upstream versions of
    every package the profile pins in any directory (so the read is planned before the host's OS is known)."""
    every = [v for pins in (config.profile.packages or {}).values() for c in pins.values() for v in c.values()]
    return ClosedSet.of(config.nvidia.repo_url or "", roots, {upstream(v) for v in every})


def queue_reads(config: StackConfig) -> list[Read]:
    """What the role reads while it is queued, fetched with the deploy's first facts (deploy.py)."""
    return [locked_set(config, {}).index_read()] if config.nvidia.repo_url else []


def platform_refusal(config: StackConfig, os_key: str) -> str | None:
    """Why this host cannot take the profile's lock (its OS is not one the lock is published for, or not the OS
    the inventory declares), or None."""
    if config.os is not None and config.os != os_key:
        return (
            f"host {config.host}: its /etc/os-release says {os_key or 'nothing known'}, the inventory declares "
            f"ironserve_os {config.os}; nothing was changed"
        )
    try:
        config.profile.repository_for(os_key)
    except ValueError as refused:
        return f"host {config.host}: {refused}; nothing was changed"
    return None


def cuda_home_of(config: StackConfig) -> str:
    return config.nvidia.cuda_home or "/usr/local/cuda-" + ".".join(config.lock.cuda.split(".")[:2])


def samples_dir(config: StackConfig) -> str:
    """/opt/cuda-samples-<X.Y>: where the deviceQuery acceptance test builds from (cuda-devicequery-pass)."""
    return "/opt/cuda-samples-" + ".".join(config.lock.cuda.split(".")[:2])


def nvidia_deployable(config: StackConfig) -> None:
    """The repository and its key have no default: a site names its mirror of NVIDIA's CUDA repository."""
    unset = [
        key
        for key, value in (("nvidia_repo_url", config.nvidia.repo_url), ("nvidia_repo_key", config.nvidia.repo_key))
        if value is None
    ]
    if unset:
        raise ValueError(
            f"{' and '.join(unset)} must be set for the nvidia role (NVIDIA's CUDA repository base URL or a mirror "
            "of it, and its keyring file)"
        )


def driver_reboot(driver: str) -> RebootCheck:
    """A reboot is needed while the loaded module is not the installed driver (or nouveau holds the GPU)."""

    def took_effect(pyinfra_host: Any) -> None:
        loaded = parse_module_version(read_on(pyinfra_host, MODULE_VERSION_COMMAND + "; true").splitlines())
        if loaded != driver:
            raise OperationError(
                f"rebooted, but the loaded nvidia module is {loaded or 'none'}, not the driver {driver}"
            )

    return RebootCheck(
        "nvidia", lambda: driver_reboot_reason(read(LoadedModule), driver), took_effect, reads=(Read(LoadedModule),)
    )


@deploy("NVIDIA stack")
def nvidia(config: StackConfig, run: HostRun) -> None:
    lock, settings = config.lock, config.nvidia
    os_key = read(OsDistro)
    refusal = platform_refusal(config, os_key)
    if refusal:  # before any package moves: the first operation of the role that installs the lock
        stop_host(name="The lock is published for this host's OS", reason=refusal)
        return
    directory = config.profile.repository_for(os_key)
    roots = pinned_packages(config.profile.packages, directory, without=settings.skipped_components())
    # The set closed as the repository apt has fetched states it; computed again when each operation runs, so a
    # first deploy sees the repository it has just configured.
    locked = locked_set(config, roots)
    pins = locked.pins()
    runfile = settings.driver_method == "runfile"

    refuse_secure_boot(name="Secure Boot gate", shim_validation_disabled=settings.shim_validation_disabled)
    # Before the first apt command: a second source of the repository with another keyring stops them all.
    foreign_sources_disabled(
        name="No other apt source names the NVIDIA repository",
        url=repository_url(settings.repo_url or "", directory),
        own=SOURCES_LIST,
    )
    if settings.kernel_headers:
        kernel_headers(name="Kernel headers for the running and installed kernels", driver=lock.driver)
    _repository(config, directory, locked)
    repository_offers(
        name="The repository offers the whole lock (apt-get --simulate)",
        pins=pins,
        closed=locked,
        repository=repository_url(config.nvidia.repo_url or "", directory),
    )
    owned_file(
        name="Blacklist nouveau",
        path=NOUVEAU_BLACKLIST,
        content="# Managed by ironserve (roles/nvidia)\nblacklist nouveau\noptions nouveau modeset=0\n",
        clear_immutable=config.clear_immutable,
    )
    modules_not_blocked(name="No modprobe.d rule blocks the NVIDIA modules", modules=NVIDIA_MODULES)
    if settings.rebuild_initramfs:
        rebuild_initramfs(name="Rebuild the initramfs without nouveau")
    if not runfile:
        remove_runfile_driver(name="Uninstall a runfile driver (apt method)")
    pins_in_force(
        name="apt's candidates are the locked versions",
        pins=pins,
        own_file=PREFERENCES,
        priority_key="nvidia_pin_priority",
        closed=locked,
    )
    pinned_install(name="Install the locked NVIDIA packages", pins=pins, closed=locked)
    held(name="Hold the locked NVIDIA packages", names=list(pins), closed=locked)
    # The runfile replaces the apt driver: its packages go, with every sibling their relations pinned.
    apt_driver = (config.profile.packages or {}).get(directory, {}).get("driver", {})
    also = tuple(locked_set(config, dict(apt_driver)).pins()) if runfile else ()
    remove_strays(name="Remove NVIDIA packages beside the lock", keep=list(pins), lock=lock, also=also)
    if runfile:
        _runfile(config)
    if settings.dkms:
        dkms_every_kernel(name="DKMS-built module for every installed kernel", driver=lock.driver)
    _persistenced(config, runfile)
    _cuda_home(cuda_home_of(config), config.clear_immutable)
    _cuda_samples(config)
    # After every role has repaired what it owns: a failed check stops this host only once nothing is left to fix.
    run.checks.append(
        lambda: verify_stack(
            name="Verify the NVIDIA stack against the lock",
            driver=lock.driver,
            cuda=lock.cuda,
            cudnn=lock.cudnn.version,
            cuda_home=cuda_home_of(config),
            dkms=settings.dkms,
        )
    )
    run.reboots.append(driver_reboot(lock.driver))


def _repository(config: StackConfig, directory: str, locked: ClosedSet) -> None:
    settings = config.nvidia
    assert settings.repo_url is not None and settings.repo_key is not None  # nvidia_deployable
    frozen = config.clear_immutable
    key = owned_file(
        name="NVIDIA repository key", path=KEYRING, content=Path(settings.repo_key).read_bytes(), clear_immutable=frozen
    )
    if settings.repo_auth_file is not None:  # the mirror's login: 0600, never in the 0644 source, never shown
        secret_upload(name="NVIDIA mirror login (apt auth.conf.d, 0600)", src=settings.repo_auth_file, dest=APT_AUTH)
    else:
        owned_absent(name="No NVIDIA mirror login left behind", path=APT_AUTH, clear_immutable=frozen)
    source = owned_file(
        name="NVIDIA repository (signed-by)",
        path=SOURCES_LIST,
        content=sources_line(settings.repo_url, directory),
        clear_immutable=frozen,
    )
    # apt knows a restored source or key only after it fetched the index again (not only when a version moves).
    apt_updated(name="apt reads the NVIDIA repository again", _if=any_changed(key, source))
    repository_fetched(name="apt has fetched the NVIDIA repository", url=repository_url(settings.repo_url, directory))
    # The pins and the blacklist cover the packages the lock's exact-version dependencies reach, as the repository
    # just fetched states them: computed when these operations run.
    owned_file(
        name="Pin the locked versions",
        path=PREFERENCES,
        content=lambda: preferences(locked.pins(), settings.pin_priority, OWNER),
        clear_immutable=frozen,
    )
    owned_file(
        name="Keep unattended-upgrades off the lock",
        path=UNATTENDED_BLACKLIST,
        content=lambda: unattended_blacklist(list(locked.pins()), OWNER),
        clear_immutable=frozen,
    )


def _persistenced(config: StackConfig, runfile: bool) -> None:
    if runfile:
        unit = owned_file(
            name="nvidia-persistenced unit (runfile method)",
            path=PERSISTENCED_UNIT,
            content=PERSISTENCED_RUNFILE_UNIT,
            clear_immutable=config.clear_immutable,
        )
    else:  # the apt package ships its own unit; one left from a runfile install (or a mask) would override it
        unit = owned_absent(
            name="No runfile unit or mask for nvidia-persistenced",
            path=PERSISTENCED_UNIT,
            clear_immutable=config.clear_immutable,
        )
    dropins = foreign_dropins_moved_aside(
        name="No foreign drop-in on nvidia-persistenced",
        units=["nvidia-persistenced.service"],
        own=[],
        why="overrides nvidia-persistenced's unit (set it through nvidia_persistenced)",
    )
    systemd.daemon_reload(name="systemd reads the nvidia-persistenced unit", _if=any_changed(unit, dropins))
    # pyinfra restarts it only when it runs: the daemon in force then has the unit's own options again.
    systemd.service(
        name="Restart nvidia-persistenced without the foreign drop-in",
        service="nvidia-persistenced.service",
        restarted=True,
        _if=dropins.did_change,
    )
    if config.nvidia.persistenced:
        unmasked(name="nvidia-persistenced not masked", unit="nvidia-persistenced.service")
        service_state(name="Enable nvidia-persistenced", unit="nvidia-persistenced.service", enabled=True, running=True)


def _cuda_home(cuda_home: str, clear_immutable: bool) -> None:
    owned_file(
        name="CUDA_HOME for login shells",
        path=CUDA_PROFILE,
        content=(
            f"# Managed by ironserve (roles/nvidia)\nexport CUDA_HOME={cuda_home}\n"
            'case ":$PATH:" in *":$CUDA_HOME/bin:"*) ;; *) export PATH="$CUDA_HOME/bin:$PATH" ;; esac\n'
        ),
        clear_immutable=clear_immutable,
    )
    foreign_cuda_home_disabled(name="No other shell startup file sets CUDA_HOME", own=CUDA_PROFILE, cuda_home=cuda_home)
    line_replaced(
        name="CUDA_HOME for every process (/etc/environment)",
        path="/etc/environment",
        match="^CUDA_HOME=.*",
        line=f"CUDA_HOME={cuda_home}",
    )
    owned_link(
        name="/usr/local/cuda is the locked toolkit",
        path="/usr/local/cuda",
        target=cuda_home,
        clear_immutable=clear_immutable,
    )


def _runfile(config: StackConfig) -> None:
    """drv-install-runfile-flags: NVIDIA's runfile, SHA-256 checked, run with --silent --dkms --no-opengl-files
    --no-x-check (dkms from the OS first); replaces the apt driver, which remove_strays purged just before."""
    driver, container = config.lock.driver, bool(read(ContainerKind))
    if not container:
        installed(name="dkms (the runfile registers the module with it)", packages=["dkms"])
    downloads_ready(config.clear_immutable)
    path = f"{DOWNLOADS}/{runfile_name(driver)}"
    downloaded(
        name=f"{runfile_name(driver)} (SHA-256 checked)",
        src=runfile_url(config.nvidia.runfile_base_url, driver),
        dest=path,
        sha256=config.nvidia.runfile_sha256,
    )
    runfile_install(
        name="Install the driver from the runfile", path=path, driver=driver, options=runfile_options(container)
    )


def _cuda_samples(config: StackConfig) -> None:
    url, sha256 = config.nvidia.cuda_samples_url, config.nvidia.cuda_samples_sha256
    if url is None or sha256 is None:
        return
    directory = samples_dir(config)
    tarball = f"{DOWNLOADS}/{directory.rsplit('/', 1)[-1]}.tar.gz"
    downloads_ready(config.clear_immutable)
    downloaded(name="cuda-samples source (SHA-256 checked)", src=url, dest=tarball, sha256=sha256)
    stage_cuda_samples(name=f"cuda-samples source in {directory}", tarball=tarball, directory=directory, sha256=sha256)
