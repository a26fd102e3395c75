#!/usr/bin/env bash
# Build the GPU server's wheel (dpu-kvtier-host: host_shim + kvproto) into $DIST_DIR.
# setuptools packages nothing outside the project directory, so the two packages and
# host/pyproject.toml are staged in a temporary directory and the wheel is built there.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-python3}"
DIST_DIR="${DIST_DIR:-dist}"
mkdir -p "$DIST_DIR"
DIST_DIR="$(cd "$DIST_DIR" && pwd)"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp "$ROOT/host/pyproject.toml" "$STAGE/"
for pkg in host_shim kvproto; do
    # sources only: no caches or build leftovers in the wheel
    (cd "$ROOT" && find "$pkg" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' \
        -exec install -D -m 0644 {} "$STAGE/{}" \;)
done
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIST_DIR" "$STAGE"
ls "$DIST_DIR"/dpu_kvtier_host-*.whl
