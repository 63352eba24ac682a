#!/usr/bin/env bash
# Builds one container image per service with one command:
#
#   images/build.sh            # every image
#   images/build.sh proxy-server proxy-agent
#
# Binaries are built static (release profile `image`, target
# x86_64-unknown-linux-musl) so each image is FROM scratch with nothing but
# the binary. Images are tagged $IMAGE_REPO/<name>:$IMAGE_TAG (defaults
# localhost/cluster-proxy and the workspace version), which is what
# e2e/tests/images.rs runs.
#
# Environment: IMAGE_REPO, IMAGE_TAG, CARGO_TARGET_DIR (honoured as cargo does).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

triple=x86_64-unknown-linux-musl
profile=image
control_profile=image-control
all_images=(proxy-server proxy-agent cert-authority addon-manager health-prober user-server)
# Binaries each image holds (the agent image also runs addon-agent, and
# `proxy-agent service-proxy` is the service-proxy).
declare -A image_bins=(
  [proxy-server]="proxy-server"
  [proxy-agent]="proxy-agent addon-agent"
  [cert-authority]="cert-authority"
  [addon-manager]="addon-manager"
  [health-prober]="health-prober"
  [user-server]="user-server"
)

die() { echo "images/build.sh: $*" >&2; exit 1; }

command -v podman >/dev/null || die "podman is not installed (apt-get install podman buildah runc)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$root/images/containers.conf}"

if [ ! -d "$(rustc --print sysroot)/lib/rustlib/$triple" ]; then
  echo "== rustup target add $triple"
  rustup target add "$triple" || die "the Rust target $triple is not installed and rustup could not add it"
fi
# ring compiles C; for musl it needs musl-gcc (Debian package musl-tools).
command -v musl-gcc >/dev/null || die "musl-gcc is missing (apt-get install musl-tools)"
export CC_x86_64_unknown_linux_musl="${CC_x86_64_unknown_linux_musl:-musl-gcc}"

version=$(cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"]=="proxy-server"))')
source_url="https://github.com/open-cluster-management-io/cluster-proxy-rs"
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && ! git diff --quiet HEAD 2>/dev/null; then
  revision="$revision-dirty"
fi
image_repo="${IMAGE_REPO:-localhost/cluster-proxy}"
image_tag="${IMAGE_TAG:-$version}"

# The workstation CLI (a plain static binary, not an image) comes with a build of everything.
if [ $# -gt 0 ]; then wanted=("$@"); cli_bins=(); else wanted=("${all_images[@]}"); cli_bins=(cluster-proxy); fi
for name in "${wanted[@]}"; do
  [ -n "${image_bins[$name]+x}" ] || die "unknown image '$name' (known: ${all_images[*]})"
done

# Every image's binaries must exist: a renamed or removed binary fails the
# build here instead of silently shipping one image fewer.
existing_bins=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "bin" in t["kind"]:
            print(p["name"], t["name"])')
package_of() { awk -v bin="$1" '$2 == bin { print $1; exit }' <<<"$existing_bins"; }

images=()
for name in "${wanted[@]}"; do
  for bin in ${image_bins[$name]}; do
    [ -n "$(package_of "$bin")" ] || die "image $name needs the binary $bin, which no workspace package builds"
  done
  images+=("$name")
done
[ ${#images[@]} -gt 0 ] || die "nothing to build"

# The data plane builds apart from the control plane: one cargo invocation
# unifies features, and the Kubernetes client would otherwise be compiled into
# the shared protocol crate that proxy-server and proxy-agent link.
data_plane=()
control_plane=()
for name in "${images[@]}"; do
  for bin in ${image_bins[$name]}; do
    case "$name" in
      proxy-server | proxy-agent) [ "$bin" = addon-agent ] && control_plane+=("$bin") || data_plane+=("$bin") ;;
      *) control_plane+=("$bin") ;;
    esac
  done
done
# The control plane is size-optimised (profile image-control): it is
# mostly the Kubernetes client and on no data path.
build_bins() {
  local profile=$1
  shift
  [ $# -gt 0 ] || return 0
  local args=() bin
  for bin in "$@"; do args+=(-p "$(package_of "$bin")" --bin "$bin"); done
  echo "== cargo build --profile $profile --target $triple ${args[*]}"
  cargo build --locked --profile "$profile" --target "$triple" "${args[@]}"
}
build_bins "$profile" "${data_plane[@]}"
# The workstation CLI ships as a plain static binary, not an image; it is built
# with the control plane (the same Kubernetes client, the same profile).
build_bins "$control_profile" "${control_plane[@]}" "${cli_bins[@]}"

target_dir="${CARGO_TARGET_DIR:-$root/target}"
context="$target_dir/images/context"
# Whether binary $1 asks for a program interpreter (a scratch image has none). readelf's
# whole output is read first: `readelf | grep -q` under pipefail can fail with SIGPIPE.
dynamically_linked() {
  local headers
  headers=$(readelf -l "$1") || die "readelf cannot read $1"
  grep -q 'Requesting program interpreter' <<<"$headers"
}

rm -rf "$context"
mkdir -p "$context"
for name in "${images[@]}"; do
  for bin in ${image_bins[$name]}; do
    out="$target_dir/$triple/$profile"
    for control_bin in "${control_plane[@]}"; do
      [ "$control_bin" = "$bin" ] && out="$target_dir/$triple/$control_profile"
    done
    # A dynamic binary would not start in a scratch image: refuse it here.
    ! dynamically_linked "$out/$bin" || die "$out/$bin is dynamically linked"
    # musl's own malloc doubled proxy-server's CPU per byte; the runtime crate
    # makes mimalloc the allocator of every binary that links it (README, Images).
    grep -q 'mimalloc' "$out/$bin" || die "$out/$bin does not use mimalloc (does it link cluster-proxy-runtime?)"
    cp "$out/$bin" "$context/$bin"
  done
done

for name in "${images[@]}"; do
  ref="$image_repo/$name:$image_tag"
  echo "== podman build $ref"
  # --no-cache: buildah reuses a cached stage even when only the build args of its labels
  # changed, which stamped old revisions on new images.
  podman build --quiet --no-cache --file "$root/images/Containerfile" --target "$name" \
    --build-arg SOURCE="$source_url" --build-arg VERSION="$version" --build-arg REVISION="$revision" \
    --tag "$ref" "$context" >/dev/null
done

if [ ${#cli_bins[@]} -gt 0 ]; then
  cli="$target_dir/$triple/$control_profile/cluster-proxy"
  ! dynamically_linked "$cli" || die "$cli is dynamically linked"
  mkdir -p "$target_dir/images/bin"
  cp "$cli" "$target_dir/images/bin/cluster-proxy"
  "$target_dir/images/bin/cluster-proxy" --version >/dev/null || die "the static cluster-proxy CLI does not run"
fi

echo "== images"
for name in "${images[@]}"; do
  ref="$image_repo/$name:$image_tag"
  size=$(podman image inspect --format '{{.Size}}' "$ref")
  python3 -c 'import sys; print(f"{sys.argv[1]:<50} {int(sys.argv[2]) / 1e6:5.1f} MB")' "$ref" "$size"
done
if [ ${#cli_bins[@]} -gt 0 ]; then
  python3 -c 'import os, sys; print(f"{sys.argv[1]:<50} {os.path.getsize(sys.argv[1]) / 1e6:5.1f} MB (static binary)")' \
    "$target_dir/images/bin/cluster-proxy"
fi
