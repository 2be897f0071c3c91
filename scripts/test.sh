#!/usr/bin/env bash
# `make test`'s tiers, in two lanes where the machine has room for them.
#
# The lab's VM modules (tests/lab -m vm: qemu in software emulation, waiting on guests' boots, apt and SSH) leave
# about half of two cores idle (benchmarks/RESULTS.md (14)), so the unit and service tiers run beside them; the
# container modules, which keep every core busy (four CPU vLLM engines), run after both. Each lane's output goes
# to its own log, printed whole when the lane ends, so the logs never interleave; the run fails when either lane
# or a later tier fails, after every tier has run.
set -uo pipefail
cd "$(dirname "$0")/.."

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
started=$(date +%s)
stamp() { echo "== $1 ($(($(date +%s) - started)) s into make test)"; }

stamp "lane 1: the lab's VM modules; lane 2: unit, then service tests"
python -m pytest -q --durations=30 -m vm tests/lab >"$logs/vm" 2>&1 &
vm_pid=$!
(
  python -m pytest -q --durations=15 tests/unit
  unit=$?
  cd service && python -m pytest -q --durations=15
  exit $((unit | $?))
) >"$logs/unit-service" 2>&1
unit_service=$?
stamp "lane 2 ended (exit $unit_service)"
cat "$logs/unit-service"
wait "$vm_pid"
vm=$?
stamp "lane 1 ended (exit $vm)"
cat "$logs/vm"

stamp "the lab's container modules"
python -m pytest -q --durations=30 -m "not vm" tests/lab
containers=$?
stamp "containers ended (exit $containers)"

ironserve coverage
coverage=$?
stamp "done"
for result in "$unit_service" "$vm" "$containers" "$coverage"; do
  [ "$result" -eq 0 ] || exit 1
done
