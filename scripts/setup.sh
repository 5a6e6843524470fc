#!/usr/bin/env bash
# Idempotent set-up: check Java 17, create .venv, install the pinned stack, build/install Horovod.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v java >/dev/null 2>&1; then
  echo "Java 17 is required by Spark 4.0 and was not found on PATH (Debian: apt-get install openjdk-17-jre-headless)" >&2
  exit 1
fi
JAVA_MAJOR=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
if [ "${JAVA_MAJOR:-0}" -lt 17 ]; then
  echo "Java ${JAVA_MAJOR} found; Spark 4.0 needs Java 17 or newer" >&2
  exit 1
fi
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 is required, found {sys.version}"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip>=24" 2>&1 | grep -v "^WARNING: Location" || true
# torch first, alone, so pip takes the CPU wheel (a CUDA build is several GB); then the rest, pinned.
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, pyarrow, petastorm, deltalake, pyspark, mlflow, pytorch_lightning" 
PY=.venv/bin/python bash scripts/build_horovod.sh
echo "set-up complete: $(.venv/bin/python -c 'import horovod, torch; print("torch", torch.__version__, "horovod", horovod.__version__)')"
