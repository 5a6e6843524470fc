#!/usr/bin/env bash
# One device-tool call (<= 10 minutes) on a bare GPU machine: the GPU tier (scripts/gpu_check.sh, with the decode=gpu
# tests), the step overhead (`lakehouse bench --only step_overhead`), then the GPU figures (`lakehouse bench --gpu`,
# which reads with the arrow reader where Petastorm is absent) in the time left; logs and reports into $OUT. A Horovod
# wheel built by an earlier call comes back split into $OUT/hvd_whl_part_*: put the parts in hvdparts/ (git-ignored,
# carried) and the build is skipped.
#   DEVICE_LIMIT_S=570   the call's budget; the bench gets what the tier leaves
#   DEVICE_SKIP_TIER=1   the bench alone
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 LAKEHOUSE_WHEEL_CACHE=$PWD/hvdcache
OUT=${OUT:-work/device}
mkdir -p "$OUT"
LIMIT=${DEVICE_LIMIT_S:-570}
if ls hvdparts/hvd_whl_part_* >/dev/null 2>&1; then
  KEY=$(cat hvdparts/hvd_key.txt)
  mkdir -p "hvdcache/$KEY"
  cat hvdparts/hvd_whl_part_* > "hvdcache/$KEY/horovod-0.28.1-cp312-cp312-linux_x86_64.whl"
fi
if [ "${DEVICE_SKIP_TIER:-0}" != 1 ]; then
  LAKEHOUSE_BUNDLE=gpu_bundle timeout $((LIMIT - 60)) bash scripts/gpu_check.sh "$OUT/gpu_check.json" \
    > "$OUT/gpu_check.log" 2>&1
  echo "gpu_check: exit $?"
  grep -E "passed|failed|FAILED|ERROR|horovod [0-9]" "$OUT/gpu_check.log" | tail -20
else
  LAKEHOUSE_BUNDLE=gpu_bundle PY=python3 bash scripts/build_horovod.sh > "$OUT/horovod.log" 2>&1 || tail "$OUT/horovod.log"
  python3 -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], 'lakehouse-pipeline.pth').write_text('$PWD\n')"
fi
if [ ! -d hvdparts ] && ls hvdcache/*/horovod-*.whl >/dev/null 2>&1; then
  d=$(ls -d hvdcache/*/ | head -1); basename "$d" > "$OUT/hvd_key.txt"
  split -b 15M "$d"/horovod-*.whl "$OUT/hvd_whl_part_"
fi
# the framework's cost per step on the GPU (issue 36: at most 0.25 ms at world size 1), before the longer figures
LEFT=$((LIMIT - SECONDS))
if [ "$LEFT" -gt 150 ]; then
  timeout $((LEFT - 90)) python3 -m pipeline.cli bench --only step_overhead --quick --conf conf/local.yaml \
    --out "$OUT/step_overhead.json" data.reader=arrow > "$OUT/step_overhead.log" 2>&1
  echo "bench --only step_overhead: exit $? after $SECONDS s"
  grep -E "step_overhead" "$OUT/step_overhead.log" | grep -v "^\[" | tail -8
fi
LEFT=$((LIMIT - SECONDS))
if [ "$LEFT" -gt 60 ]; then
  # shellcheck disable=SC2086
  timeout "$LEFT" python3 -m pipeline.cli bench --gpu ${DEVICE_BENCH_FLAGS:-} --conf conf/local.yaml \
    --out "$OUT/gpu_bench.json" ${DEVICE_BENCH_OVERRIDES:-} > "$OUT/gpu_bench.log" 2>&1
  echo "bench --gpu: exit $? after $SECONDS s"
  grep -E "gpu_|images_per_s|loader_eff|FAIL|Error" "$OUT/gpu_bench.log" | grep -v "^\[" | tail -40
fi
