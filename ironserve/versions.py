"""Version strings as NVIDIA and Debian write them (525.85.12, 11.8.0, 8.6.1.6, 0.6.1.post1)."""

from __future__ import annotations

import re
from functools import total_ordering

# ASCII digits only (\d takes any script's digits), the whole text (`$` would let a trailing newline through).
VERSION_PATTERN = re.compile(r"[0-9]+(\.[0-9]+)*(\.post[0-9]+)?")


@total_ordering
class Version:
    """Dotted numeric version compared part by part (so 525.85.12 > 525.60.13 and 12.10 > 12.9)."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not VERSION_PATTERN.fullmatch(text):
            raise ValueError(f"malformed version {text!r}: expected dotted numbers such as 525.85.12")
        self.text = text
        self.parts = tuple(int(p) for p in text.replace(".post", ".").split("."))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self.parts == other.parts

    def __lt__(self, other: Version) -> bool:
        return self.parts < other.parts

    def __hash__(self) -> int:
        return hash(self.parts)

    def __repr__(self) -> str:
        return f"Version({self.text!r})"


def major_minor(text: str) -> str:
    parts = Version(text).parts
    return f"{parts[0]}.{parts[1]}"
