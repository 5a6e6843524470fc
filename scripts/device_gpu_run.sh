#!/usr/bin/env bash
# One device-tool call (<= 10 minutes) on a bare GPU machine: the GPU tier (scripts/gpu_check.sh: bundle install,
# Horovod built with NCCL, tests/gpu with the decode=gpu tests), then the GPU figures, each part bounded so that a slow
# one cannot starve the rest, and each writing its own report as it ends: the step overhead
# (`lakehouse bench --only step_overhead`), the ImageNet-shaped photos (`bench --gpu --only photos`), the per-arch
# Lightning / plain loop figures (`bench --gpu --only archs`). The GPU bench reads with the arrow reader where
# Petastorm is absent. Into $OUT, at most 8 files (what the device tool brings back): smi.csv (the card's load once a
# second), gpu_check.json + gpu_check.log (the tier), step_overhead.json, gpu_photos.json, gpu_archs.json, bench.log.
#   DEVICE_LIMIT_S=560     the call's budget; the last part gets what the others leave
#   DEVICE_TIER_S=330      the tier's bound (build included); each GPU test is bounded by DEVICE_TEST_S=150
#   DEVICE_SKIP_TIER=1     the figures alone (Horovod still built)
#   DEVICE_BENCH_FLAGS     e.g. --quick for every bench part
# A Horovod wheel from an earlier call: put its parts (DEVICE_KEEP_WHEEL=1 writes them into $OUT as hvd_whl_part_*,
# with hvd_key.txt) in hvdparts/ (git-ignored, carried) and the build is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 LAKEHOUSE_WHEEL_CACHE=$PWD/hvdcache
OUT=${OUT:-work/device}
mkdir -p "$OUT"
LIMIT=${DEVICE_LIMIT_S:-560}
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
fi
if ls hvdparts/hvd_whl_part_* >/dev/null 2>&1; then
  KEY=$(cat hvdparts/hvd_key.txt)
  mkdir -p "hvdcache/$KEY"
  cat hvdparts/hvd_whl_part_* > "hvdcache/$KEY/horovod-0.28.1-cp312-cp312-linux_x86_64.whl"
fi
if [ "${DEVICE_SKIP_TIER:-0}" != 1 ]; then
  PYTEST_ADDOPTS="--timeout=${DEVICE_TEST_S:-150}" LAKEHOUSE_BUNDLE=gpu_bundle timeout "${DEVICE_TIER_S:-330}" \
    bash scripts/gpu_check.sh "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
  echo "gpu_check: exit $? after $SECONDS s"
  grep -E "passed|failed|FAILED|ERROR|horovod [0-9]" "$OUT/gpu_check.log" | tail -20
else
  LAKEHOUSE_BUNDLE=gpu_bundle PY=python3 bash scripts/build_horovod.sh > "$OUT/bench.log" 2>&1 || tail "$OUT/bench.log"
  python3 -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], 'lakehouse-pipeline.pth').write_text('$PWD\n')"
fi
if [ "${DEVICE_KEEP_WHEEL:-0}" = 1 ] && [ ! -d hvdparts ] && ls hvdcache/*/horovod-*.whl >/dev/null 2>&1; then
  d=$(ls -d hvdcache/*/ | head -1); basename "$d" > "$OUT/hvd_key.txt"
  split -b 15M "$d"/horovod-*.whl "$OUT/hvd_whl_part_"
fi

# part NAME SECONDS ARGS...: one bench run bounded by SECONDS (or what is left, less a margin), its log appended
part() {
  local name=$1 want=$2; shift 2
  local left=$((LIMIT - SECONDS - 5))
  [ "$want" -gt "$left" ] && want=$left
  if [ "$want" -lt 30 ]; then echo "$name: not run, ${left} s left"; return; fi
  echo "== $name (bounded at $want s)" >> "$OUT/bench.log"
  # shellcheck disable=SC2086  # DEVICE_BENCH_FLAGS are words
  timeout "$want" python3 -m pipeline.cli bench "$@" ${DEVICE_BENCH_FLAGS:-} --conf conf/local.yaml \
    --out "$OUT/$name.json" data.reader=arrow >> "$OUT/bench.log" 2>&1
  echo "$name: exit $? after $SECONDS s"
}
# the framework's cost per step on the GPU (issue 36: at most 0.25 ms at world size 1)
part step_overhead 75 --only step_overhead
# ImageNet-shaped photos: the loader alone (decode=cpu|gpu) and timm resnet50/resnet18 at 224 px in bf16
part gpu_photos 190 --gpu --only photos
# train() over a plain loop per arch and precision at 32 px (0.38-0.78 on c912d8d)
part gpu_archs 600 --gpu --only archs
grep -E "pipeline.bench.report: |Error" "$OUT/bench.log" | grep -v "^ *backend=\|machine:" | sed 's/.*report: //' | tail -40
