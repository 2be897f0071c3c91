"""How a role moves a host's traffic around a change: what `ironserve rollout` runs on the host.

A role that serves traffic (the inference service in systemd mode) gives the rollout three shell commands run
on the host over SSH, each idempotent and each exiting non-zero with its reason on stderr:
- `drain`: the site's load balancer sees the host as not ready, new work stops and in-flight requests finish
  within a bound; when they do not, the host is put back in service and the command fails;
- `hold`: the host stays out of its load balancer but answers its own front door again, so that the prove
  phase's gate and completion go through the path clients use;
- `restore`: the host takes traffic again.
`describe` prints one line saying what the host serves (recorded before and after the change, so a stopped
rollout states the fleet's mix).
`via` names the inventory host whose shell runs the commands when it is not the host itself: a Kubernetes node is
cordoned and drained through the API server, with the admin credentials a control plane holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficControl:
    role: str
    drain: str
    hold: str
    restore: str
    describe: str | None = None
    via: str | None = None
