#!/usr/bin/env bash
# promtool and amtool, the versions of the Prometheus and Alertmanager images of the
# compose `monitoring` profile, built once from the Go module proxy and cached outside
# the repo (no release download needed). tests/test_dashboard.py runs them on
# deploy/prometheus and deploy/alertmanager; scripts/test.sh calls this first.
#
#   scripts/prom-tools.sh          # build what is missing; print the two paths
#
# Needs Go (`go` on PATH, or /usr/local/go/bin/go). The first build takes minutes
# (docs/operations.md, "Dashboard and alerts"); later runs return at once. The Go
# module and build caches of a build are its own, removed after it (about 3 GB).
set -euo pipefail
case "${1:-}" in  # no arguments; --help must not start the work
  "") ;;
  -h|--help) echo "usage: $0"; sed -n '2,/^set -/s/^# \{0,1\}//p' "$0"; exit 0 ;;
  *) echo "usage: $0 (no arguments)" >&2; exit 2 ;;
esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${PIPELINE_PROM_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/embedding-pipeline/prom-tools}"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

# The image tags in docker-compose.yml are the one place the versions are written.
image_tag() { sed -n "s|^ *image: $1:\(v[0-9.]*\) *$|\1|p" "$REPO/docker-compose.yml" | head -1; }
PROMETHEUS_VERSION="$(image_tag prom/prometheus)"
ALERTMANAGER_VERSION="$(image_tag prom/alertmanager)"
[[ -n "$PROMETHEUS_VERSION" && -n "$ALERTMANAGER_VERSION" ]] \
  || { echo "prom-tools: no prom/prometheus or prom/alertmanager image in docker-compose.yml" >&2; exit 1; }

# Prometheus 3.x is published to Go as v0.3MM.P (3.5.0 -> v0.305.0).
go_version_of_prometheus() {
  local major minor patch
  IFS=. read -r major minor patch <<<"${1#v}"
  printf 'v0.%d%02d.%d' "$major" "$minor" "$patch"
}

# build NAME IMAGE_VERSION MODULE@VERSION PACKAGE [REPLACE...]: go build in a throwaway
# module, since `go install pkg@version` refuses a module whose go.mod holds replace
# directives (Prometheus's does); its replaces are repeated here so the build is the same.
build() {
  local name=$1 tag=$2 module=$3 package=$4 out work
  shift 4
  out="$CACHE/$name-$tag"
  if [[ -x "$out" ]]; then echo "$out"; return; fi
  [[ -x "$GO" ]] || { echo "prom-tools: Go is needed to build $name (set GO=/path/to/go)" >&2; return 1; }
  echo "prom-tools: building $name $tag from the Go module proxy (once; minutes)" >&2
  work="$(mktemp -d)"
  (
    cd "$work"
    export GOMODCACHE="$work/mod" GOCACHE="$work/cache" GOFLAGS=-modcacherw
    "$GO" mod init prom-tools-build
    for replace in "$@"; do "$GO" mod edit -replace="$replace"; done
    "$GO" get "$package@${module#*@}"
    mkdir -p "$CACHE"
    nice "$GO" build -mod=mod -trimpath -o "$out.tmp" \
      -ldflags "-s -w -X github.com/prometheus/common/version.Version=${tag#v}" "$package"
    mv "$out.tmp" "$out"
  ) >"$work/build.log" 2>&1 || {
    tail -20 "$work/build.log" >&2
    rm -rf "$work"
    echo "prom-tools: building $name failed" >&2
    return 1
  }
  rm -rf "$work"
  echo "$out"
}

build promtool "$PROMETHEUS_VERSION" \
  "github.com/prometheus/prometheus@$(go_version_of_prometheus "$PROMETHEUS_VERSION")" \
  github.com/prometheus/prometheus/cmd/promtool \
  github.com/fsnotify/fsnotify@v1.8.0=github.com/fsnotify/fsnotify@v1.7.0
build amtool "$ALERTMANAGER_VERSION" "github.com/prometheus/alertmanager@$ALERTMANAGER_VERSION" \
  github.com/prometheus/alertmanager/cmd/amtool
