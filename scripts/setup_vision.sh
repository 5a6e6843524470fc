#!/usr/bin/env bash
# Idempotent set-up of the vision test venv (.venv-vision): torch + a torchvision built for it + timm + Lightning and
# the project's model-side dependencies (no Spark, no Horovod), for the tests marked `vision` (timm backbones).
# Why a venv of its own: timm imports torchvision, and no torchvision wheel imports beside the classic profile's
# torch 2.13.0+cpu (the torchvision 0.28.0 wheel is a CUDA build: "operator torchvision::nms does not exist").
# A CUDA torch runs on a machine without a GPU, so the CUDA build of torch 2.14.1 with torchvision 0.29.1 does.
#   VENV=DIR          another venv folder (default .venv-vision)
#   PYTHON=python3.X  the interpreter (default python3.11)
#   TORCH=2.14.1 TORCHVISION=0.29.1   a matching pair (pip here is capped at those by /etc/xdg/pip)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vision}
PYTHON=${PYTHON:-python3.11}
TORCH=${TORCH:-2.14.1}
TORCHVISION=${TORCHVISION:-0.29.1}
LIGHTNING=$(.venv/bin/python -c "import pytorch_lightning as p; print(p.__version__)" 2>/dev/null || echo 2.6.6)
quiet() { grep -v "^WARNING: Location" || true; }
. scripts/need_disk.sh
# the wheels lying on this machine's disk (torch's CUDA build and its nvidia-* libraries) are used when present
EXTRA_INDEX=()
[ -d /opt/pypi-more/simple ] && EXTRA_INDEX=(--extra-index-url file:///opt/pypi-more/simple)

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, torchvision, timm, pytorch_lightning" \
    >/dev/null 2>&1; then
  echo "$VENV: $("$VENV/bin/python" -c "import torch, torchvision, timm; print('torch', torch.__version__, \
'torchvision', torchvision.__version__, 'timm', timm.__version__)") (already set up)"
  exit 0
fi
# torch's CUDA build and its libraries take ~5.6 GiB in the venv, and pip unpacks each wheel beside it
need_disk 9 . "the vision venv ($VENV)"
# A failed install (a full disk, a lost download) leaves no half-built venv for a later run to trust.
drop_venv() { [ ! -f "$VENV/pyvenv.cfg" ] || rm -rf "$VENV"; }
trap 'rc=$?; [ $rc -eq 0 ] || { echo "$VENV: set-up failed (exit $rc); the partial venv is removed" >&2; drop_venv; }' EXIT
drop_venv
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip 2>&1 | quiet
"$VENV/bin/pip" install -q --no-cache-dir "${EXTRA_INDEX[@]}" "torch==$TORCH" "torchvision==$TORCHVISION" "timm==1.0.31" "safetensors==0.8.0" \
  "pytorch-lightning==$LIGHTNING" pyyaml pillow "numpy==1.26.4" psutil pytest pytest-timeout 2>&1 | quiet
# the project itself from this checkout, by path (no egg-info written into the shared tree)
"$VENV/bin/python" -c "import site, sys; open(site.getsitepackages()[0] + '/lakehouse-checkout.pth', 'w').write(sys.argv[1])" "$PWD"
"$VENV/bin/python" -c "import torch, torchvision, timm, pytorch_lightning; print('$VENV: torch', torch.__version__, 'torchvision', \
torchvision.__version__, 'timm', timm.__version__, 'cuda', torch.cuda.is_available())"
