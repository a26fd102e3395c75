#!/usr/bin/env bash
# The agent as a wheel plus a wheelhouse of its runtime dependencies: what `dpuctl provision`
# embeds in bf.cfg and the DPU installs offline.
#
#   scripts/build-wheelhouse.sh [OUT]                 # this machine's platform (tests, x86 hosts)
#   scripts/build-wheelhouse.sh --dpu [OUT]           # for the DPU: aarch64, CPython 3.12
#
# --dpu cross-downloads binary wheels for the BlueField's Arm cores and Ubuntu 24.04's Python
# (override with DPU_PLATFORM / DPU_PYTHON): `pip download --only-binary=:all: --platform
# manylinux_2_28_aarch64 --python-version 3.12`. Every runtime dependency publishes such wheels;
# dpu-kvtier itself is pure Python (py3-none-any) and builds its AES-XTS loop on the DPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
dpu=0
if [ "${1:-}" = "--dpu" ]; then dpu=1; shift; fi
OUT=${1:-dist/wheelhouse}
mkdir -p "$OUT"
rm -f "$OUT"/dpu_kvtier-*.whl
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$OUT" .
if [ "$dpu" = 0 ]; then
  "$PY" -m pip wheel --quiet --wheel-dir "$OUT" --find-links "$OUT" '.[agent]'
else
  reqs=$("$PY" - <<'PY'
import tomllib
doc = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(doc["dependencies"] + doc["optional-dependencies"]["agent"]))
PY
)
  # shellcheck disable=SC2086
  "$PY" -m pip download --quiet --dest "$OUT" --only-binary=:all: \
    --platform "${DPU_PLATFORM:-manylinux_2_28_aarch64}" --python-version "${DPU_PYTHON:-3.12}" \
    --implementation cp $(echo "$reqs" | tr '\n' ' ')
fi
echo "$OUT: $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1)"
