#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 against the installed torch: NCCL when torch has CUDA, gloo for CPU.
# The decisions (C++ standard, GCC/CMake workarounds, NCCL, cache key) come from `python -m pipeline.buildinfo`.
#   PY=.venv/bin/python                 the interpreter to build for (default .venv/bin/python)
#   LAKEHOUSE_BUNDLE=DIR                offline: horovod-0.28.1.tar.gz and wheels (cffi, pycparser, ...) from DIR
#   LAKEHOUSE_WHEEL_CACHE=DIR           where built wheels are kept (default ~/.cache/lakehouse-wheels)
#   LAKEHOUSE_HOROVOD_GLOO_ONLY=1       a CUDA torch, built without NCCL anyway (GPU tensors go through host memory)
#   NCCL_HOME=DIR                       NCCL (include/nccl.h, lib/libnccl.so*) if not the torch wheel's nvidia-nccl-*
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HVD_VERSION=0.28.1
PY=${PY:-.venv/bin/python}
case "$PY" in
  /*) ;;
  */*) PY="$PWD/$PY" ;;
  *) PY=$(command -v "$PY") ;;
esac
# the venv's own tools (cmake from the dev extra) before the system's; never resolve the venv's python link
export PATH="$(dirname "$PY"):$PATH"
BUNDLE=${LAKEHOUSE_BUNDLE:-}
[ -z "$BUNDLE" ] || BUNDLE=$(cd "$BUNDLE" && pwd)
pip_get() {
  if [ -n "$BUNDLE" ]; then
    "$PY" -m pip install -q --no-index --find-links "$BUNDLE" "$@"
  else
    "$PY" -m pip install -q "$@"
  fi 2>&1 | { grep -v "^WARNING: Location" || true; }
  return "${PIPESTATUS[0]}"
}

BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
# The plan for this machine, as LAKEHOUSE_HVD_* and HOROVOD_* exports; it stops here with the reason when a CUDA
# torch has no NCCL to build against (unless LAKEHOUSE_HOROVOD_GLOO_ONLY=1) or cmake is missing.
EXPORTS=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pipeline.buildinfo plan --shell "$BUILD/nccl-home")
eval "$EXPORTS"
WANT_NCCL=0
[ "$LAKEHOUSE_HVD_GPU_OPERATIONS" = NCCL ] && WANT_NCCL=1

if "$PY" -c "
import sys, horovod.torch as hvd
sys.exit(0 if hvd.gloo_built() and bool(hvd.nccl_built()) == bool($WANT_NCCL) else 1)" 2>/dev/null; then
  echo "horovod $("$PY" -c 'import horovod; print(horovod.__version__)') already installed as wanted ($LAKEHOUSE_HVD_CACHE_KEY)"
  exit 0
fi

CACHE_ROOT=${LAKEHOUSE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lakehouse-wheels}
CACHE="$CACHE_ROOT/$LAKEHOUSE_HVD_CACHE_KEY"
mkdir -p "$CACHE_ROOT"
# One build per key at a time: `make test` sets up the classic and modern venvs side by side, and both want the same
# wheel (the fresh clone of 2026-11-28 built it twice at once: ~4 minutes of both cores spent twice). The second
# waits on a lock on the key (the kernel's: it goes with a build that dies) and then installs the first's wheel.
LOCK="$CACHE_ROOT/$LAKEHOUSE_HVD_CACHE_KEY.lock"
HELD=75  # flock's exit status when the lock is held (-E); any other failure is the lock's own (a file system
#          without locks): the build then goes on unlocked, as before the lock
if command -v flock >/dev/null 2>&1 && exec 9> "$LOCK"; then
  rc=0
  flock -n -E $HELD 9 || rc=$?
  if [ $rc = $HELD ]; then
    echo "another set-up is building $LAKEHOUSE_HVD_CACHE_KEY: waiting for its wheel (lock $LOCK, at most 30 minutes)"
    rc=0
    flock -w 1800 -E $HELD 9 || rc=$?
    [ $rc != $HELD ] || { echo "horovod: the build holding $LOCK did not end within 30 minutes" >&2; exit 1; }
  fi
  [ $rc = 0 ] || echo "build_horovod: cannot lock $LOCK (flock exit $rc): building without the lock" >&2
fi
if ! ls "$CACHE"/horovod-*.whl >/dev/null 2>&1; then
  # the compiler, make and the interpreter's Python.h, before the download and minutes of compiling (Debian: g++ and
  # python3.X-dev)
  . "$ROOT/scripts/need_disk.sh"
  need_tools "$PY" "building Horovod ${HVD_VERSION} for $PY" build || exit 1
  echo "building horovod ${HVD_VERSION} ($LAKEHOUSE_HVD_CACHE_KEY) with ${MAKEFLAGS}; about 4 minutes on 2 cores, 2 on 16"
  # Horovod's setup imports cffi before anything else.
  "$PY" -c "import cffi, pycparser" 2>/dev/null || pip_get "cffi" "pycparser"
  if [ -n "$BUNDLE" ]; then
    [ -f "$BUNDLE/horovod-${HVD_VERSION}.tar.gz" ] || {
      echo "LAKEHOUSE_BUNDLE=$BUNDLE has no horovod-${HVD_VERSION}.tar.gz (scripts/fetch_gpu_bundle.sh makes one)" >&2; exit 1; }
    cp "$BUNDLE/horovod-${HVD_VERSION}.tar.gz" "$BUILD/"
  else
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==${HVD_VERSION}" -d "$BUILD" 2>&1 \
      | { grep -v "^WARNING: Location" || true; }
  fi
  tar -xzf "$BUILD/horovod-${HVD_VERSION}.tar.gz" -C "$BUILD"
  SRC="$BUILD/horovod-${HVD_VERSION}"
  # Horovod 0.28.1 asks for C++14; torch >= 2.1 needs C++17 (upstream PR #3998, never released) and torch >= 2.14's
  # headers C++20, for the torch extension only (Horovod's core and gloo stay at 17).
  sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD ${LAKEHOUSE_HVD_CXX_STANDARD_ROOT})/" "$SRC/CMakeLists.txt"
  sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD ${LAKEHOUSE_HVD_CXX_STANDARD})/" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q "CMAKE_CXX_STANDARD ${LAKEHOUSE_HVD_CXX_STANDARD}" "$SRC/horovod/torch/CMakeLists.txt" || {
    echo "the C++${LAKEHOUSE_HVD_CXX_STANDARD} patch did not apply to horovod/torch/CMakeLists.txt" >&2; exit 1; }
  # A CUDA torch makes Horovod's torch extension ask for the CUDA toolkit (add_cuda); a gloo-only build on a machine
  # without the toolkit's headers (the vision venv: torch's CUDA wheel on a CPU machine, where an nvcc alone may lie
  # on PATH) builds the extension without CUDA instead: CPU tensors only, which is all such a machine has.
  CUDA_HOME_SEEN=$("$PY" -c "import torch.utils.cpp_extension as c; print(c.CUDA_HOME or '')" 2>/dev/null || true)
  if [ "${LAKEHOUSE_HOROVOD_GLOO_ONLY:-0}" = 1 ] && [ ! -f "${CUDA_HOME_SEEN:-/nonexistent}/include/cuda_runtime.h" ]; then
    # FindPytorch then takes torch for a CPU build (a CppExtension: no cudart to link, no add_cuda)
    sed -i 's/print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)/print(False)/' \
      "$SRC/cmake/Modules/FindPytorch.cmake"
    grep -q 'import CUDA_HOME; print(False)' "$SRC/cmake/Modules/FindPytorch.cmake" || {
      echo "the gloo-only patch did not apply to cmake/Modules/FindPytorch.cmake" >&2; exit 1; }
  fi
  # NCCL from the nvidia-nccl-* package: a folder with include/ and lib/libnccl.so -> libnccl.so.2
  for pair in $LAKEHOUSE_HVD_NCCL_LINKS; do
    mkdir -p "$(dirname "${pair%%=*}")"
    ln -sfn "${pair#*=}" "${pair%%=*}"
  done
  OUTDIR=$(mktemp -d "$CACHE_ROOT/.building-XXXXXX")
  LOG="$CACHE_ROOT/$LAKEHOUSE_HVD_CACHE_KEY.build.log"
  # 9>&-: the compilers never hold the lock (one outliving an interrupted build would keep the next one waiting)
  if ! (cd "$SRC" && "$PY" -m pip wheel -v --no-deps --no-build-isolation . -w "$OUTDIR" 9>&-) > "$LOG" 2>&1; then
    tail -40 "$LOG" >&2
    echo "horovod build failed; full log: $LOG" >&2
    rm -rf "$OUTDIR"
    exit 1
  fi
  mkdir -p "$CACHE"
  mv "$OUTDIR"/horovod-*.whl "$CACHE/"
  rm -rf "$OUTDIR"
fi
exec 9>&-  # the wheel is in the cache: a set-up waiting for it goes on
"$PY" -m pip install -q --no-deps --force-reinstall "$CACHE"/horovod-*.whl 2>&1 | { grep -v "^WARNING: Location" || true; }
# horovod's own runtime deps (not its [spark] extra, which pins pyarrow < 11)
"$PY" -c "import cloudpickle, psutil, yaml, packaging" 2>/dev/null || pip_get cloudpickle psutil pyyaml packaging
"$PY" -c "
import horovod, horovod.torch as hvd
assert hvd.gloo_built(), 'horovod built without gloo'
assert bool(hvd.nccl_built()) == bool($WANT_NCCL), 'horovod nccl_built() is %r, wanted NCCL=%d' % (hvd.nccl_built(), $WANT_NCCL)
print('horovod', horovod.__version__, 'gloo', hvd.gloo_built(), 'nccl', bool(hvd.nccl_built()))"
