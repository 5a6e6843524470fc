#!/usr/bin/env bash
# On a networked machine: fetch what scripts/gpu_check.sh installs on a bare, offline CUDA machine into one folder
# (default gpu_bundle/, git-ignored; small enough for the device tool's `carry`, <= 64 MiB).
#   BUNDLE_PYTHON=3.12                        the CUDA machine's Python (major.minor)
#   BUNDLE_PLATFORMS="manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64"   its wheel platforms
#   BUNDLE_WITH_CMAKE=1                       add the cmake wheel (~ 30 MB) for a machine without CMake >= 3.13
#   BUNDLE_HAVE=FILE                          `pip list --format=freeze` of the CUDA machine: what it lists is left out
#                                             (wheels over 1 MB only; everything fetched is ~ 63 MB; pandas, matplotlib, pillow are the bulk)
# The CUDA machine is expected to have its CUDA torch, Lightning (with torchmetrics), numpy and pyarrow: those are
# not fetched. What the GPU tier imports beyond them (tests/gpu, pipeline.model/distributed/data/tracking):
#   horovod 0.28.1 (sdist, built there) + cffi, pycparser (its build) + cloudpickle, psutil, nvidia-ml-py (NVML for
#   the GPU telemetry), pyyaml, packaging
#   pytest, pytest-timeout (pytest.ini's timeout)
#   pillow (decode_image, pyfunc), simplejpeg (the CPU decode's JPEGs), pandas (pyfunc), matplotlib (rank 0's plots)
#   mlflow-skinny 3.17.2 + sqlalchemy + alembic (the SQLite tracking store and model registry on rank 0 / driver)
# No pyspark, petastorm, deltalake or Java: the tier trains from Parquet written with pyarrow.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_bundle}
PYV=${BUNDLE_PYTHON:-3.12}
PLATFORMS=${BUNDLE_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}
mkdir -p "$OUT"
PLAT_ARGS=()
for p in $PLATFORMS; do PLAT_ARGS+=(--platform "$p"); done

python3 -m pip download -q --no-deps --no-binary :all: "horovod==0.28.1" -d "$OUT"
REQS=(cffi pycparser cloudpickle psutil "nvidia-ml-py==13.615.71" pyyaml packaging "pytest==9.2.0" "pytest-timeout==2.4.0" "pillow==13.0.0"
      "simplejpeg==1.9.0" "pandas==2.3.3" "matplotlib==3.11.2" "mlflow-skinny==3.17.2" sqlalchemy alembic)
[ "${BUNDLE_WITH_CMAKE:-0}" = 1 ] && REQS+=("cmake==4.4.4")
python3 -m pip download -q --only-binary :all: --python-version "$PYV" "${PLAT_ARGS[@]}" -d "$OUT" "${REQS[@]}"
# what the CUDA machine already has (and the largest wheels): not carried
rm -f "$OUT"/numpy-*.whl "$OUT"/torch-*.whl "$OUT"/nvidia_*.whl "$OUT"/triton-*.whl "$OUT"/pyarrow-*.whl
if [ -n "${BUNDLE_HAVE:-}" ]; then
  # wheel names use the normalized distribution name (lower case, '_' for '-' and '.')
  for name in $(sed -n 's/^\([A-Za-z0-9_.-]*\)[=@ ].*/\1/p' "$BUNDLE_HAVE" | tr 'A-Z.-' 'a-z__'); do
    [ "$name" = horovod ] && continue  # the sdist is always built there
    # only the large ones: the machine's copy of a small one may be older than a fetched package needs
    # (databricks-sdk wants a newer certifi than the CUDA image has), and pip then takes the bundle's
    find "$OUT" -maxdepth 1 -name "$name-[0-9]*.whl" -size +1M -delete
  done
fi
SIZE_KB=$(du -sk "$OUT" | cut -f1)
[ "$SIZE_KB" -le 60000 ] || echo "warning: $OUT is $((SIZE_KB / 1024)) MB; the device tool carries 64 MiB in all: set BUNDLE_HAVE" >&2
echo "bundle in $OUT: $(ls "$OUT" | wc -l) files, $(du -sh "$OUT" | cut -f1)"
echo "run it: LAKEHOUSE_BUNDLE=$OUT bash scripts/gpu_check.sh   (device tool: carry [\"$OUT\"])"
