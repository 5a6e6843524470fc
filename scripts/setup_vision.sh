#!/usr/bin/env bash
# Idempotent set-up of the vision venv (.venv-vision): the whole pipeline (the classic profile's Spark, Delta,
# Petastorm, MLflow and Horovod) on torch + a torchvision built for it + timm, so `lakehouse train model.arch=timm/...`
# runs end to end on a CPU machine; the tests marked `vision` run here.
# Why a venv of its own: timm imports torchvision, and no torchvision wheel imports beside the classic profile's
# torch 2.13.0+cpu (the torchvision 0.28.0 wheel is a CUDA build: "operator torchvision::nms does not exist").
# A CUDA torch runs on a machine without a GPU, so the CUDA build of torch 2.14.1 with torchvision 0.29.1 does.
# Horovod is built for that torch (C++20 torch extension), gloo only: there is no nvcc here and the tier runs on CPU.
#   VENV=DIR          another venv folder (default .venv-vision)
#   PYTHON=python3.X  the interpreter (default: as scripts/setup.sh picks it, python3.11, else python3.12, else a
#                     python3 that is one of them; torch 2.14.1, torchvision 0.29.1 and the classic pins have wheels
#                     for both, though this machine's own copies of torch and torchvision are for 3.11 alone)
#   TORCH=2.14.1 TORCHVISION=0.29.1   a matching pair (pip here is capped at those by /etc/xdg/pip)
#   LAKEHOUSE_HOROVOD_GLOO_ONLY=0     build Horovod with NCCL instead (a GPU machine with nvcc)
#   LAKEHOUSE_VISION_HOROVOD=0        no Horovod build (~4 minutes on 2 cores): the venv trains with train.backend=ddp,
#                                     fsdp or single. `make test` sets it: the vision tier trains timm on DDP ranks, and
#                                     Horovod is tested with every other network in the classic venv. Running this script
#                                     again without it adds Horovod to the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vision}
TORCH=${TORCH:-2.14.1}
TORCHVISION=${TORCHVISION:-0.29.1}
quiet() { grep -v "^WARNING: Location" || true; }
. scripts/need_disk.sh
# the wheels lying on this machine's disk (torch's CUDA build and its nvidia-* libraries) are used when present
EXTRA_INDEX=()
[ -d /opt/pypi-more/simple ] && EXTRA_INDEX=(--extra-index-url file:///opt/pypi-more/simple)
JAVA_MAJOR=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1 || true)
if [ "${JAVA_MAJOR:-0}" -lt 17 ]; then
  echo "$VENV: Spark 4.0 needs Java 17 or newer on PATH (found: ${JAVA_MAJOR:-none}; Debian: apt-get install" \
    "openjdk-17-jre-headless)" >&2
  exit 1
fi
# torch, torchvision and timm already there: the venv is kept (below), and its interpreter is the one built for
HAVE_STACK=0
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, torchvision, timm" >/dev/null 2>&1; then
  HAVE_STACK=1
  BASE_PY=$VENV/bin/python
else  # a new venv: the interpreter picked as scripts/setup.sh picks it (scripts/need_disk.sh)
  pick_python "3.11 3.12" "the vision venv ($VENV)" || exit 1
  BASE_PY=$PYTHON
fi
# What the venv and the Horovod build need from the system, checked now rather than minutes into the install: the venv
# module (Debian: python3.X-venv) for a new venv; g++, make and Python.h (python3.X-dev) for a Horovod build, unless
# the venv has Horovod or the wheel cache has one for this Python and torch (build_horovod.sh checks again)
TOOLS=()
[ $HAVE_STACK = 1 ] || TOOLS+=(venv)
if [ "${LAKEHOUSE_VISION_HOROVOD:-1}" != 0 ] &&
  ! { [ $HAVE_STACK = 1 ] && "$VENV/bin/python" -c "import horovod" >/dev/null 2>&1; } &&
  ! horovod_wheel_cached "$BASE_PY" "$TORCH"; then
  TOOLS+=(build)
fi
[ ${#TOOLS[@]} -eq 0 ] || need_tools "$BASE_PY" "the vision venv's set-up ($VENV)" "${TOOLS[@]}" || exit 1
# torch, torchvision and timm already there: only the project (its pins may have changed) and Horovod are checked
if [ $HAVE_STACK = 1 ]; then
  echo "$VENV: torch, torchvision and timm already installed; checking the project and Horovod"
else
  # torch's CUDA build and its libraries take ~5.6 GiB in the venv, the pipeline's stack ~2.5, and pip unpacks each
  # wheel beside it
  need_disk "$NEED_GIB_VISION" . "the vision venv ($VENV)"
  # A failed install (a full disk, a lost download, a failed Horovod build) leaves no half-built venv for a later run
  # to trust.
  drop_venv() { [ ! -f "$VENV/pyvenv.cfg" ] || rm -rf "$VENV"; }
  trap 'rc=$?; [ $rc -eq 0 ] || { echo "$VENV: set-up failed (exit $rc); the partial venv is removed" >&2; drop_venv; }' EXIT
  drop_venv
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip 2>&1 | quiet
  # torch and torchvision first, alone and uncached (several GB)
  "$VENV/bin/pip" install -q --no-cache-dir "${EXTRA_INDEX[@]}" "torch==$TORCH" "torchvision==$TORCHVISION" \
    "timm==1.0.31" "safetensors==0.8.0" 2>&1 | quiet
fi
# the project with the classic profile's pins (pyarrow 14, Petastorm 0.12.1, numpy 1) over that torch; one editable
# install at a time in this checkout (scripts/setup.sh)
mkdir -p work
LAKEHOUSE_TORCH_REQUIREMENT="torch==$TORCH" flock work/.editable-install.lock "$VENV/bin/pip" install -q "${EXTRA_INDEX[@]}" -e ".[dev,classic]" 2>&1 \
  | quiet
"$VENV/bin/python" -c "import torch, torchvision, timm, pytorch_lightning, pyspark, deltalake, mlflow, petastorm"
if [ "${LAKEHOUSE_VISION_HOROVOD:-1}" = 0 ]; then
  echo "$VENV: LAKEHOUSE_VISION_HOROVOD=0: Horovod not built (train.backend=ddp, fsdp or single here)"
else
  LAKEHOUSE_HOROVOD_GLOO_ONLY=${LAKEHOUSE_HOROVOD_GLOO_ONLY:-1} PY="$VENV/bin/python" bash scripts/build_horovod.sh
fi
echo classic > "$VENV/lakehouse-profile"  # its data stack is the classic profile's (`lakehouse doctor` checks it)
"$VENV/bin/python" -c "
import importlib.util, torch, torchvision, timm, pyspark
hvd = importlib.import_module('horovod').__version__ if importlib.util.find_spec('horovod') else 'not built'
print('$VENV: torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__, 'pyspark',
      pyspark.__version__, 'horovod', hvd, 'cuda', torch.cuda.is_available())"
