"""ironserve's main deploy: `pyinfra inventory/<site>.py deploy.py`.

Only wiring: validate this host's inventory into one StackConfig, then run the roles of its groups.
An invalid inventory raises before any operation is queued, so no host is changed.
"""

from pyinfra.context import host

from ironserve.deploying import config_for
from roles.host_tuning import host_tuning

config = config_for(host)

host_tuning(config=config)
