"""ironserve's main deploy: `pyinfra inventory/<site>.py deploy.py`.

Only wiring: validate this host's inventory into one StackConfig, then run its roles in order.
An invalid inventory raises before any operation is queued, so no host is changed.
`ironserve_roles` (or `ironserve deploy --roles a,b`) narrows a run to some roles; default all.
"""

from pyinfra.context import host

from ironserve.deploying import config_for
from roles.bios import bios
from roles.container_runtime import container_runtime
from roles.host_tuning import host_tuning
from roles.inference import inference
from roles.nvidia import nvidia
from roles.preflight import preflight
from roles.security import security

# In order: the BIOS through the iDRAC and the preflight gate stop a physically wrong host before
# anything is installed; then the pinned NVIDIA set, the OS tuning, the security boundary, the runtime,
# and the inference service on top.
ROLES = {
    "bios": bios,
    "preflight": preflight,
    "nvidia": nvidia,
    "host_tuning": host_tuning,
    "security": security,
    "container_runtime": container_runtime,
    "inference": inference,
}

config = config_for(host)
for role in config.roles:
    ROLES[role](config=config)
