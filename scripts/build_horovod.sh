#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 against the installed torch, with the C++17 fix.
# The wheel is cached outside the repo, keyed by horovod, torch and Python versions.
set -euo pipefail
PY=${PY:-.venv/bin/python}
HVD_VERSION=0.28.1
if $PY -c "import horovod.torch" 2>/dev/null; then
  echo "horovod $($PY -c 'import horovod; print(horovod.__version__)') already installed"; exit 0
fi
TORCH=$($PY -c 'import torch; print(torch.__version__.replace("+", "_"))')
PYV=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
CACHE=${LAKEHOUSE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lakehouse-wheels}/horovod-${HVD_VERSION}-torch${TORCH}-${PYV}
mkdir -p "$CACHE"
if ! ls "$CACHE"/horovod-*.whl >/dev/null 2>&1; then
  echo "building horovod ${HVD_VERSION} for torch ${TORCH} (${PYV}); takes about 4 minutes on 2 cores"
  BUILD=$(mktemp -d)
  trap 'rm -rf "$BUILD"' EXIT
  $PY -m pip download -q --no-deps --no-binary :all: "horovod==${HVD_VERSION}" -d "$BUILD"
  tar -xzf "$BUILD"/horovod-${HVD_VERSION}.tar.gz -C "$BUILD"
  SRC="$BUILD/horovod-${HVD_VERSION}"
  # torch >= 2.1 needs C++17; horovod 0.28.1 asks for C++14 (fixed upstream in PR #3998, never released).
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || { echo "C++17 patch did not apply" >&2; exit 1; }
  (cd "$SRC" && PATH="$(dirname "$(readlink -f "$PY")"):$(dirname "$PY"):$PATH" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=-j2 \
    "$OLDPWD/$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$CACHE")
fi
$PY -m pip install -q --no-deps "$CACHE"/horovod-*.whl
# horovod's own runtime deps (not its [spark] extra, which pins pyarrow < 11)
$PY -m pip install -q cloudpickle psutil pyyaml packaging
$PY -c "import horovod.torch as hvd; assert hvd.gloo_built(), 'horovod built without gloo'; print('horovod', __import__('horovod').__version__, 'gloo', hvd.gloo_built())"
