"""ironserve's speed work over pyinfra 3.10, in one place, behind one switch (README.md here: what each piece does,
what it saves, how it is proven equal to pyinfra's own, and what pyinfra would need for ironserve to drop it).

- `reads`: operations declare the facts they read (`@reading_operation(reads=...)`, `read`), and a host's declared
  facts are fetched in one shell command (`bundle`, the only module that imports private pyinfra names).
- `replacements`: three pyinfra functions that redo unchanging work for every operation, rebound to cheap ones.

`IRONSERVE_PLAIN_PYINFRA=1` (or `ironserve deploy --plain-pyinfra`) turns all of it off: `install` then rebinds
nothing and installs no fact record, so every fact is one `host.get_fact`, operations are pyinfra's own
`operation()` of their bodies, and neither `bundle` nor `replacements` is imported. A pyinfra upgrade, or a
debugging session, can compare the two by switching.
"""

from __future__ import annotations

import os
from typing import Any

PLAIN_PYINFRA = "IRONSERVE_PLAIN_PYINFRA"


def enabled() -> bool:
    """Whether the speed work is on: unless IRONSERVE_PLAIN_PYINFRA is set to anything but "" or "0". Read each
    time it is asked (as each operation is queued): `ironserve deploy --plain-pyinfra` sets it after the roles are
    imported."""
    return os.environ.get(PLAIN_PYINFRA, "") in ("", "0")


def install(state: Any) -> None:
    """Once per host's deploy file (deploy.py), before any operation is queued: pyinfra's three repeated
    computations replaced and the fact record kept on this pyinfra state; nothing with the switch on."""
    if not enabled():
        return
    from ironserve.speed import reads, replacements

    replacements.pyinfra_without_repeated_work()
    reads.install(state)
