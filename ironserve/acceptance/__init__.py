"""The acceptance gate: pytest-testinfra tests run by `ironserve verify` against every host over SSH.

One file per role (test_<role>.py mirrors roles/<role>); conftest.py hands each host's validated config to the
tests and writes one JSON report per host (invariant id -> pass/fail/skip + observed).
"""
