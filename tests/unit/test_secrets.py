"""Secrets stay secret: no credential in an inventory value, a message, a rendered command, a no-op, a diff, or a
world-readable file on a host (ironserve/secrets.py and the settings of bios, nvidia and inference).

Each secret carries a unique sentinel; every text pyinfra or ironserve could show is searched for it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from operation_harness import FakeHost, FakeState, fact_key, run_operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import Directory, File, FileContents, Sha1File, Sha256File
from pyinfra.operations import files

from ironserve import secrets
from ironserve.config import ConfigError
from ironserve.kubectl import ADMIN_KUBECONFIG, SecretKeyDigest, SecretKeyState, secret_applied
from ironserve.paths import REPO_ROOT
from ironserve.secrets import (
    MASK,
    private_file,
    redact,
    redact_text,
    redact_value,
    secret_upload,
    userinfo_problem,
)
from ironserve_lab.inference import REQUIREMENTS, model_versions
from roles import check_deployable, stack_config
from roles.cluster_addons.render import cloudflare_token_secret
from roles.nvidia import SOURCES_LIST, sources_line
from roles.nvidia.settings import APT_AUTH, apt_auth_entries, machine_matches

MIRROR_SENTINEL = "s3ntinel-MIRROR-7a41"
ETCD_SENTINEL = "s3ntinel-ETCD-2b93"
IDRAC_SENTINEL = "s3ntinel-IDRAC-c0d8"
INDEX_SENTINEL = "s3ntinel-INDEX-5e6f"
TOKEN_SENTINEL = "s3ntinel-CLOUDFLARE-9d1e"
SENTINELS = (MIRROR_SENTINEL, ETCD_SENTINEL, IDRAC_SENTINEL, INDEX_SENTINEL, TOKEN_SENTINEL)
MIRROR = "https://mirror.example.internal/cuda/repos"
INFERENCE = {
    "inference_pip_index_url": "https://pypi.example.internal/simple/",
    "inference_requirements": str(REQUIREMENTS),
    "inference_model_source": str(model_versions()["lab-v1"]),
    "inference_listen_address": "10.0.0.5",
}


def private(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def assert_no_sentinel(*texts: object) -> None:
    joined = "\n".join(map(str, texts))
    leaked = [s for s in SENTINELS if s in joined]
    assert not leaked, f"{leaked} in:\n{joined}"


# --- detection and redaction on odd inputs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("https://root:calvin@idrac.example/redfish", "https://***@idrac.example/redfish"),
        ("HTTPS://root:calvin@idrac", "HTTPS://***@idrac"),
        ("https://root@idrac", "https://***@idrac"),  # a user name alone may be a token
        ("https://u:p@ss@mirror/x", "https://***@mirror/x"),  # an unencoded @ in the password: up to the last
        ("https:/\\u:p@host/x", "https:/\\***@host/x"),  # backslashes, one slash
        ("https:u:p@host", "***@host"),  # no slashes: all before the @ may be read as userinfo
        ("u:p@host/x", "***@host/x"),  # no scheme
        ("https://u:p\uff20evil.example", "https://***\uff20evil.example"),  # FULLWIDTH COMMERCIAL AT (NFKC: @)
        ("https://u:p\n@host", "https://***@host"),  # whitespace does not end the authority
        ("https://host/simple/?private_token=abc&x=1", "https://host/simple/?private_token=***&x=1"),
        ("https://u:p@host:8443/x?X-Amz-Signature=abc#f", "https://***@host:8443/x?X-Amz-Signature=***#f"),
    ],
)
def test_credentials_in_odd_urls_are_found_and_redacted(url: str, redacted: str) -> None:
    assert userinfo_problem(url) is not None
    assert redact(url) == redacted
    assert redact_value("nvidia_repo_url", url) == redacted


@pytest.mark.parametrize(
    "url",
    [
        "https://10.0.0.21",
        "https://host/pkg/@scope/x",
        "file:///srv/mirror",
        "http://127.0.0.1:2379",
        "https://h/?x=1",
        "ai-service@blue.service",  # a systemd template unit, not a login
        "root@host",  # a user name alone, without `//` before it, is no credential
    ],
)
def test_urls_without_credentials_are_left_alone(url: str) -> None:
    assert userinfo_problem(url) is None and redact(url) == url and redact_value("nvidia_repo_url", url) == url


def test_urls_inside_text_are_redacted() -> None:
    text = f"deb [signed-by=/k.gpg] https://u:{MIRROR_SENTINEL}@m/r / --index-url=https://t:{INDEX_SENTINEL}@p/simple"
    assert redact_text(text) == "deb [signed-by=/k.gpg] https://***@m/r / --index-url=https://***@p/simple"


def test_redact_value_masks_secret_keys_and_walks_nested_values() -> None:
    section = {
        "bios_redfish_address": f"https://root:{IDRAC_SENTINEL}@idrac",
        "bios_credentials_file": IDRAC_SENTINEL,  # the password typed where the path belongs
        "swap": {"etcd_url": f"http://root:{ETCD_SENTINEL}@10.0.0.5:2379", "etcd_password": ETCD_SENTINEL},
        "engine": {"extra_args": ["--x", f"--url=https://a:{INDEX_SENTINEL}@h/"]},
        "api_token": 12345,
        "port": 8080,
    }
    shown = redact_value("inference_service", section)
    assert_no_sentinel(repr(shown))
    assert shown["bios_credentials_file"] == "***" and shown["api_token"] == "***" and shown["port"] == 8080
    assert shown["swap"]["etcd_url"] == "http://***@10.0.0.5:2379"
    assert redact_value("security_user", "ai-service") == "ai-service"


# --- private files on the admin machine ------------------------------------------------------------------------


def test_private_file_accepts_0600_outside_the_repository(tmp_path: Path) -> None:
    path = private(tmp_path / "secret", MIRROR_SENTINEL)
    assert private_file(str(path)) == path.resolve()
    path.chmod(0o400)
    assert private_file(path) == path.resolve()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_private_file_refuses_group_or_world_access(tmp_path: Path, mode: int) -> None:
    path = private(tmp_path / "secret", MIRROR_SENTINEL, mode)
    with pytest.raises(ValueError, match=f"has mode {mode:04o}, readable or writable by group or others"):
        private_file(path)


def test_private_file_refuses_the_repository_a_directory_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="inside the repository"):
        private_file(REPO_ROOT / "deploy.py")
    link = tmp_path / "link"
    link.symlink_to(REPO_ROOT / "deploy.py")  # a link from outside into the repository is inside it
    with pytest.raises(ValueError, match="inside the repository"):
        private_file(link)
    os.chmod(tmp_path, 0o700)
    with pytest.raises(ValueError, match="is not a regular file"):
        private_file(tmp_path)
    with pytest.raises(ValueError, match="names no file on this machine") as info:
        private_file(MIRROR_SENTINEL)
    assert_no_sentinel(info.value)


# --- secret_upload: facts in, commands out; the content never shown ----------------------------------------------


class LoggingHost(FakeHost):
    """A fake host that keeps what operations log (pyinfra's `--diff` text goes through host.log and its logger)."""

    def __init__(self, facts: dict[Any, Any]) -> None:
        super().__init__(facts)
        self.logged: list[str] = []

    def log(self, message: str, *args: Any, **kwargs: Any) -> None:
        self.logged.append(message)


def diffing() -> FakeState:
    state = FakeState()
    state.config.DIFF = True  # pyinfra --diff
    return state


def upload_host(remote: dict[str, Any] | None, digest: str | None = None, path: str = APT_AUTH) -> LoggingHost:
    facts: dict[Any, Any] = {fact_key(File, (), {"path": path}): remote}
    if remote:
        facts[fact_key(Sha256File, (), {"path": path})] = digest
    return LoggingHost(facts)


def auth_file(tmp_path: Path, machine: str = "mirror.example.internal") -> Path:
    return private(tmp_path / "apt-auth.conf", f"machine {machine} login ironserve password {MIRROR_SENTINEL}\n")


STAGED = f"{APT_AUTH}.ironserve-new"
ROOT_0600 = {"user": "root", "group": "root", "mode": 600, "size": 60}


@pytest.mark.parametrize(
    "remote",
    [None, ROOT_0600, {**ROOT_0600, "mode": 644}],
    ids=["absent", "different", "different-and-world-readable"],
)
def test_secret_upload_creates_it_0600_before_it_holds_the_secret(
    tmp_path: Path, remote: dict[str, Any] | None, caplog: pytest.LogCaptureFixture
) -> None:
    src = auth_file(tmp_path)
    host = upload_host(remote, "0" * 64)
    with caplog.at_level(logging.DEBUG):
        commands = run_operation(secret_upload, host, diffing(), src=str(src), dest=APT_AUTH)
    assert commands == [
        "mkdir -p /etc/apt/auth.conf.d",
        f"rm -f {STAGED} && umask 077 && install -m 600 -o root -g root /dev/null {STAGED}",
        {"upload": STAGED, "src": str(src)},  # into the empty 0600 file: SFTP keeps an existing file's mode
        f"mv -f {STAGED} {APT_AUTH}",
    ]
    assert host.logged == [f"Will {'modify' if remote else 'create'} {APT_AUTH}: a secret, content not shown"]
    assert_no_sentinel(commands, host.noops, host.logged, caplog.text)


def test_secret_upload_changes_nothing_when_digest_and_mode_match(tmp_path: Path) -> None:
    src = auth_file(tmp_path)
    digest = __import__("hashlib").sha256(src.read_bytes()).hexdigest()
    host = upload_host(ROOT_0600, digest)
    assert run_operation(secret_upload, host, diffing(), src=str(src), dest=APT_AUTH) == []
    assert host.noops == [f"{APT_AUTH} holds the secret, root:root 0600 (content not shown)"]
    loose = upload_host({**ROOT_0600, "mode": 644, "group": "adm"}, digest)
    assert run_operation(secret_upload, loose, diffing(), src=str(src), dest=APT_AUTH) == [
        f"chmod 600 {APT_AUTH}",
        f"chown root:root {APT_AUTH}",
    ]
    assert_no_sentinel(host.noops, loose.logged)


def test_secret_upload_of_bytes_for_a_service_group_is_0640_before_it_is_moved_into_place() -> None:
    key = "/etc/prometheus/alertmanager-pagerduty.key"
    staged = f"{key}.ironserve-new"
    host = upload_host(None, path=key)
    commands = run_operation(secret_upload, host, diffing(), src=TOKEN_SENTINEL.encode(), dest=key, group="prometheus")
    assert commands == [
        "mkdir -p /etc/prometheus",
        f"rm -f {staged} && umask 077 && install -m 600 -o root -g root /dev/null {staged}",
        {"upload": staged, "content": TOKEN_SENTINEL},
        f"chown root:prometheus {staged} && chmod 640 {staged}",
        f"mv -f {staged} {key}",
    ]
    assert_no_sentinel(commands[:2], commands[3:], host.logged)
    digest = hashlib.sha256(TOKEN_SENTINEL.encode()).hexdigest()
    same = upload_host({**ROOT_0600, "mode": 640, "group": "prometheus"}, digest, key)
    assert run_operation(secret_upload, same, src=TOKEN_SENTINEL.encode(), dest=key, group="prometheus") == []
    assert same.noops == [f"{key} holds the secret, root:prometheus 0640 (content not shown)"]


def test_secret_upload_refuses_privilege_escalation(tmp_path: Path) -> None:
    host = upload_host(None)
    host.current_op_global_arguments = {"_sudo": True}
    with pytest.raises(OperationError, match="not uploaded with _sudo, which stages files in a world-readable"):
        run_operation(secret_upload, host, src=str(auth_file(tmp_path)), dest=APT_AUTH)


def test_files_put_would_show_a_secret_in_its_diff(caplog: pytest.LogCaptureFixture) -> None:
    """Why secret_upload exists: pyinfra's files.put prints the old and the new content with --diff."""
    dest = "/etc/x.conf"
    host = LoggingHost(
        {
            fact_key(File, (), {"path": dest}): ROOT_0600,
            fact_key(Sha1File, (), {"path": dest}): "0" * 40,
            fact_key(FileContents, (), {"path": dest}): ["old"],
            fact_key(Directory, (), {"path": "/etc"}): {"mode": 755},
        }
    )
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        run_operation(files.put, host, diffing(), src=StringIO(f"password {MIRROR_SENTINEL}\n"), dest=dest)
    assert MIRROR_SENTINEL in caplog.text


# --- the mirror's login: nvidia_repo_auth_file ------------------------------------------------------------------


def test_mirror_login_travels_only_in_the_0600_auth_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = auth_file(tmp_path)
    config = stack_config("r740-01", {"nvidia_repo_url": MIRROR, "nvidia_repo_auth_file": str(src)})
    assert config.nvidia.repo_auth_file == str(src.resolve())
    host = upload_host(None)
    with caplog.at_level(logging.DEBUG):
        commands = run_operation(secret_upload, host, diffing(), src=config.nvidia.repo_auth_file, dest=APT_AUTH)
        # The 0644 apt source the role writes next, with --diff: the mirror's URL only.
        line = sources_line(MIRROR, "debian12")
        source = LoggingHost(
            {
                fact_key(File, (), {"path": SOURCES_LIST}): None,
                fact_key(Directory, (), {"path": SOURCES_LIST}): None,
                fact_key(Directory, (), {"path": "/etc/apt/sources.list.d"}): {"mode": 755},
            }
        )
        put = run_operation(files.put, source, diffing(), src=StringIO(line), dest=SOURCES_LIST, mode="644")
    assert MIRROR in caplog.text  # the diff was shown
    assert_no_sentinel(commands, put, host.noops, host.logged, source.logged, caplog.text, repr(config))
    assert commands[1].endswith(f"install -m 600 -o root -g root /dev/null {STAGED}")


def test_the_auth_file_is_apt_auth_conf(tmp_path: Path) -> None:
    text = f"machine a.example login u password {MIRROR_SENTINEL}\nmachine http://b.example:8080/x login v password w\n"
    assert apt_auth_entries(text) == [
        {"machine": "a.example", "login": "u", "password": MIRROR_SENTINEL},
        {"machine": "http://b.example:8080/x", "login": "v", "password": "w"},
    ]
    assert machine_matches("a.example", "https://a.example/cuda")  # no protocol: https only
    assert not machine_matches("a.example", "http://a.example/cuda")
    assert machine_matches("a.example:8443/cuda", "https://a.example:8443/cuda/repos")
    assert not machine_matches("a.example/other", "https://a.example/cuda")


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"mode": 0o644}, "has mode 0644, readable or writable by group or others"),
        ({"text": f"machine mirror.example.internal password {MIRROR_SENTINEL}\n"}, "not in apt_auth.conf(5) form"),
        ({"machine": "other.example"}, "has no `machine` entry apt would use for mirror.example.internal"),
        ({"url": "http://mirror.example.internal/cuda"}, "needs an https:// nvidia_repo_url"),
    ],
)
def test_a_bad_auth_file_is_refused_without_showing_it(tmp_path: Path, data: dict[str, Any], words: str) -> None:
    path = auth_file(tmp_path, data.get("machine", "mirror.example.internal"))
    if "text" in data:
        path.write_text(data["text"])
    path.chmod(data.get("mode", 0o600))
    with pytest.raises(ConfigError) as info:
        url = data.get("url", MIRROR)
        # Plain http allowed by name: the login would still go in clear text, which the auth file's check refuses.
        allowed = [url] if url.startswith("http://") else []
        stack_config(
            "h", {"nvidia_repo_url": url, "nvidia_allow_plain_http": allowed, "nvidia_repo_auth_file": str(path)}
        )
    assert words in str(info.value) and "nvidia_repo_auth_file" in str(info.value)
    assert_no_sentinel(info.value)


def test_an_auth_file_inside_the_repository_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"nvidia_repo_auth_file: .* is inside the repository"):
        stack_config("h", {"nvidia_repo_url": MIRROR, "nvidia_repo_auth_file": str(REPO_ROOT / "deploy.py")})


# --- every URL setting refuses credentials, and the refusal never repeats them ----------------------------------

URL_CASES = [
    ("bios_redfish_address", f"https://root:{IDRAC_SENTINEL}@idrac.example", "IRONSERVE_REDFISH_PASSWORD"),
    ("bios_redfish_address", f"https:root:{IDRAC_SENTINEL}@idrac", "bios_credentials_file"),
    ("bios_redfish_address", f"https://root:{IDRAC_SENTINEL}\uff20idrac", "bios_credentials_file"),
    ("nvidia_repo_url", f"https://ironserve:{MIRROR_SENTINEL}@mirror.example/cuda", "nvidia_repo_auth_file"),
    ("nvidia_repo_url", f"https://m.example/cuda?token={MIRROR_SENTINEL}", "/etc/apt/auth.conf.d/ironserve-nvidia"),
    ("nvidia_repo_url", f"HTTPS://{MIRROR_SENTINEL}@mirror.example/cuda", "machine HOST login USER password PASS"),
    ("nvidia_runfile_base_url", f"https://u:{MIRROR_SENTINEL}@dl.example", "its SHA-256 is checked"),
    ("inference_pip_index_url", f"https://u:{INDEX_SENTINEL}@pypi.example/simple/", "netrc"),
    ("inference_pip_index_url", f"https://pypi.example/simple/?private_token={INDEX_SENTINEL}", "netrc"),
]


@pytest.mark.parametrize(("key", "url", "where"), URL_CASES)
def test_a_url_with_credentials_is_refused_with_where_they_belong(key: str, url: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        stack_config("h", {key: url})
    message = str(info.value)
    assert f"host h: {key}: carries" in message and where in message and "credentials are never inventory" in message
    assert_no_sentinel(message)


def test_the_cuda_samples_url_refuses_credentials() -> None:
    url = f"https://u:{MIRROR_SENTINEL}@mirror.example/cuda-samples.tar.gz"
    with pytest.raises(ConfigError, match="nvidia_cuda_samples_url: carries credentials") as info:
        stack_config("h", {"nvidia_cuda_samples_url": url, "nvidia_cuda_samples_sha256": "0" * 64})
    assert_no_sentinel(info.value)


@pytest.mark.parametrize(
    "service",
    [
        {"swap": {"etcd_url": f"http://root:{ETCD_SENTINEL}@10.0.0.5:2379"}},
        {"swap": {"etcd_url": f"https://10.0.0.5:2379/?password={ETCD_SENTINEL}"}},
        {"engine": {"extra_args": ["--x", f"--url=https://u:{ETCD_SENTINEL}@h/"]}},
    ],
)
def test_the_service_yaml_never_carries_credentials(service: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        check_deployable(stack_config("h", {**INFERENCE, "inference_service": service}))
    message = str(info.value)
    assert "inference_service: " in message and "carries credentials" in message
    assert "world-readable (0644)" in message and "no credentials setting" in message
    assert_no_sentinel(message)


def test_an_etcd_url_without_credentials_is_fine() -> None:
    service = {"swap": {"etcd_url": "http://10.0.0.5:2379"}}
    check_deployable(stack_config("h", {**INFERENCE, "inference_service": service, "ironserve_roles": ["inference"]}))


# --- the iDRAC's password -------------------------------------------------------------------------------------


def test_idrac_credentials_file_must_be_private_and_is_never_shown(tmp_path: Path) -> None:
    path = private(tmp_path / "idrac", f"root:{IDRAC_SENTINEL}\n", 0o644)
    address = {"bios_redfish_address": "https://10.0.0.21"}
    with pytest.raises(ConfigError, match=r"bios_credentials_file: .* has mode 0644") as info:
        stack_config("h", {**address, "bios_credentials_file": str(path)})
    assert_no_sentinel(info.value)
    path.chmod(0o600)
    config = stack_config("h", {**address, "bios_credentials_file": str(path)})
    assert_no_sentinel(repr(config), config.model_dump_json())
    with pytest.raises(ConfigError) as typed:  # the password typed in place of the path: not repeated
        stack_config("h", {**address, "bios_credentials_file": IDRAC_SENTINEL})
    assert "names no file on this machine" in str(typed.value)
    assert_no_sentinel(typed.value)


def test_turning_tls_verification_off_is_no_longer_possible() -> None:
    with pytest.raises(ConfigError) as info:
        stack_config("h", {"bios_redfish_address": "https://10.0.0.21", "bios_verify_tls": False})
    assert "bios_verify_tls: unknown key" in str(info.value)
    assert "bios_ca_file" in str(info.value) and "bios_tls_fingerprint" in str(info.value)  # what to use instead


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"bios_redfish_address": "http://10.0.0.21"}, "is plain http"),
        ({"bios_redfish_address": "https://idr\u0430c.example"}, "CYRILLIC SMALL LETTER A"),
        ({"bios_tls_fingerprint": "12:34"}, "is not a SHA-256 fingerprint"),
        ({"bios_ca_file": "/nonexistent/ca.pem"}, "is not a file on this machine"),
        ({"bios_ca_file": str(REPO_ROOT / "deploy.py")}, "holds no PEM certificate"),
    ],
)
def test_bios_trust_settings_are_checked(data: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        stack_config("h", data)


def test_a_fingerprint_is_normalised() -> None:
    colons = ":".join(["AB"] * 32)
    for given in (colons, colons.lower().replace(":", ""), f"sha256 Fingerprint={colons}"):
        assert stack_config("h", {"bios_tls_fingerprint": given}).bios.tls_fingerprint == "ab" * 32


def test_secrets_module_names_the_helpers_config_uses() -> None:
    assert secrets.redact_value is redact_value and callable(secrets.private_file)


# --- the Cloudflare token: from the deploy machine's environment into its Secret, by digest -------------------


def token_host(found: SecretKeyState | None) -> LoggingHost:
    where = {"namespace": "cert-manager", "secret": "cloudflare-api-token", "key": "api-token"}
    return LoggingHost({fact_key(SecretKeyDigest, (), {**where, "kubeconfig": ADMIN_KUBECONFIG}): found})


def test_the_token_reaches_the_host_only_inside_its_0600_upload(caplog: pytest.LogCaptureFixture) -> None:
    """secret_applied with a token the cluster does not hold: no command, fact argument, noop or log line carries
    the token or its base64 form; the upload's content does, into a file made 0600 first and removed by the apply."""
    secret = cloudflare_token_secret(TOKEN_SENTINEL)
    encoded = secret["data"]["api-token"]
    path = "/etc/ironserve/kubernetes/.cloudflare-api-token.yaml"
    host = token_host(SecretKeyState(namespace_exists=True, digest="0" * 64))
    with caplog.at_level(logging.DEBUG):
        commands = run_operation(
            secret_applied, host, diffing(), path=path, secret=secret, key="api-token", kubeconfig=ADMIN_KUBECONFIG
        )
    prepare, upload, apply = commands
    assert prepare.endswith(f"install -m 600 -o root -g root /dev/null {path}")
    assert upload["upload"] == path and encoded in upload["content"]
    assert apply.endswith(f"rm -f {path}; exit $status")
    fact_command = SecretKeyDigest().command(
        namespace="cert-manager", secret="cloudflare-api-token", key="api-token", kubeconfig=ADMIN_KUBECONFIG
    )
    said = [prepare, apply, fact_command, *host.noops, *host.logged, caplog.text]
    assert not [text for text in said if TOKEN_SENTINEL in text or encoded in text]


def test_the_token_is_compared_by_digest_and_refused_under_sudo() -> None:
    secret = cloudflare_token_secret(TOKEN_SENTINEL)
    digest = hashlib.sha256(secret["data"]["api-token"].encode()).hexdigest()
    kwargs = {"path": "/tmp/t.yaml", "secret": secret, "key": "api-token", "kubeconfig": ADMIN_KUBECONFIG}
    same = token_host(SecretKeyState(namespace_exists=True, digest=digest))
    assert run_operation(secret_applied, same, **kwargs) == []
    assert same.noops == ["Secret cert-manager/cloudflare-api-token holds the rendered api-token (compared by digest)"]
    escalated = token_host(SecretKeyState(namespace_exists=True, digest=None))
    escalated.current_op_global_arguments = {"_sudo": True}
    with pytest.raises(OperationError, match="not uploaded with _sudo"):
        run_operation(secret_applied, escalated, **kwargs)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("api key sk-" + "a1" * 16 + " given", "a1a1a1a1"),
        ("Authorization: Bearer " + "Zm9v" * 6, "Zm9vZm9v"),
        ("token ghp_" + "b2" * 12, "b2b2b2b2"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "c2lnbmF0dXJl"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIEsecret\n-----END RSA PRIVATE KEY-----", "MIIEsecret"),
        ("-----BEGIN PRIVATE KEY-----\nMIIEcut", "MIIEcut"),  # a message cut inside the block
        ("aws AKIA" + "ABCDEFGHIJKLMNOP", "ABCDEFGHIJKLMNOP"),
    ],
)
def test_a_value_shaped_like_a_credential_is_redacted_whatever_carries_it(text: str, secret: str) -> None:
    assert secret not in redact_text(text)
    assert MASK in redact_text(text)


def test_text_without_a_credential_is_left_alone() -> None:
    text = "sk-1 is short, Bearer alone, ai-service@blue.service, /srv/models/20260101-000000"
    assert redact_text(text) == text
