#!/usr/bin/env bash
# `make test`'s tiers, in two lanes where the machine has room for them.
#
# The lab's VM modules (tests/lab -m vm: qemu in software emulation, waiting on guests' boots, apt and SSH) leave
# about half of two cores idle (benchmarks/RESULTS.md (14)), so lane 2 runs beside them: the unit and service
# tiers, then the lighter container modules (the lab takes hosts from two sessions at once: names and addresses
# are chosen under the state's lock). The two container modules that keep every core busy for long (four CPU vLLM
# engines; drift rounds of apt on several hosts) run after both lanes. Each lane's output goes to its own log,
# printed whole when the lane ends, so the logs never interleave; the run fails when any tier fails, after every
# tier has run.
set -uo pipefail
cd "$(dirname "$0")/.."

heavy=(tests/lab/test_inference_deploy.py tests/lab/test_drift.py)
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
started=$(date +%s)
stamp() { echo "== $1 ($(($(date +%s) - started)) s into make test)"; }

stamp "lane 1: the lab's VM modules; lane 2: unit, service, then the lighter container modules"
python -m pytest -q --durations=30 -m vm tests/lab >"$logs/vm" 2>&1 &
vm_pid=$!
(
  python -m pytest -q --durations=15 tests/unit
  unit=$?
  (cd service && python -m pytest -q --durations=15)
  service=$?
  stamp "lane 2: the lighter container modules"
  python -m pytest -q --durations=15 -m "not vm" tests/lab "${heavy[@]/#/--ignore=}"
  exit $((unit | service | $?))
) >"$logs/lane2" 2>&1
lane2=$?
stamp "lane 2 ended (exit $lane2)"
cat "$logs/lane2"
wait "$vm_pid"
vm=$?
stamp "lane 1 ended (exit $vm)"
cat "$logs/vm"

stamp "the heavy container modules"
python -m pytest -q --durations=30 -m "not vm" "${heavy[@]}"
containers=$?
stamp "heavy container modules ended (exit $containers)"

ironserve coverage
coverage=$?
stamp "done"
for result in "$lane2" "$vm" "$containers" "$coverage"; do
  [ "$result" -eq 0 ] || exit 1
done
