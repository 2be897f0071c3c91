"""The site template a newcomer copies is itself a valid inventory (loaded without connecting)."""

from __future__ import annotations

from ironserve.inventory import load_inventory, validate_inventory
from ironserve.paths import REPO_ROOT


def test_example_r740_inventory_validates() -> None:
    hosts = load_inventory(str(REPO_ROOT / "inventory" / "example_r740.py"))
    configs, problems = validate_inventory(hosts)
    assert problems == []
    assert {c.profile.name for c in configs.values()} == {"r740-a10"}
    assert all(c.host_tuning.reboot_policy == "auto" for c in configs.values())
