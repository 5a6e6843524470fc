#!/usr/bin/env bash
# Idempotent set-up of one install profile: check Java 17, pick Python 3.11/3.12, create the venv, install the
# pinned stack (reusing a CUDA torch already there), build/install Horovod.
#   PROFILE=classic (default; venv .venv)   petastorm 0.12.1, pyarrow 14, numpy 1
#   PROFILE=modern  (venv .venv-modern)     no petastorm (data.reader=arrow), pyarrow 25, numpy 2
#   PROFILE=dbr-15.4 (venv .venv-dbr154)    Databricks Runtime 15.4 LTS ML's Python 3.11, Spark 3.5, pyarrow 14.0.1,
#                                           numpy 1.23, pandas 1.5, petastorm; torch and Horovod as classic
#   PYTHON=/path/to/python   the interpreter to build the venv from (default: python3.11, else python3.12)
#   VENV=DIR                 another venv folder
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-classic}
EXTRA=$PROFILE  # setup.py's extra for the profile
PYTHONS="3.11 3.12"  # the interpreters the profile runs on
case "$PROFILE" in
  classic) VENV=${VENV:-.venv} ;;
  modern) VENV=${VENV:-.venv-modern} ;;
  dbr-15.4) VENV=${VENV:-.venv-dbr154}; EXTRA=dbr154; PYTHONS="3.11" ;;
  *) echo "PROFILE=$PROFILE: the install profiles are classic, modern and dbr-15.4" >&2; exit 1 ;;
esac
quiet() { grep -v "^WARNING: Location" || true; }
. scripts/need_disk.sh

if ! command -v java >/dev/null 2>&1; then
  echo "Java 17 is required by Spark 4.0 and was not found on PATH (Debian: apt-get install openjdk-17-jre-headless)" >&2
  exit 1
fi
JAVA_MAJOR=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
if [ "${JAVA_MAJOR:-0}" -lt 17 ]; then
  echo "Java ${JAVA_MAJOR} found; Spark 4.0 needs Java 17 or newer" >&2
  exit 1
fi

# $PYTHON, else the first of python3.11, python3.12, python3 that runs and is one of $PYTHONS (scripts/need_disk.sh)
pick_python "$PYTHONS" "profile $PROFILE" || exit 1

# A CUDA torch in the chosen interpreter (GPU images, Databricks ML) is reused: the venv sees the interpreter's
# packages and the CPU wheel is not installed over it. Otherwise torch 2.13.0 (the CPU wheel here) as pinned.
BASE_TORCH=$(timeout 300 "$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda or "")' 2>/dev/null || true)
BASE_TORCH_CUDA=$(echo "$BASE_TORCH" | awk '{print $2}')
VENV_ARGS=()
if [ -n "$BASE_TORCH_CUDA" ]; then
  VENV_ARGS=(--system-site-packages)
  export LAKEHOUSE_TORCH_REQUIREMENT=torch  # setup.py: accept the torch that is there
  echo "setup ($PROFILE): reusing $PYTHON's CUDA torch $(echo "$BASE_TORCH" | awk '{print $1}') (CUDA $BASE_TORCH_CUDA) through --system-site-packages"
fi
# What the venv and the Horovod build need from the system, checked now rather than minutes into the install: the
# venv module (Debian: python3.X-venv) for a new venv; g++, make and Python.h (python3.X-dev) unless the venv has
# Horovod or the wheel cache has one for this Python and torch (build_horovod.sh checks again before it builds).
TOOLS=()
[ -x "$VENV/bin/python" ] || TOOLS+=(venv)
VENV_TORCH=2.13.0  # the pinned CPU wheel (below), or the CUDA torch reused
[ -z "$BASE_TORCH_CUDA" ] || VENV_TORCH=$(echo "$BASE_TORCH" | awk '{print $1}')
if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import horovod" >/dev/null 2>&1; } &&
  ! horovod_wheel_cached "$PYTHON" "$VENV_TORCH"; then
  TOOLS+=(build)
fi
[ ${#TOOLS[@]} -eq 0 ] || need_tools "$PYTHON" "the $PROFILE profile's set-up ($VENV)" "${TOOLS[@]}" || exit 1
if [ -x "$VENV/bin/python" ] && [ -n "$BASE_TORCH_CUDA" ] && ! grep -q "include-system-site-packages = true" "$VENV/pyvenv.cfg"; then
  echo "$VENV exists without the system site packages, so it cannot see the CUDA torch; remove it and re-run" >&2
  exit 1
fi
# the pinned stack (~2.7 GiB in the venv) and the Horovod build
[ -f "$VENV/.installed" ] || need_disk "$NEED_GIB_PROFILE" . "the $PROFILE profile's venv ($VENV)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "${VENV_ARGS[@]}" "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24" 2>&1 | quiet
if [ -z "$BASE_TORCH_CUDA" ]; then
  # torch first, alone, so pip takes the CPU wheel (a CUDA build is several GB); then the rest, pinned.
  "$VENV/bin/python" -m pip install -q "torch==$VENV_TORCH" 2>&1 | quiet
fi
# One editable install of the project at a time in this checkout (`make test` sets the venvs up at once): each writes
# lakehouse_pipeline.egg-info/ in the source tree.
mkdir -p work
flock work/.editable-install.lock "$VENV/bin/python" -m pip install -q -e ".[dev,$EXTRA]" 2>&1 | quiet
IMPORTS="import torch, pyarrow, numpy, pandas, deltalake, pyspark, mlflow, pytorch_lightning"
[ "$PROFILE" = modern ] || IMPORTS="$IMPORTS, petastorm"
"$VENV/bin/python" -c "$IMPORTS"
PY="$VENV/bin/python" bash scripts/build_horovod.sh
echo "$PROFILE" > "$VENV/lakehouse-profile"  # what was asked for; `lakehouse doctor` also reads what is installed
echo "set-up complete ($PROFILE profile in $VENV): $("$VENV/bin/python" -c 'import horovod, torch, pyarrow, numpy; print("python", __import__("platform").python_version(), "pyspark", __import__("pyspark").__version__, "torch", torch.__version__, "cuda", torch.version.cuda, "pyarrow", pyarrow.__version__, "numpy", numpy.__version__, "horovod", horovod.__version__)')"
