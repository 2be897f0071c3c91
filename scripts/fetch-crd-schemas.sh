#!/usr/bin/env bash
# Fetch the pinned npm packages of files/cluster_addons/crd-schemas.lock into the cache (outside the repo),
# check each tarball's sha256, unpack it, and build the closed JSON Schemas the cluster add-ons' custom
# resources are validated against ($IRONSERVE_CACHE/crd-schemas/schemas.json). Idempotent: a package whose
# unpacked copy carries the locked sha256 is not fetched again; the schemas are rebuilt when the lock changes.
# Needs npm (Debian: `apt-get install npm`) only when something must be fetched.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${IRONSERVE_CACHE:-$HOME/.cache/ironserve}"
DEST="$CACHE/crd-schemas"
LOCK=files/cluster_addons/crd-schemas.lock
PYTHON="${PYTHON:-${IRONSERVE_VENV:-$CACHE/venv}/bin/python}"
mkdir -p "$DEST"

while read -r package version sha256 _; do
  case "$package" in "" | "#"*) continue ;; esac
  dir="$DEST/$(printf '%s' "$package" | tr -d '@' | tr '/' '-')-$version"
  if [ -f "$dir/.sha256" ] && [ "$(cat "$dir/.sha256")" = "$sha256" ]; then
    continue
  fi
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  tarball="$(bash scripts/npm-pack-checked.sh "$package@$version" "$sha256" "$work")"
  rm -rf "$dir.new"
  mkdir -p "$dir.new"
  tar -xzf "$tarball" -C "$dir.new" --strip-components=1
  printf '%s\n' "$sha256" >"$dir.new/.sha256"
  rm -rf "$dir"
  mv "$dir.new" "$dir"
  rm -rf "$work"
  trap - EXIT
done <"$LOCK"

IRONSERVE_CACHE="$CACHE" "$PYTHON" -c 'from roles.cluster_addons.models_crd import main; raise SystemExit(main(["build"]))'
