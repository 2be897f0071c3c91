"""Fixtures for lab tests."""

# --- VM lab hosts (ironserve/lab/vm.py): the session-scoped `vm_host` fixture ---
from tests.lab.conftest_vm import vm_host  # noqa: F401
