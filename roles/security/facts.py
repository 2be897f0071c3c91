"""Facts of the security role."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from pyinfra.api.facts import FactBase


class PasswordState(FactBase[str | None]):
    """locked, empty or set: the account's password field in /etc/shadow; None when the account is missing."""

    def command(self, user: str) -> str:
        return f"getent shadow {shlex.quote(user)} | cut -d: -f2 || true"

    def process(self, output: Iterable[str]) -> str | None:
        lines = list(output)
        if not lines:
            return None
        field = lines[0].strip()
        if field.startswith(("!", "*")):
            return "locked"
        return "empty" if field == "" else "set"
