"""Plot one of ironserve's Grafana dashboards from a real Prometheus: each timeseries panel's queries, read from
the dashboard file an admin imports (files/monitoring/dashboard-NAME.json), run through Prometheus' query_range API
over the last minutes and drawn in the dashboard's order with its threshold lines. For the docs' picture where no
Grafana runs (none is packaged for Debian 12).

    python scripts/plot-dashboard.py --prometheus http://HOST:9090 --dashboard engine --minutes 20 --out FILE.png

Needs only matplotlib, which ironserve does not depend on: run it with a Python that has it
(`python3 -m venv /tmp/plot && /tmp/plot/bin/pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

DASHBOARDS = Path(__file__).resolve().parent.parent / "files" / "monitoring"


def grafana_to_promql(expr: str, minutes: int) -> str:
    """The query Grafana would send: every host, a one-minute rate window, the plotted range."""
    return expr.replace("$instance", ".+").replace("$__rate_interval", "1m").replace("$__range", f"{minutes}m")


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: int) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{query}", timeout=30) as answer:
        reply = json.load(answer)
    if reply.get("status") != "success":
        raise RuntimeError(f"{expr}: {reply}")
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def legend(template: str, labels: dict[str, str]) -> str:
    text = template
    for name, value in labels.items():
        text = text.replace(f"{{{{{name}}}}}", value)
    return text or ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"


def plot(prometheus: str, name: str, minutes: int, out: str) -> int:
    path = DASHBOARDS / f"dashboard-{name}.json"
    if not path.is_file():
        known = sorted(p.stem.removeprefix("dashboard-") for p in DASHBOARDS.glob("dashboard-*.json"))
        print(f"no dashboard {name!r}; accepted: {', '.join(known)}", file=sys.stderr)
        return 2
    dashboard = json.loads(path.read_text(encoding="utf-8"))
    panels = [p for p in dashboard["panels"] if p["type"] == "timeseries"]
    end = time.time()
    start = end - minutes * 60
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(14, 3.2 * rows), squeeze=False)
    empty = 0
    for axis, panel in zip(axes.flat, panels, strict=False):
        drawn = 0
        for target in panel["targets"]:
            for series in query_range(prometheus, grafana_to_promql(target["expr"], minutes), start, end, 15):
                points = [(float(t) - end, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    axis.plot([t / 60 for t, _ in points], [v for _, v in points],
                              label=legend(target.get("legendFormat", ""), series["metric"]))  # fmt: skip
                    drawn += 1
        defaults = panel["fieldConfig"]["defaults"]
        for step in defaults.get("thresholds", {}).get("steps", []):
            if step.get("value") is not None:
                axis.axhline(step["value"], color=step["color"], linestyle="--", linewidth=1)
        axis.set_title(f"{panel['title']} ({defaults.get('unit', '')})", fontsize=9)
        axis.set_xlabel("minutes ago", fontsize=8)
        axis.tick_params(labelsize=7)
        if drawn:
            axis.legend(fontsize=6, loc="upper left")
        else:
            empty += 1
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes, color="grey")
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(f"{dashboard['title']}: {prometheus}, last {minutes} minutes", fontsize=11)
    figure.tight_layout()
    figure.savefig(out, dpi=80)
    print(f"{out}: {len(panels)} panels, {len(panels) - empty} with data")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus' URL, such as http://10.0.0.5:9090")
    parser.add_argument("--dashboard", default="engine", help="the dashboard's name (files/monitoring/dashboard-NAME)")
    parser.add_argument("--minutes", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return plot(args.prometheus.rstrip("/"), args.dashboard, args.minutes, args.out)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
