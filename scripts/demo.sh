#!/usr/bin/env bash
# The main job against the local lab: lab up -> deploy (all roles, the inference service last) ->
# acceptance gate -> report -> a completion served through Envoy from the lab host.
# Touches only the host it starts, so a lab someone else runs on this machine is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
host=$(ironserve lab up --hosts 1 | cut -f1)
if [ "${KEEP_LAB:-0}" != 1 ]; then
  trap 'ironserve lab down "$host"' EXIT
fi
echo "demo: lab host $host is up"
ironserve deploy --limit "$host" inventory/lab.py
status=0
ironserve verify --limit "$host" inventory/lab.py || status=$?
echo
echo "== invariant report (reports/$host.json) =="
python - "$host" <<'PY'
import json, pathlib, sys
results = json.loads(pathlib.Path(f"reports/{sys.argv[1]}.json").read_text())
for invariant, result in results.items():
    print(f"  {result['status']:<5} {invariant:<36} observed: {result['observed']}")
    for note in result.get("skipped", []):
        print(f"        not checked here: {note}")
PY
echo
echo "== a completion through Envoy on $host (simulated: CPU vLLM and a tiny model with random weights) =="
# The API key the deploy made on the host, read over SSH for this one call and never printed.
python -m ironserve_lab.demo "$host" || status=1
exit $status
