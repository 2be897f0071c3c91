"""ironserve's main deploy: `pyinfra inventory/<site>.py deploy.py`.

Only wiring: validate this host's inventory into one StackConfig, then run the roles of its groups.
An invalid inventory raises before any operation is queued, so no host is changed.
"""

from pyinfra.context import host

from ironserve.deploying import config_for
from roles.bios import bios
from roles.container_runtime import container_runtime
from roles.host_tuning import host_tuning
from roles.nvidia import nvidia
from roles.preflight import preflight
from roles.security import security

config = config_for(host)

# Hardware first (issue 3): the BIOS through the iDRAC, then the preflight gate, which stops a host
# that is physically wrong before anything else runs on it.
bios(config=config)
preflight(config=config)

# The NVIDIA stack as one pinned lock (issue 4): driver, CUDA, cuDNN, TensorRT from the signed mirror.
nvidia(config=config)

host_tuning(config=config)

# Security boundary, then the container runtime (issue 5).
security(config=config)
container_runtime(config=config)
