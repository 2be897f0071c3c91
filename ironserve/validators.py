"""Value grammars every role's settings model shares: paths, names, versions, sysctls, kernel arguments.

One definition each, so two roles can never disagree on what a sysctl key or an absolute path is. Every
inventory value is constrained by what it is: a path by the directories it may land in, a name by its
grammar and the system's own names, a number by the range the kernel or systemd accepts. Python-side
checks use `re.fullmatch` (`$` would let a trailing newline through); the `pattern=` strings below are
compiled by pydantic-core's Rust regex engine, where `$` is the end of the text.

Each check raises ValueError with a message that says what is accepted; the core adds the host, the
inventory key and the value given.
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

# --- patterns for pydantic's `pattern=` (Rust regex: `^`/`$` are the ends of the text) ---------------------
# Debian policy 5.6.1 (package names) and 5.6.12 (versions: [epoch:]upstream[-revision]).
DEBIAN_PACKAGE = r"^[a-z0-9][a-z0-9+.-]+$"
DEBIAN_VERSION = r"^[0-9][A-Za-z0-9.+~:-]*$"
SHA256 = r"^[0-9a-f]{64}$"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# A base URL a role appends its paths to: the upstream server or the site's mirror of it over http(s), or a
# file:// copy; no trailing slash (the role adds each `/`).
BASE_URL = r"^(https?|file)://\S+[^/]$"
PackageName = Annotated[str, Field(pattern=DEBIAN_PACKAGE)]
PackageVersion = Annotated[str, Field(pattern=DEBIAN_VERSION)]
# A download's SHA-256 as sha256sum prints it: 64 lower-case hex digits.
Sha256 = Annotated[str, StringConstraints(pattern=SHA256)]
BaseUrl = Annotated[str, StringConstraints(pattern=BASE_URL)]

INT_MAX = 2**31 - 1  # a kernel `int` sysctl (proc_dointvec) holds no more


def fullmatch(pattern: str | re.Pattern[str], value: str) -> bool:
    """The whole of `value` matches (never a prefix, never up to a trailing newline)."""
    return re.fullmatch(pattern, value) is not None


def control_characters(value: str) -> list[str]:
    """Control, format (bidi overrides, zero-width), separator and unassigned characters of `value`, as U+XXXX."""
    bad = {c for c in value if unicodedata.category(c) in {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}}
    return [f"U+{ord(c):04X}" for c in sorted(bad)]


def no_control_characters(value: str, accepted: str) -> str:
    found = control_characters(value)
    if found:
        raise ValueError(f"contains control or invisible characters ({', '.join(found)}); accepted: {accepted}")
    return value


# --- paths -----------------------------------------------------------------------------------------------------

# The POSIX portable filename characters, plus @ and +: nothing a shell, a unit file or sed treats specially.
PATH_SEGMENT = re.compile(r"[A-Za-z0-9._@+-]{1,255}")
PATH_CHARACTERS = "letters, digits and . _ @ + -"
# The host's own directories: re-owning or re-moding one of these (or its well-known children) breaks the host
# or a service on it. Paths below them are judged by each setting's roots.
SYSTEM_DIRS = frozenset(
    {
        "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/lost+found",
        "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr",
        "/var", "/data",
        "/boot/efi", "/boot/grub",
        "/etc/apt", "/etc/cni", "/etc/containerd", "/etc/cron.d", "/etc/default", "/etc/ironserve", "/etc/kubernetes",
        "/etc/modules-load.d", "/etc/pam.d", "/etc/security", "/etc/ssh", "/etc/ssl", "/etc/sudoers.d",
        "/etc/sysctl.d", "/etc/systemd", "/etc/systemd/system", "/etc/tmpfiles.d",
        "/opt/cni", "/opt/ironserve",
        "/run/lock", "/run/systemd", "/run/user", "/run/ironserve",
        "/usr/bin", "/usr/include", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libexec", "/usr/local",
        "/usr/local/bin", "/usr/local/lib", "/usr/local/sbin", "/usr/local/share", "/usr/sbin", "/usr/share",
        "/usr/src",
        "/var/backups", "/var/cache", "/var/lib", "/var/local", "/var/lock", "/var/log", "/var/mail", "/var/opt",
        "/var/run", "/var/spool", "/var/tmp", "/var/www",
        "/var/lib/apt", "/var/lib/containerd", "/var/lib/dbus", "/var/lib/docker", "/var/lib/dpkg", "/var/lib/etcd",
        "/var/lib/kubelet", "/var/lib/polkit-1", "/var/lib/private", "/var/lib/prometheus", "/var/lib/sudo",
        "/var/lib/systemd", "/var/lib/ucf",
        "/var/log/apt", "/var/log/installer", "/var/log/journal", "/var/log/private", "/var/log/prometheus",
    }
)  # fmt: skip
# Kernel virtual filesystems: nothing of an inventory's is ever created there.
VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")


def is_within(path: str, root: str) -> bool:
    """`path` is `root` or below it (both normalised absolute paths)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def normalised_path_problem(value: str) -> str | None:
    """Why `value` is not a normalised absolute path of portable characters, or None."""
    if control_characters(value):
        return f"contains control or invisible characters ({', '.join(control_characters(value))})"
    if not value.startswith("/"):
        return "is not absolute (it must start with /)"
    if len(value) > 4095:
        return "is longer than PATH_MAX (4095)"
    if value != "/" and value.endswith("/"):
        return "ends with / (write it without the trailing slash)"
    if "//" in value:
        return "contains // (an empty segment)"
    segments = value.split("/")[1:]
    if any(s in {".", ".."} for s in segments):
        return "has a . or .. segment (write the directory it means)"
    bad = [s for s in segments if s and not fullmatch(PATH_SEGMENT, s)]
    if bad:
        return f"segment {bad[0]!r} has characters outside {PATH_CHARACTERS}"
    if posixpath.normpath(value) != value:
        return "is not normalised"
    return None


def check_path(value: str, *, roots: tuple[str, ...] = (), inclusive: bool = False, example: str = "") -> str:
    """An absolute, normalised path, not a system directory, inside one of `roots` when given.

    `inclusive`: a root itself is accepted (roots such as /usr/lib/cni that are the setting's own directory).
    """
    where = f"a directory inside {', '.join(roots)}" if roots else "an absolute path"
    accepted = f"{where}, normalised, of {PATH_CHARACTERS}" + (f", such as {example}" if example else "")
    problem = normalised_path_problem(value)
    if problem:
        raise ValueError(f"{problem}; accepted: {accepted}")
    if any(is_within(value, root) for root in VIRTUAL_ROOTS):
        raise ValueError(f"{value} is on a kernel virtual filesystem (/proc, /sys, /dev); accepted: {accepted}")
    inside = [r for r in roots if is_within(value, r) and (inclusive or value != r)]
    if value in SYSTEM_DIRS and not (inclusive and value in roots):
        raise ValueError(
            f"{value} is a system directory (re-owning or re-moding it would damage the host); accepted: {accepted}"
        )
    if roots and not inside:
        raise ValueError(f"{value} is outside the directories this setting may own; accepted: {accepted}")
    return value


def path_rule(roots: tuple[str, ...] = (), *, inclusive: bool = False, example: str = "") -> AfterValidator:
    """A field's path check, for `Annotated[str, path_rule(...)]`."""

    def check(value: str) -> str:
        return check_path(value, roots=roots, inclusive=inclusive, example=example)

    return AfterValidator(check)


def relative_or_absolute_path(value: str, example: str) -> str:
    """A folder on the admin machine: relative (to where ironserve runs) or absolute, normalised either way."""
    accepted = f"a normalised relative or absolute folder of {PATH_CHARACTERS}, such as {example}"
    if not value:
        raise ValueError(f"is empty; accepted: {accepted}")
    if value.startswith("/"):
        return check_path(value, example="/srv/" + example)
    problem = normalised_path_problem("/" + value)
    if problem:
        raise ValueError(f"{problem}; accepted: {accepted}")
    return value


# --- names -----------------------------------------------------------------------------------------------------

# useradd(8)/groupadd(8) on Debian: a lower-case letter first, then letters, digits, - and _; at most 32.
ACCOUNT = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# Accounts and groups the host already has: Debian's base-passwd (/usr/share/base-passwd/{passwd,group}.master),
# systemd's, and those the stack's own packages create. The security role rewrites the account's shell and home
# and locks its password, and makes the group the service's: on one of these it breaks the host (root is the
# deploy's own login) or gives the service that group's rights.
SYSTEM_ACCOUNTS = frozenset(
    {
        "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp", "proxy", "www-data",
        "backup", "list", "irc", "gnats", "nobody", "nogroup",
        "adm", "tty", "disk", "kmem", "dialout", "fax", "voice", "cdrom", "floppy", "tape", "sudo", "audio", "dip",
        "operator", "src", "shadow", "utmp", "video", "sasl", "plugdev", "staff", "users",
        "messagebus", "sshd", "polkitd", "syslog", "uuidd", "tcpdump", "tss", "avahi", "ntp", "ntpsec", "chrony",
        "statd", "dnsmasq", "netdev", "input", "kvm", "render", "sgx", "crontab", "ssl-cert", "lxd", "admin", "wheel",
        "docker", "etcd", "prometheus", "nvidia-persistenced", "kubelet", "containerd",
    }
)  # fmt: skip
ACCOUNT_ACCEPTED = "a new name of a lower-case letter then a-z 0-9 _ - (at most 32), not a system account"


def check_account(value: str) -> str:
    """A POSIX user or group name that is not an account or group the host already has."""
    if value.startswith("systemd-") or value.startswith("_") or value in SYSTEM_ACCOUNTS:
        raise ValueError(f"{value} is a system account or group of the host; accepted: {ACCOUNT_ACCEPTED}")
    if not fullmatch(ACCOUNT, value):
        raise ValueError(f"is not a user or group name; accepted: {ACCOUNT_ACCEPTED}")
    return value


# A slice: systemd.slice(5), each dash one level of the tree; no empty level, at most 255 characters.
SLICE = re.compile(r"[A-Za-z0-9_]+(-[A-Za-z0-9_]+)*\.slice")
# The manager's own slices and scope (and their subtrees): a unit file of that name overrides them.
SYSTEM_SLICES = frozenset({"-.slice", "system.slice", "user.slice", "machine.slice", "init.scope"})
SYSTEM_SLICE_TREES = ("system", "user", "machine")
SLICE_ACCEPTED = "a slice of its own such as ai-service.slice (not under system, user or machine)"


def check_slice(value: str) -> str:
    if value in SYSTEM_SLICES or value.split("-")[0].removesuffix(".slice") in SYSTEM_SLICE_TREES:
        raise ValueError(f"{value} is systemd's own (its unit file would override it); accepted: {SLICE_ACCEPTED}")
    if len(value) > 255 or not fullmatch(SLICE, value):
        raise ValueError(f"is not a slice name; accepted: {SLICE_ACCEPTED}")
    return value


# Allow-list shape: the drop-in makes a unit run as the service account under the seccomp allow-list, in the
# slice; on a unit not written for that (ssh.service: the deploy's own access; dbus, getty, systemd-*) the host
# loses what the unit does. A deny-list of system units can never be complete, so only the service's family
# of units is accepted: ai-service.service, ai-service@.service and ai-service-<name>[@<instance>].service.
SERVICE_UNIT = re.compile(r"ai-service(-[a-z0-9]+)*(@[A-Za-z0-9_.-]{0,64})?\.service")
SERVICE_UNIT_ACCEPTED = (
    "a unit of the service family: ai-service.service, ai-service@.service, ai-service-<name>.service"
)


def check_service_unit(value: str) -> str:
    if not fullmatch(SERVICE_UNIT, value):
        raise ValueError(
            "is not one of the service's units (the hardening drop-in would run a system unit as the service "
            f"account); accepted: {SERVICE_UNIT_ACCEPTED}"
        )
    return value


# The engine's CPU and memory needs, each a narrow right: CAP_SYS_NICE (the catalog's sec-cap-sys-nice: NUMA
# binding and scheduling priority of the engine's threads), CAP_IPC_LOCK (mlock of pinned host buffers for CUDA
# and NCCL, beyond RLIMIT_MEMLOCK), CAP_NET_BIND_SERVICE (a listener below 1024, such as 443, without root).
CAPABILITIES = ("CAP_SYS_NICE", "CAP_IPC_LOCK", "CAP_NET_BIND_SERVICE")
# Their bit numbers (include/uapi/linux/capability.h), as /proc/<pid>/status shows them in CapEff.
CAPABILITY_BITS = {"CAP_NET_BIND_SERVICE": 10, "CAP_IPC_LOCK": 14, "CAP_SYS_NICE": 23}
# Named in the message: these would make the service as good as root.
ROOT_EQUIVALENT = frozenset(
    {"CAP_SYS_ADMIN", "CAP_SYS_MODULE", "CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_SETUID",
     "CAP_SETGID", "CAP_CHOWN", "CAP_FOWNER", "CAP_SYS_RAWIO", "CAP_SYS_BOOT", "CAP_BPF", "CAP_NET_ADMIN",
     "CAP_SETFCAP", "CAP_SETPCAP", "CAP_MKNOD", "CAP_SYS_CHROOT", "CAP_LINUX_IMMUTABLE", "CAP_MAC_ADMIN"}
)  # fmt: skip


def check_capability(value: str) -> str:
    accepted = f"accepted: {', '.join(CAPABILITIES)}"
    if value in ROOT_EQUIVALENT:
        raise ValueError(f"{value} would make the service as good as root; {accepted}")
    if value not in CAPABILITIES:
        raise ValueError(f"is not a capability the service may hold; {accepted}")
    return value


# systemd.exec(5) Environment=: a name as the shell writes it; values are written quoted by the role.
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
# Set by the engine unit itself, or code loaded from outside the locked venv.
RESERVED_ENV = frozenset(
    {"HOME", "XDG_CACHE_HOME", "PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "BASH_ENV"}
)
ENV_MAX = 4096


def check_environment(env: Mapping[str, str]) -> dict[str, str]:
    """Names [A-Z_][A-Z0-9_]*, not reserved; values of printable characters (spaces and quotes allowed)."""
    for name, value in env.items():
        if not fullmatch(ENV_NAME, name):
            raise ValueError(f"{name!r} is not a variable name; accepted: names of [A-Z_][A-Z0-9_]* (at most 128)")
        if name in RESERVED_ENV or name.startswith("LD_"):
            raise ValueError(
                f"{name} is set by the engine unit or loads code from outside the locked environment; accepted: "
                f"other names than {', '.join(sorted(RESERVED_ENV))} and LD_*"
            )
        accepted = f"printable text of at most {ENV_MAX} characters (spaces and quotes are written quoted)"
        found = control_characters(value)
        if found:
            raise ValueError(
                f"{name}: the value contains control characters ({', '.join(found)}); accepted: {accepted}"
            )
        if len(value) > ENV_MAX:
            raise ValueError(f"{name}: the value is longer than {ENV_MAX} characters; accepted: {accepted}")
    return dict(env)


def systemd_quoted(text: str) -> str:
    """`text` as one double-quoted word of a unit file: backslash and quote escaped, % specifiers doubled."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


# Host names (RFC 1123 labels, ASCII only) or IP literals: NTP servers and the like.
HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_host(value: str) -> str:
    accepted = "an ASCII host name such as ntp1.example.internal or an IP address"
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.removesuffix(".").split(".")
    if len(value) > 253 or not all(fullmatch(HOST_LABEL, label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"is not a host name; accepted: {accepted}")
    return value


def check_port(port: int | None, what: str) -> None:
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{what}: port {port} is outside 1-65535; accepted: a port from 1 to 65535")


def check_binary_keyring(value: str) -> str:
    """A repository's signing key on the deploy machine, as apt's `signed-by` needs it: a binary keyring."""
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{value} is not a file on this machine; accepted: the repository's keyring file")
    if path.read_bytes()[:64].lstrip().startswith(b"-----BEGIN PGP"):
        raise ValueError(
            f"{value} is an ASCII-armoured key; apt's signed-by needs a binary keyring: "
            f"`gpg --dearmor < {path.name} > {path.stem}.gpg`, then name that file"
        )
    return value


# --- versions -------------------------------------------------------------------------------------------------

# The catalog's model-version-naming: YYYYMMDD-HHMMSS, a real UTC time (as `ironserve-service seal` names them).
MODEL_VERSION = re.compile(r"[0-9]{8}-[0-9]{6}")
MODEL_VERSION_ACCEPTED = "a version YYYYMMDD-HHMMSS such as 20260101-000000 (model-version-naming)"


def check_model_version(value: str) -> str:
    if not fullmatch(MODEL_VERSION, value):
        raise ValueError(f"is not a model version; accepted: {MODEL_VERSION_ACCEPTED}")
    try:
        datetime.strptime(value, "%Y%m%d-%H%M%S")
    except ValueError:
        raise ValueError(f"is not a real date and time; accepted: {MODEL_VERSION_ACCEPTED}") from None
    return value


def release_version(model_dir: Path, release_name: str = "release.json") -> str:
    """The version a sealed model's release.json records, validated before anything uses it."""
    path = model_dir / release_name
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc.__class__.__name__}); re-seal the model") from None
    if not isinstance(record, dict) or not isinstance(record.get("version"), str):
        raise ValueError(f"{path} records no version string; re-seal the model")
    if not isinstance(record.get("sha256"), str) or not fullmatch(SHA256_HEX, record["sha256"]):
        raise ValueError(f"{path} records no sha256 content hash (64 lower-case hex digits); re-seal the model")
    try:
        return check_model_version(record["version"])
    except ValueError as exc:
        raise ValueError(f"{path}: version {record['version']!r} {exc}") from None


# --- sysctls --------------------------------------------------------------------------------------------------

SYSCTL_KEY = re.compile(r"[a-z0-9_]+(\.[A-Za-z0-9_-]+)+")
DECIMAL = re.compile(r"0|[1-9][0-9]*")  # ASCII digits, no leading zero (the kernel reads 010 as 10; sysctl.d too)
PORT_PAIR = re.compile(r"(0|[1-9][0-9]*)[ \t]+(0|[1-9][0-9]*)")
WORD = re.compile(r"[a-z0-9_]{1,15}")  # TCP_CA_NAME_MAX / IFNAMSIZ: 16 with the NUL


@dataclass(frozen=True)
class SysctlSpec:
    """What one sysctl holds: an integer in [low, high], a LOW HIGH port pair, or a word."""

    kind: str = "int"  # "int" | "ports" | "word"
    low: int = 0
    high: int = INT_MAX


# The keys the catalog tunes (network_tuning; cri pod networking) and the two algorithm words ironserve documents,
# with the kernel's bounds. Documentation/admin-guide/sysctl/net.rst: rmem_max/wmem_max are the maximum socket
# buffer sizes in bytes, an int the kernel refuses below SOCK_MIN_RCVBUF/SOCK_MIN_SNDBUF (2*(2048+skb) < 4608);
# Documentation/networking/ip-sysctl.rst: tcp_slow_start_after_idle and ip_forward are BOOLEAN,
# ip_local_port_range is two ports (ironserve keeps them above the well-known ports); br_netfilter's
# bridge-nf-call-* are 0 or 1.
SYSCTLS: dict[str, SysctlSpec] = {
    "net.core.rmem_max": SysctlSpec(low=4608),
    "net.core.wmem_max": SysctlSpec(low=4608),
    "net.ipv4.tcp_slow_start_after_idle": SysctlSpec(high=1),
    "net.ipv4.ip_local_port_range": SysctlSpec(kind="ports", low=1024, high=65535),
    "net.ipv4.ip_forward": SysctlSpec(high=1),
    "net.bridge.bridge-nf-call-iptables": SysctlSpec(high=1),
    "net.bridge.bridge-nf-call-ip6tables": SysctlSpec(high=1),
    "net.ipv4.tcp_congestion_control": SysctlSpec(kind="word"),
    "net.core.default_qdisc": SysctlSpec(kind="word"),
}
# Kept for callers that ask which keys take a pair or a word.
PORT_RANGE_KEYS = frozenset(k for k, s in SYSCTLS.items() if s.kind == "ports")
WORD_KEYS = frozenset(k for k, s in SYSCTLS.items() if s.kind == "word")
SYSCTL_KEY_ACCEPTED = "a sysctl key such as net.core.rmem_max (ASCII: a-z 0-9 _ segments joined by dots)"


def check_sysctl_key(key: object) -> str:
    if not isinstance(key, str) or len(key) > 255 or not fullmatch(SYSCTL_KEY, key):
        raise ValueError(f"{key!r} is not a sysctl key; accepted: {SYSCTL_KEY_ACCEPTED}")
    return key


def _decimal(key: str, value: object, low: int, high: int) -> int:
    accepted = f"expected a non-negative integer from {low} to {high} (ASCII digits, no leading zero), got {value!r}"
    if isinstance(value, bool):
        raise ValueError(f"{key}: a boolean is not a sysctl value; use 0 or 1 ({accepted})")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and fullmatch(DECIMAL, value):
        number = int(value)
    else:
        raise ValueError(f"{key}: {accepted}")
    if not low <= number <= high:
        raise ValueError(f"{key}: {accepted}")
    return number


def sysctl_value(key: str, value: object) -> str:
    """Canonical text of a sysctl value, as `sysctl -n` prints it (fields separated by a tab)."""
    spec = SYSCTLS.get(key, SysctlSpec())
    if spec.kind == "word":
        if not isinstance(value, str) or not fullmatch(WORD, value):
            raise ValueError(f"{key}: expected a single word such as 'bbr' (a-z 0-9 _, at most 15), got {value!r}")
        return value
    if spec.kind == "ports":
        match = re.fullmatch(PORT_PAIR, value) if isinstance(value, str) else None
        if match is None:
            raise ValueError(f"{key}: expected two port numbers 'LOW HIGH' in ASCII digits, got {value!r}")
        low, high = int(match[1]), int(match[2])
        if not spec.low <= low < high <= spec.high:
            raise ValueError(f"{key}: expected {spec.low} <= LOW < HIGH <= {spec.high}, got {value!r}")
        return f"{low}\t{high}"
    return str(_decimal(key, value, spec.low, spec.high))


def canonical_sysctls(
    raw: object, allowed: Iterable[str] | None = (), opt_in_key: str = "the role's allow_sysctl_keys"
) -> dict[str, str]:
    """A mapping of sysctl key to value, each key checked and each value in `sysctl -n` form.

    A key outside the catalog's (SYSCTLS) must be in `allowed`, the role's explicit opt-in list (None: the
    opt-in list itself is invalid, reported on its own key; the catalog check is skipped).
    """
    if not isinstance(raw, Mapping):
        raise ValueError("expected a mapping of sysctl key to value")
    canonical = {}
    for key, value in raw.items():
        check_sysctl_key(key)
        if allowed is not None and key not in SYSCTLS and key not in set(allowed):
            raise ValueError(
                f"{key} is outside the catalog's sysctls; accepted: a key {opt_in_key} lists, or one of the catalog's "
                f"{len(SYSCTLS)} ({', '.join(list(SYSCTLS)[:3])}, ...; see the role README)"
            )
        canonical[key] = sysctl_value(key, value)
    return canonical


def check_allowed_sysctl_key(key: str) -> str:
    check_sysctl_key(key)
    if key.startswith("kernel.") and key.split(".")[1] in {
        "core_pattern",
        "modprobe",
        "poweroff_cmd",
        "hotplug",
        "modules_disabled",
    }:
        raise ValueError(f"{key} names a program the kernel runs as root or disables modules for good; accepted: "
                         "numeric tuning keys")  # fmt: skip
    return key


# --- kernel arguments ------------------------------------------------------------------------------------------

KERNEL_ARG = re.compile(r"(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})(=(?P<value>[A-Za-z0-9_.,:-]{1,128}))?")
# What the catalog needs and a short list of safe tuning arguments for GPU servers (each value listed):
# the unified cgroup v2 hierarchy (kernel-cgroup-v2); the IOMMU in passthrough (the preflight's iommu check,
# GPU DMA without translation cost); pci=realloc (room for the GPUs' large BARs behind above-4G decoding);
# pcie_aspm=off (no link power states on the GPU links); transparent_hugepage and numa_balancing choices
# vLLM's guidance names.
KERNEL_ARGS: dict[str, frozenset[str]] = {
    "systemd.unified_cgroup_hierarchy": frozenset({"1"}),
    "iommu": frozenset({"pt"}),
    "intel_iommu": frozenset({"on"}),
    "amd_iommu": frozenset({"on"}),
    "pci": frozenset({"realloc"}),
    "pcie_aspm": frozenset({"off"}),
    "transparent_hugepage": frozenset({"never", "madvise"}),
    "numa_balancing": frozenset({"disable"}),
}
# ironserve.<name>=<value>: an inert marker (a parameter of a module that does not exist, which the kernel
# ignores and passes to no program); the lab uses them to prove a reboot.
MARKER_ARG = re.compile(r"ironserve\.[a-z0-9_]{1,32}=[A-Za-z0-9_-]{1,32}")
# Never, opted in or not: the `auto` reboot policy would boot into a host that does not come back serving
# (a rescue shell, another init, less memory or CPUs, another root, a blacklisted driver, no mitigations).
REFUSED_KERNEL_ARGS = frozenset(
    {
        "single", "s", "S", "1", "2", "3", "4", "5", "-s", "-b", "emergency", "rescue", "init", "rdinit", "mem",
        "memmap", "maxcpus", "nr_cpus", "possible_cpus", "nosmp", "root", "rootflags", "rootfstype", "ro", "rw",
        "rd.break", "rd.shell", "rd.emergency", "rd.rescue", "rd.systemd.unit", "systemd.unit",
        "systemd.debug_shell", "systemd.mask", "systemd.run", "systemd.wants", "systemd.confirm_spawn",
        "systemd.crash_shell", "systemd.volatile", "panic", "module_blacklist", "modprobe.blacklist",
        "rd.driver.blacklist", "selinux", "apparmor", "security", "lsm", "lockdown", "mitigations", "nokaslr",
        "isolcpus", "nohz_full", "crashkernel", "kexec", "nomodeset", "acpi", "noapic",
    }
)  # fmt: skip


def kernel_arg_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def kernel_args_accepted() -> str:
    listed = ", ".join(f"{name}={'|'.join(sorted(values))}" for name, values in list(KERNEL_ARGS.items())[:4])
    return f"{listed}, ... (roles/host_tuning/README.md), or a parameter host_tuning_allow_kernel_args lists"


def check_kernel_arg(arg: str) -> str:
    """One GRUB_CMDLINE_LINUX argument's grammar, and never one that boots a host that does not serve."""
    name = kernel_arg_name(arg)
    if refused_kernel_parameter(name):
        raise ValueError(
            f"{name} is never accepted, opted in or not (the auto reboot policy would boot a host that does not "
            f"serve); accepted: {kernel_args_accepted()}"
        )
    if not fullmatch(KERNEL_ARG, arg):
        raise ValueError("is not a kernel argument; accepted: name[=value] of A-Z a-z 0-9 _ . , : -, such as iommu=pt")
    return arg


def refused_kernel_parameter(name: str) -> bool:
    return name in REFUSED_KERNEL_ARGS or name.startswith(("systemd.unit", "rd.systemd", "rd.break"))


def unlisted_kernel_args(args: Iterable[str], allowed: Iterable[str]) -> list[str]:
    """The arguments neither on the allow-list (nor inert markers) nor of a parameter the site opted in."""
    opted = set(allowed)
    unlisted = []
    for arg in args:
        name, _, value = arg.partition("=")
        listed = name in KERNEL_ARGS and value in KERNEL_ARGS[name]
        if not (listed or name in opted or fullmatch(MARKER_ARG, arg)):
            unlisted.append(arg)
    return unlisted


def check_allowed_kernel_arg_name(name: str) -> str:
    """A parameter name a site opts in to (host_tuning_allow_kernel_args)."""
    if not fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", name):
        raise ValueError("is not a kernel parameter name; accepted: a name such as pcie_port_pm, without =value")
    if refused_kernel_parameter(name):
        raise ValueError(
            f"{name} is never accepted (the auto reboot policy would boot a host that does not serve); accepted: "
            "another parameter name, such as pcie_port_pm"
        )
    return name


# An entry of a role's `<role>_allow_plain_http`: one exact http:// URL the admin accepts without TLS.
PlainHttpUrl = Annotated[str, Field(pattern=r"^http://\S+$")]


def plain_http_refused(url: str, allowed: Iterable[str], allow_key: str, opens: str) -> None:
    """ValueError when `url` is plain http and `allow_key` does not list it, URL for URL; `opens` says what a host
    on the path could then do."""
    if url.lower().startswith("http://") and url not in set(allowed):
        raise ValueError(f"{url} is plain http: {opens}; accepted: https://, or this exact URL listed in {allow_key}")
