"""The deploy with pyinfra's own functions (IRONSERVE_PLAIN_PYINFRA=1, `ironserve deploy --plain-pyinfra`): none of
ironserve.speed, so a pyinfra upgrade can be judged by switching (ironserve/speed/README.md).

One fresh container lab host: three host roles converge with the switch on (the environment variable) and re-run
with zero changes (the flag). Both wall times are printed beside the test's result. The roles are those whose
operations are most of ironserve's own (owned files, sysctl, systemd units, users, lines, pyinfra operations composed
with `_inner`), without the hardware and package work of bios, preflight and nvidia: CI's time is tight.
"""

from __future__ import annotations

import time

import pytest

from ironserve.speed import PLAIN_PYINFRA
from ironserve_lab.deploying import deploy
from tests.lab.conftest import lab_containers

pytestmark = pytest.mark.lab
ROLES = ("host_tuning", "security", "container_runtime")


def test_plain_pyinfra_converges_then_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with lab_containers(1) as hosts:
        started = time.monotonic()
        first = deploy(hosts, roles=ROLES, environ={PLAIN_PYINFRA: "1"})
        converged = time.monotonic()
        again = deploy(hosts, roles=ROLES, plain_pyinfra=True)
        done = time.monotonic()
    assert first.returncode == 0, first.output[-6000:]
    assert first.changed > 0 and first.errors == 0, first.output[-6000:]
    assert again.returncode == 0, again.output[-6000:]
    assert (again.changed, again.errors) == (0, 0), again.output[-6000:]
    with capsys.disabled():
        print(
            f"\nplain pyinfra, {', '.join(ROLES)} on one container host: "
            f"converge {converged - started:.1f} s ({first.changed} changes), "
            f"no-op re-run {done - converged:.1f} s"
        )
