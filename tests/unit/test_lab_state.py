"""The lab state's naming: two test sessions start hosts at once (make test's two lanes)."""

from __future__ import annotations

from ironserve_lab.state import free_name


def test_a_name_another_session_took_meanwhile_becomes_the_first_free_one_of_its_prefix() -> None:
    assert free_name("lab-c3", {"lab-c1"}) == "lab-c3"
    assert free_name("lab-c3", {"lab-c1", "lab-c3"}) == "lab-c2"
    assert free_name("lab-vm1", {"lab-vm1", "lab-vm2", "lab-c3"}) == "lab-vm3"
