#!/usr/bin/env bash
# Fetch one npm package's tarball into a folder and print its path, or fail unless its sha256 is the one given.
# Usage: scripts/npm-pack-checked.sh PACKAGE@VERSION SHA256 FOLDER   (npm reaches the registry; nothing is installed)
set -euo pipefail
spec="$1" sha256="$2" folder="$3"
command -v npm >/dev/null || { echo "npm-pack-checked: npm is needed to fetch $spec" >&2; exit 1; }
echo "fetching $spec" >&2
npm pack --silent --pack-destination "$folder" "$spec" >/dev/null
tarball="$(find "$folder" -maxdepth 1 -name '*.tgz' | head -n 1)"
got="$(sha256sum "$tarball" | cut -d' ' -f1)"
if [ "$got" != "$sha256" ]; then
  echo "npm-pack-checked: $spec has sha256 $got, expected $sha256; not used" >&2
  exit 1
fi
printf '%s\n' "$tarball"
