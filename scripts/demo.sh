#!/usr/bin/env bash
# The main job against the local lab: lab up -> deploy -> acceptance gate -> report.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${KEEP_LAB:-0}" != 1 ]; then
  trap 'ironserve lab down' EXIT
fi
ironserve lab up --hosts 1
ironserve deploy inventory/lab.py
status=0
ironserve verify inventory/lab.py || status=$?
echo
echo "== invariant report (reports/*.json) =="
python - <<'PY'
import json, pathlib
for report in sorted(pathlib.Path("reports").glob("*.json")):
    results = json.loads(report.read_text())
    print(f"{report.stem}:")
    for invariant, result in results.items():
        print(f"  {result['status']:<5} {invariant:<36} observed: {result['observed']}")
PY
exit $status
