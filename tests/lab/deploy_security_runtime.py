"""pyinfra deploy of the security and container_runtime roles alone (issue 5 lab tests).

The same wiring as deploy.py, limited to these roles so their tests measure their own
convergence and zero-change re-run, independent of roles other work is still landing.
"""

from pyinfra.context import host

from ironserve.deploying import config_for
from roles.container_runtime import container_runtime
from roles.security import security

config = config_for(host)
security(config=config)
container_runtime(config=config)
