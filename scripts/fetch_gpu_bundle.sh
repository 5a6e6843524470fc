#!/usr/bin/env bash
# On a networked machine: fetch what scripts/gpu_check.sh installs on a bare, offline CUDA machine into one folder
# (default gpu_bundle/, git-ignored; small enough for the device tool's `carry`: <= 58 MiB, or this script fails).
#   BUNDLE_PYTHON=3.12                        the CUDA machine's Python (major.minor)
#   BUNDLE_PLATFORMS="manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64"   its wheel platforms
#   BUNDLE_WITH_CMAKE=1                       add the cmake wheel (~ 30 MB) for a machine without CMake >= 3.13
#   BUNDLE_HAVE=FILE                          what the CUDA machine has, one package a line (NAME, NAME==VERSION or
#                                             `pip list --format=freeze`): its wheels over 1 MB are left out.
#                                             Default: scripts/gpu_image_packages.txt (the device tool's GPU image);
#                                             BUNDLE_HAVE= (empty) leaves out nothing (~ 63 MB: over the carry's limit)
# The CUDA machine is expected to have its CUDA torch, Lightning (with torchmetrics), numpy and pyarrow: those are
# not fetched. What the GPU tier imports beyond them (tests/gpu, pipeline.model/distributed/data/tracking):
#   horovod 0.28.1 (sdist, built there) + cffi, pycparser (its build) + cloudpickle, psutil, nvidia-ml-py (NVML for
#   the GPU telemetry), pyyaml, packaging
#   pytest, pytest-timeout (pytest.ini's timeout)
#   pillow (decode_image, pyfunc), simplejpeg (the CPU decode's JPEGs), pandas (pyfunc), matplotlib (rank 0's plots)
#   mlflow-skinny 3.17.2 + sqlalchemy + alembic (the SQLite tracking store and model registry on rank 0 / driver)
# No pyspark, petastorm, deltalake or Java: the tier trains from Parquet written with pyarrow. With the default
# BUNDLE_HAVE the image's pandas, matplotlib (fonttools, kiwisolver), pillow and pygments are used: ~ 28 MB carried.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_bundle}
PYV=${BUNDLE_PYTHON:-3.12}
PLATFORMS=${BUNDLE_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}
mkdir -p "$OUT"
PLAT_ARGS=()
for p in $PLATFORMS; do PLAT_ARGS+=(--platform "$p"); done

python3 -m pip download -q --no-deps --no-binary :all: "horovod==0.28.1" -d "$OUT"
REQS=(cffi pycparser cloudpickle psutil "nvidia-ml-py==13.615.71" pyyaml packaging "pytest==9.2.0"
      "pytest-timeout==2.4.0" "pillow==13.0.0" "simplejpeg==1.9.0" "pandas==2.3.3" "matplotlib==3.11.2"
      "mlflow-skinny==3.17.2" sqlalchemy alembic)
[ "${BUNDLE_WITH_CMAKE:-0}" = 1 ] && REQS+=("cmake==4.4.4")
python3 -m pip download -q --only-binary :all: --python-version "$PYV" "${PLAT_ARGS[@]}" -d "$OUT" "${REQS[@]}"
# what the CUDA machine already has (and the largest wheels): not carried
rm -f "$OUT"/numpy-*.whl "$OUT"/torch-*.whl "$OUT"/nvidia_*.whl "$OUT"/triton-*.whl "$OUT"/pyarrow-*.whl
# normalized: how wheel file names spell a distribution (lower case, one '_' for each run of '-', '_', '.')
normalized() { tr 'A-Z' 'a-z' | sed 's/[-_.][-_.]*/_/g'; }
HAVE=${BUNDLE_HAVE-scripts/gpu_image_packages.txt}
if [ -n "$HAVE" ]; then
  [ -f "$HAVE" ] || { echo "BUNDLE_HAVE=$HAVE: no such file" >&2; exit 1; }
  # a line's name: before any version, extra, marker or URL ('#' starts a comment)
  HAVE_NAMES=$(sed -e 's/#.*//' -n -e 's/^[[:space:]]*\([A-Za-z0-9][A-Za-z0-9_.-]*\).*/\1/p' "$HAVE" | normalized \
    | sort -u)
  LEFT_OUT=()
  for whl in "$OUT"/*.whl; do
    [ -e "$whl" ] || continue
    f=$(basename "$whl")
    dist=$(echo "${f%%-*}" | normalized)
    # only the large ones: the machine's copy of a small one may be older than a fetched package needs
    # (databricks-sdk wants a newer certifi than the CUDA image has), and pip then takes the bundle's
    if grep -qxF "$dist" <<< "$HAVE_NAMES" && [ "$(stat -c %s "$whl")" -gt 1048576 ]; then
      rm -f "$whl"; LEFT_OUT+=("$f")
    fi
  done
  echo "left out (named in $HAVE, over 1 MB): ${LEFT_OUT[*]:-none}"
fi
BYTES=$(find "$OUT" -maxdepth 1 -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
MIB=$(( (BYTES + 1048575) / 1048576 ))
echo "bundle in $OUT: $(find "$OUT" -maxdepth 1 -type f | wc -l) files, $MIB MiB"
if [ "$BYTES" -gt $((58 * 1048576)) ]; then
  echo "error: $OUT is $MIB MiB, over 58 MiB: with the working tree it is over the device tool's 64 MiB carry." >&2
  echo "Its largest files (leave out what the CUDA machine has: BUNDLE_HAVE):" >&2
  find "$OUT" -maxdepth 1 -type f -printf '%s %f\n' | sort -rn | head -8 \
    | awk '{printf "  %6.1f MiB  %s\n", $1 / 1048576, $2}' >&2
  exit 1
fi
# what one device call carries: the working tree (tracked and untracked files git does not ignore), the bundle,
# and hvdparts/ (a kept Horovod wheel, scripts/device_gpu_run.sh) when it is there
TREE=$( { git ls-files -co --exclude-standard -z 2>/dev/null || true; } | du -cb --files0-from=- 2>/dev/null \
  | tail -1 | cut -f1)
HVD=0
[ -d hvdparts ] && HVD=$(find hvdparts -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
TOTAL=$(( ${TREE:-0} + BYTES + HVD ))
echo "carry: tree $(( ${TREE:-0} >> 20 )) MiB + $OUT $MIB MiB + hvdparts $((HVD >> 20)) MiB =" \
  "$(( (TOTAL + 1048575) >> 20 )) MiB of the device tool's 64"
[ "$TOTAL" -le $((64 * 1048576)) ] || echo "warning: over 64 MiB: the device tool refuses the call" >&2
echo "run it: LAKEHOUSE_BUNDLE=$OUT bash scripts/gpu_check.sh   (device tool: carry [\"$OUT\"])"
