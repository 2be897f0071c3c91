#!/usr/bin/env bash
# Build the lab's real Kubernetes 1.20.2 node binaries from Debian 12's `kubernetes` source package, once.
#
# The lab node (lab/src/ironserve_lab/kubernetes_node.py) runs these: a real control plane and a real kubelet, as an
# oracle for API and kubelet behaviour (never the version ironserve pins for sites). Output, outside the
# repository like the lab's root file systems:
#   $IRONSERVE_CACHE/kubernetes-1.20.2/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kubeadm,kubectl,pause}
#   $IRONSERVE_CACHE/kubernetes-1.20.2/bin/lab-gpu-device-plugin   (the lab's stand-in device plugin, see below)
#   $IRONSERVE_CACHE/kubernetes-1.20.2/debs/containernetworking-plugins_*.deb   (the CNI plugins for the VM)
# A stamp file naming the components (and the stand-in plugin's source hash) marks a finished build; with it
# present this script does nothing. A build
# happens beside the old one and replaces it only when done, so the lab keeps running the old binaries meanwhile.
# Nothing on this machine's apt configuration changes: the source list, apt's lists and its cache are private to
# the cache directory.
set -euo pipefail

CACHE="${IRONSERVE_CACHE:-$HOME/.cache/ironserve}"
FINAL="$CACHE/kubernetes-1.20.2"
ROOT="$FINAL.building"
BIN="$ROOT/bin"
STAMP="$FINAL/.built"
# kubectl: the deploy's diff and server-side apply, run for real against the lab's API server.
# lab-gpu-device-plugin: the lab's stand-in of NVIDIA's device plugin (lab/src/ironserve_lab/files/gpu-device-plugin),
# built in this tree against the kubelet's own device-plugin API package and its vendored gRPC.
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubeadm kubectl lab-gpu-device-plugin)
PLUGIN_SOURCE="$(cd "$(dirname "$0")/.." && pwd)/lab/src/ironserve_lab/files/gpu-device-plugin/main.go"
BUILT="${COMPONENTS[*]} $(sha256sum "$PLUGIN_SOURCE" | cut -c1-16)"

# One build at a time (`make kubernetes-build` and a lab test may start at once); the second finds the stamp.
mkdir -p "$CACHE"
exec 9>"$CACHE/kubernetes-build.lock"
flock 9
if [ -e "$STAMP" ] && [ "$(cat "$STAMP")" = "$BUILT" ]; then
  exit 0
fi

for tool in go gcc rsync dpkg-source apt-get; do  # rsync: the Kubernetes makefiles copy with it
  command -v "$tool" >/dev/null || { echo "build-kubernetes: $tool not found (run scripts/setup.sh)" >&2; exit 1; }
done

started=$(date +%s)
rm -rf "$ROOT"
mkdir -p "$ROOT/apt/lists/partial" "$ROOT/apt/cache/archives/partial" "$ROOT/src" "$BIN" "$ROOT/debs"

# deb and deb-src entries for the archives this machine already uses, read now (mirror and suites are the
# machine's): the source package, and the CNI plugins' .deb, from lists of this script's own.
sources="$ROOT/apt/debian.sources"
python3 - "$sources" <<'EOF'
import glob, sys

stanzas = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for block in open(path).read().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            if line.strip() and not line.startswith("#") and ":" in line:
                key, value = line.split(":", 1)
                fields[key.strip()] = value.strip()
        if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
            stanzas.append(fields)
try:
    lines = open("/etc/apt/sources.list").read().splitlines()
except FileNotFoundError:
    lines = []
for line in lines:
    words = line.split("#", 1)[0].split()
    if words[:1] == ["deb"]:
        words = [w for w in words[1:] if not w.startswith("[")]  # options are dropped; Signed-By is set below
        stanzas.append({"URIs": words[0], "Suites": words[1], "Components": " ".join(words[2:])})
if not stanzas:
    sys.exit("build-kubernetes: no Debian apt source found in /etc/apt")
with open(sys.argv[1], "w") as out:
    for fields in stanzas:
        out.write(
            f"Types: deb deb-src\nURIs: {fields['URIs']}\nSuites: {fields['Suites']}\n"
            f"Components: {fields['Components']}\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        )
EOF
apt_private=(
  -o "Dir::Etc::SourceList=$sources" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$ROOT/apt/lists" -o "Dir::Cache=$ROOT/apt/cache"
  -o APT::Sandbox::User=root  # the private directories are root's; apt's _apt user could not write them
)
echo "build-kubernetes: fetching Debian's kubernetes source package"
apt-get "${apt_private[@]}" -qq update
(cd "$ROOT/src" && apt-get "${apt_private[@]}" -qq source kubernetes >/dev/null)
tree="$(find "$ROOT/src" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)"
head -n1 "$tree/debian/changelog" | grep -q 'really1\.20\.2' || {
  echo "build-kubernetes: $tree is not 1.20.2: $(head -n1 "$tree/debian/changelog")" >&2
  exit 1
}
echo "build-kubernetes: $(head -n1 "$tree/debian/changelog")"

# The CNI plugins the lab VM's pods use (bridge, host-local, loopback), from the same private lists.
(cd "$ROOT/debs" && apt-get "${apt_private[@]}" -qq download containernetworking-plugins)

# As debian/rules builds it: the Kubernetes makefiles want a GOPATH holding k8s.io/kubernetes
# (`go build -mod=vendor` alone fails with "updates to go.mod needed"). Static binaries; the Go build cache
# lives in the cache directory while building and is deleted with the sources after (gigabytes).
echo "build-kubernetes: building ${COMPONENTS[*]} (about 10 minutes on 2 cores)"
mkdir -p "$tree/.go/src/k8s.io" "$ROOT/home"
install -D -m 0644 "$PLUGIN_SOURCE" "$tree/cmd/lab-gpu-device-plugin/main.go"
ln -sfn ../../.. "$tree/.go/src/k8s.io/kubernetes"
(
  cd "$tree/.go/src/k8s.io/kubernetes"
  # The vendored modules are all it may use: there is no module proxy to reach.
  export GOPATH="$tree/.go" GOCACHE="$ROOT/gocache" GOPROXY=off CGO_ENABLED=0 HOME="$ROOT/home"
  make WHAT="${COMPONENTS[*]/#/cmd/}" >"$ROOT/build.log" 2>&1 || {
    tail -n 40 "$ROOT/build.log" >&2
    exit 1
  }
)
for component in "${COMPONENTS[@]}"; do
  built="$(find "$tree/_output" -type f -name "$component" -perm -u+x | head -n1)"
  [ -n "$built" ] || { echo "build-kubernetes: $component not built (see $ROOT/build.log)" >&2; exit 1; }
  install -m 0755 "$built" "$BIN/$component"
done
# The sandbox ("pause") container's program, from the same source tree, static like upstream's image.
gcc -Os -static -o "$BIN/pause" "$tree/build/pause/linux/pause.c"

"$BIN/kubelet" --version
rm -rf "$ROOT/src" "$ROOT/gocache" "$ROOT/home" "$ROOT/apt"
echo "$BUILT" >"$ROOT/.built"
rm -rf "$FINAL.old"
if [ -d "$FINAL" ]; then mv "$FINAL" "$FINAL.old"; fi
mv "$ROOT" "$FINAL"
rm -rf "$FINAL.old"
echo "build-kubernetes: built in $(($(date +%s) - started)) s into $FINAL/bin"
