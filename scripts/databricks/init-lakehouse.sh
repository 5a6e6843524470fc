#!/usr/bin/env bash
# Databricks cluster init script: make the project importable on every node WITHOUT replacing anything the runtime
# provides, and (LAKEHOUSE_HOROVOD=1) install Horovod from the project's wheel, built once by scripts/build_horovod.sh
# (NCCL on GPU nodes, where the runtime's torch has CUDA) and cached on a Unity Catalog volume.
#   LAKEHOUSE_SRC=DIR          the project tree synced by the bundle (/Workspace/.../files); required
#   LAKEHOUSE_TARGET=NAME      dbr-15.4-ml | dbr-17.3-ml: which requirements-<target>.txt to add; required
#   LAKEHOUSE_HOROVOD=1        build/install Horovod if the runtime lacks it (dbr-17.3-ml with train.backend=horovod)
#   LAKEHOUSE_WHEEL_CACHE=DIR  where built Horovod wheels are kept, shared by nodes and clusters
#                              (default /Volumes/main/ml/wheels/lakehouse-wheels)
#   LAKEHOUSE_PY=PATH          the runtime's python (default /databricks/python/bin/python)
# Set them in the cluster's spark_env_vars (conf/databricks/resources/*.yml does). Order of work:
#   1. pin what the runtime has: `pip freeze` of pyspark/pyarrow/numpy/pandas/torch/mlflow -> a constraints file;
#   2. the project: a .pth file naming LAKEHOUSE_SRC (no pip, no dependencies: setup.py's pins never reach the node);
#   3. what the runtime lacks: pip install -c <pins> -r scripts/databricks/requirements-<target>.txt
#      (pip fails rather than replace a pinned package);
#   4. Horovod, when asked for and missing: scripts/build_horovod.sh with the runtime's python, the same pins
#      (PIP_CONSTRAINT) and the volume as wheel cache: the first node builds (minutes), the others reuse the wheel.
set -euo pipefail
SRC=${LAKEHOUSE_SRC:?set LAKEHOUSE_SRC to the synced project tree}
TARGET=${LAKEHOUSE_TARGET:?set LAKEHOUSE_TARGET to dbr-15.4-ml or dbr-17.3-ml}
PY=${LAKEHOUSE_PY:-/databricks/python/bin/python}
REQS="$SRC/scripts/databricks/requirements-$TARGET.txt"
[ -f "$REQS" ] || { echo "init-lakehouse: no $REQS (LAKEHOUSE_TARGET=$TARGET)" >&2; exit 1; }
PINS=/tmp/lakehouse-runtime-pins.txt
LOG=/tmp/lakehouse-init.log
exec > >(tee -a "$LOG") 2>&1
echo "init-lakehouse: target $TARGET, python $("$PY" -V 2>&1), DATABRICKS_RUNTIME_VERSION=${DATABRICKS_RUNTIME_VERSION:-?}"

# 1. The runtime's own versions, as constraints (mlflow too, except where the target must replace it).
"$PY" -m pip freeze 2>/dev/null | grep -iE '^(pyspark|pyarrow|numpy|pandas|torch|mlflow|mlflow-skinny)==' > "$PINS" || true
if grep -qi '^mlflow==' "$REQS"; then
  sed -i -E '/^mlflow(-skinny)?==/Id' "$PINS"
fi
echo "init-lakehouse: runtime pins: $(tr '\n' ' ' < "$PINS")"
RECORDED="$SRC/scripts/databricks/constraints-$TARGET.txt"
while IFS= read -r pin; do
  name=${pin%%==*}
  rec=$(grep -iE "^${name}==" "$RECORDED" || true)
  [ -z "$rec" ] || [ "${rec,,}" = "${pin,,}" ] || echo "init-lakehouse: note: runtime has $pin, $RECORDED records $rec"
done < "$PINS"

# 2. The project, from the synced tree.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$SRC" > "$SITE/lakehouse-pipeline.pth"

# 3. What the runtime lacks.
"$PY" -m pip install -q -c "$PINS" -r "$REQS"

# 4. Horovod.
if [ "${LAKEHOUSE_HOROVOD:-0}" = 1 ] && ! "$PY" -c "import horovod.torch" 2>/dev/null; then
  command -v cmake >/dev/null || "$PY" -m pip install -q -c "$PINS" "cmake==4.4.4"
  PY="$PY" PIP_CONSTRAINT="$PINS" \
    LAKEHOUSE_WHEEL_CACHE="${LAKEHOUSE_WHEEL_CACHE:-/Volumes/main/ml/wheels/lakehouse-wheels}" \
    bash "$SRC/scripts/build_horovod.sh"
fi
"$PY" -c "import pipeline, pytorch_lightning, deltalake; print('init-lakehouse: pipeline importable from', pipeline.__path__[0])"
