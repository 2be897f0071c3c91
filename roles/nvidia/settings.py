"""Settings of the nvidia role: its public API, every inventory key it reads with its default.

The versions themselves are not settings: they come from the profile's `lock` and `packages`.
No URL carries credentials: the mirror's login lives in the private file nvidia_repo_auth_file, installed
on the host as /etc/apt/auth.conf.d/ironserve-nvidia.conf (0600), never in the 0644 apt source.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ironserve.config import LOCAL_PATH, RoleSettings, prefixed
from ironserve.secrets import credentials_refused, private_file
from ironserve.validators import BaseUrl, PlainHttpUrl, Sha256, check_binary_keyring, path_rule, plain_http_refused

# Where CUDA toolkits live: NVIDIA's packages and runfile install under /usr/local, some sites under /opt.
CUDA_ROOTS = ("/usr/local", "/opt")

APT_AUTH = "/etc/apt/auth.conf.d/ironserve-nvidia.conf"
MIRROR_CREDENTIALS = (
    "put the login in nvidia_repo_auth_file (0600, outside the repository; apt_auth.conf(5): `machine HOST login "
    f"USER password PASS`), installed as {APT_AUTH} 0600"
)
DOWNLOAD_CREDENTIALS = (
    "serve the file where the host reaches it without a login (its SHA-256 is checked, so it needs no secrecy), "
    "e.g. on the mirror of nvidia_repo_url"
)


def apt_auth_entries(text: str) -> list[dict[str, str]]:
    """The entries of an apt_auth.conf(5) file: `machine` with its `login` and `password` (other tokens ignored)."""
    entries: list[dict[str, str]] = []
    tokens = text.split()
    for position, token in enumerate(tokens[:-1]):
        if token == "machine":
            entries.append({"machine": tokens[position + 1]})
        elif token in {"login", "password"} and entries:
            entries[-1][token] = tokens[position + 1]
    return entries


def machine_matches(machine: str, url: str) -> bool:
    """Whether apt uses the entry `machine` ([protocol://]host[:port][/path]) for `url`; without a protocol an
    entry matches https only (apt_auth.conf(5))."""
    target = urllib.parse.urlsplit(url)
    protocol, _, rest = machine.rpartition("://")
    if (protocol or "https") != target.scheme:
        return False
    authority, _, path = rest.partition("/")
    host, _, port = authority.partition(":")
    return (
        host.lower() == (target.hostname or "")
        and (not port or port == str(target.port or 443))
        and target.path.lstrip("/").startswith(path)
    )


PLAIN_HTTP = (
    "anyone on the path sees what the hosts install and can hold back fixes (an older signed index) or delay a download"
)


class NvidiaSettings(RoleSettings):
    """Settings of roles/nvidia."""

    model_config = ConfigDict(alias_generator=prefixed("nvidia"))

    allow_plain_http: tuple[PlainHttpUrl, ...] = Field(
        (),
        description="Opt-in: an http:// nvidia_repo_url, nvidia_cuda_samples_url or nvidia_runfile_base_url, exactly "
        "as given there (apt checks the index's signature and the downloads their SHA-256, but anyone on the path sees "
        "what the hosts install and can serve an older signed index).",
    )
    repo_url: BaseUrl | None = Field(
        None,
        description="Base URL of NVIDIA's CUDA repositories or the site's mirror; the role appends "
        "`<os>/x86_64/` (flat repository: `deb [signed-by=...] URL/<os>/x86_64/ /`). Required.",
    )
    repo_auth_file: str | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        description="A file on the deploy machine (mode 0600, outside the repository) with the mirror's login in "
        "apt_auth.conf(5) form, `machine HOST login USER password PASS`; installed as "
        "/etc/apt/auth.conf.d/ironserve-nvidia.conf (root, 0600), its content never shown. https mirrors "
        "only. None: the mirror needs no login (a file left from an earlier deploy is removed).",
    )
    repo_key: str | None = Field(
        None,
        json_schema_extra=LOCAL_PATH,
        min_length=1,
        description="Path on the deploy machine of the repository's signing key as a binary keyring "
        "(cuda-archive-keyring.gpg, or `gpg --dearmor` of an .asc); installed as "
        "/usr/share/keyrings/ironserve-nvidia.gpg. Required.",
    )
    pin_priority: int = Field(
        1001,
        ge=1001,
        le=32767,
        description="apt pin priority of the locked versions: above 1000 so apt also downgrades to them.",
    )
    cuda_home: Annotated[str, path_rule(CUDA_ROOTS, example="/usr/local/cuda-11.8")] | None = Field(
        None,
        description="CUDA_HOME in /etc/profile.d/cuda.sh and /etc/environment, and where /usr/local/cuda "
        "links; None: /usr/local/cuda-<lock's X.Y>.",
    )
    kernel_headers: bool = Field(
        True,
        description="Install linux-headers for the running kernel and every installed kernel lacking the DKMS "
        "module; false where the module comes prebuilt (Ubuntu's linux-modules-nvidia-*) or the image has them.",
    )
    rebuild_initramfs: bool = Field(
        True,
        description="Rebuild the initramfs (update-initramfs -u -k all) when an initrd predates the nouveau blacklist.",
    )
    persistenced: bool = Field(
        True,
        description="Enable and start nvidia-persistenced (keeps the driver initialised between CUDA processes).",
    )
    container_toolkit: bool = Field(
        True,
        description="Install the profile's container_toolkit packages, pinned and held with the lock; false "
        "leaves them out.",
    )
    dkms: bool = Field(
        True,
        description="Verify the driver module is DKMS-built for every installed kernel and `dkms autoinstall -k` "
        "any that lacks it; false where the module comes prebuilt.",
    )
    cuda_samples_url: str | None = Field(
        None,
        pattern=r"^(https?|file)://\S+\.tar\.gz$",
        description="URL of the NVIDIA/cuda-samples tarball of the lock's CUDA line (GitHub's archive of tag "
        "v11.8, or a mirror), unpacked into /opt/cuda-samples-<X.Y> for deviceQuery; None: not "
        "staged.",
    )
    cuda_samples_sha256: Sha256 | None = Field(
        None,
        description="SHA-256 of that tarball (64 lowercase hex digits); required with nvidia_cuda_samples_url.",
    )
    driver_method: Literal["apt", "runfile"] = Field(
        "apt",
        description="apt: the profile's driver packages, pinned and held; runfile: NVIDIA-Linux-x86_64-<driver>.run "
        "with --silent --dkms --no-opengl-files --no-x-check, SHA-256 checked.",
    )
    runfile_base_url: BaseUrl = Field(
        "https://us.download.nvidia.com",
        description="Base URL of NVIDIA's driver downloads or a mirror; the role appends "
        "XFree86/Linux-x86_64/<driver>/NVIDIA-Linux-x86_64-<driver>.run.",
    )
    runfile_sha256: Sha256 | None = Field(
        None,
        description="SHA-256 of that runfile (64 lowercase hex digits); required with nvidia_driver_method runfile.",
    )
    shim_validation_disabled: Literal["proceed", "refuse"] = Field(
        "proceed",
        description="When Secure Boot is on but shim does not validate (`mokutil --sb-state`: validation is disabled "
        "in shim): proceed (the unsigned module loads; a warning says the kernel is unprotected) or refuse.",
    )

    @field_validator("repo_url", mode="before")
    @classmethod
    def _no_mirror_credentials(cls, value: object) -> object:
        credentials_refused(value, MIRROR_CREDENTIALS)
        return value

    @field_validator("cuda_samples_url", "runfile_base_url", mode="before")
    @classmethod
    def _no_download_credentials(cls, value: object) -> object:
        credentials_refused(value, DOWNLOAD_CREDENTIALS)
        return value

    @field_validator("repo_url", "cuda_samples_url", "runfile_base_url")
    @classmethod
    def _plain_http_allowed(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            plain_http_refused(value, info.data.get("allow_plain_http", ()), "nvidia_allow_plain_http", PLAIN_HTTP)
        return value

    @field_validator("repo_auth_file")
    @classmethod
    def _private_auth_file(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = private_file(value)
        try:
            entries = apt_auth_entries(path.read_text())
        except (OSError, UnicodeDecodeError):
            raise ValueError(f"{path} cannot be read as text") from None
        if not entries or not all({"login", "password"} <= set(e) for e in entries):
            raise ValueError(
                f"{path} is not in apt_auth.conf(5) form: every `machine HOST` needs `login USER` and `password PASS`"
            )
        return str(path)

    @model_validator(mode="after")
    def _auth_file_matches_the_mirror(self) -> NvidiaSettings:
        if self.repo_auth_file is None:
            return self
        url = self.repo_url
        if url is None or not url.startswith("https://"):
            raise ValueError(
                "nvidia_repo_auth_file needs an https:// nvidia_repo_url: apt would send the login in clear text "
                "over http (and a file:// mirror needs none)"
            )
        machines = [e["machine"] for e in apt_auth_entries(Path(self.repo_auth_file).read_text())]
        if not any(machine_matches(m, url) for m in machines):
            host = urllib.parse.urlsplit(url).hostname
            raise ValueError(
                f"nvidia_repo_auth_file has no `machine` entry apt would use for {host} (machine {host}, "
                "optionally with :PORT and /PATH; without a protocol it applies to https)"
            )
        return self

    @model_validator(mode="after")
    def _samples_checksum_with_url(self) -> NvidiaSettings:
        if self.cuda_samples_url is not None and self.cuda_samples_sha256 is None:
            raise ValueError(
                "nvidia_cuda_samples_sha256 is required with nvidia_cuda_samples_url "
                "(the tarball's SHA-256, 64 hex digits)"
            )
        return self

    @model_validator(mode="after")
    def _runfile_needs_checksum_and_dkms(self) -> NvidiaSettings:
        if self.driver_method == "runfile" and self.runfile_sha256 is None:
            raise ValueError(
                "nvidia_runfile_sha256 is required with nvidia_driver_method runfile "
                "(SHA-256 of NVIDIA-Linux-x86_64-<lock driver>.run, 64 hex digits)"
            )
        if self.driver_method == "runfile" and not self.dkms:
            raise ValueError("nvidia_driver_method runfile installs with --dkms: nvidia_dkms must stay true")
        return self

    @field_validator("repo_key")
    @classmethod
    def _binary_keyring(cls, value: str | None) -> str | None:
        return None if value is None else check_binary_keyring(value)

    def skipped_components(self) -> tuple[str, ...]:
        """Lock components the profile pins but this host does not install from apt."""
        skipped = () if self.container_toolkit else ("container_toolkit",)
        return skipped + (("driver",) if self.driver_method == "runfile" else ())
