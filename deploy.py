"""ironserve's main deploy: `pyinfra inventory/<site>.py deploy.py`.

Only wiring: validate this host's inventory into one StackConfig, run its roles in order with the
host's shared run state, run the checks the roles left for the end (repair first, verify after), then
reboot once if any role needs it (ironserve_reboot_policy).
An inventory built with `ironserve.inventory.site()` was validated, every host, when pyinfra loaded it,
before any connection; `config_for` checks this host again before any operation is queued (the only
check for an inventory built without site()), so an invalid inventory changes no host.
Speed: ironserve.speed fetches the facts operations declare together (pyinfra reads one per command) and
replaces three of pyinfra's repeated computations; IRONSERVE_PLAIN_PYINFRA=1 (`ironserve deploy --plain-pyinfra`)
runs this deploy with pyinfra's own (ironserve/speed/README.md).
`ironserve_roles` (or `ironserve deploy --roles a,b`) narrows a run to some roles; default all.
"""

from pyinfra.context import host, state

from ironserve import speed
from ironserve.deploying import config_for, fleet_configs
from ironserve.facts import ContainerKind, OsDistro
from ironserve.reboot import reboot_for_needs
from ironserve.run import HostRun
from ironserve.speed import reads
from ironserve.speed.reads import Read
from roles import REGISTRY

# Every host's config, validated once per run; this host's own check (config_for) only where it is invalid.
fleet = fleet_configs(state, REGISTRY)
config = fleet.get(host.name) or config_for(host, REGISTRY)
# The same operation order and arguments, each computed cheaply, and the facts operations declare read in one round
# trip per host; nothing with IRONSERVE_PLAIN_PYINFRA=1 (then each read is pyinfra's, and reads.plan does nothing).
speed.install(state)
# Read while the roles are queued (which packages, whether this is a container, what a role's repository holds):
# with the first facts fetched.
selected = [role for role in REGISTRY.roles if role.name in config.roles]
reads.plan(
    [
        Read(OsDistro),
        Read(ContainerKind),
        *(r for role in selected if role.queue_reads for r in role.queue_reads(config)),
    ]
)
run = HostRun(host.name, fleet=fleet)
# host.loop: pyinfra names an operation by the line numbers of its call stack, which roles share through the
# one call below; the role's position in the registry keeps two roles' operations apart on every host.
for role in host.loop(REGISTRY.roles):
    if role.name in config.roles:
        role.deploy(config=config, run=run)
# Repair first, verify after: a role's check runs once every role has restored what it owns.
for check in host.loop(run.checks):
    check()
reboot_for_needs(
    name="Reboot once if a role needs it (ironserve_reboot_policy)",
    checks=tuple(run.reboots),
    policy=config.reboot_policy,
    timeout_s=config.reboot_timeout_s,
)
