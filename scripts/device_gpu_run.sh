#!/usr/bin/env bash
# One device-tool call (<= 10 minutes) on a bare GPU machine: the GPU tier (scripts/gpu_check.sh: bundle install,
# Horovod built with NCCL, tests/gpu with the decode=gpu tests), then the GPU figures, each part bounded so that a slow
# one cannot starve the rest, and each writing its own report as it ends: the step overhead
# (`lakehouse bench --only step_overhead`), the ImageNet-shaped photos (`bench --gpu --only photos`), the per-arch
# Lightning / plain loop figures (`bench --gpu --only archs`). The GPU bench reads with the arrow reader where
# Petastorm is absent. Into $OUT (what the device tool brings back, at most 8 files): bench.log, gpu_check.log (the
# tier, one pytest per test), reports.tgz (gpu_check.json, step_overhead.json, step_profile.json, gpu_photos.json,
# gpu_archs.json, photos_loader.json, the tier's per-test XML, smi.csv: the card's load once a second, lscpu.txt).
#   DEVICE_LIMIT_S=560     the call's budget; the last part gets what the others leave
#   DEVICE_BUILD_S=240     the bound of bundle install + Horovod build; each GPU test is bounded by DEVICE_TEST_S=150
#   DEVICE_HOROVOD=0       no Horovod build (~150 s saved): the photo jobs run in one process, the tests that need
#                          Horovod are not run
#   DEVICE_BENCH_FLAGS     e.g. --quick for every bench part
#   DEVICE_CPU_SHARES=0.25,0.4   data.decode_cpu_share values of the photo loader's decode=gpu figures (photos_loader)
#   DEVICE_TRAIN_CPU_SHARE=0     data.decode_cpu_share of the photo trainings with decode=gpu (gpu_photos)
#   DEVICE_PARTS           the parts to run, in the script's order (default: all): junit_decode photos_loader
#                          step_overhead step_profile gpu_photos junit_rest gpu_archs
# A Horovod wheel from an earlier call: put its parts (DEVICE_KEEP_WHEEL=1 writes them into $OUT as hvd_whl_part_*,
# with hvd_key.txt) in hvdparts/ (git-ignored, carried) and the build is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 LAKEHOUSE_WHEEL_CACHE=$PWD/hvdcache
OUT=${OUT:-work/device}
mkdir -p "$OUT"
LIMIT=${DEVICE_LIMIT_S:-560}
# the cores: physical or hyperthreads (the CPU decode's per-core figure depends on it)
{ lscpu; echo; nproc; } > "$OUT/lscpu.txt" 2>&1
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
  SMI_PID=$!
fi
if ls hvdparts/hvd_whl_part_* >/dev/null 2>&1; then
  KEY=$(cat hvdparts/hvd_key.txt)
  mkdir -p "hvdcache/$KEY"
  cat hvdparts/hvd_whl_part_* > "hvdcache/$KEY/horovod-0.28.1-cp312-cp312-linux_x86_64.whl"
fi
# the bundle installed and Horovod built with NCCL (about 130 s on 16 cores); its report is the tier's at the end
GPU_CHECK_TESTS=0 GPU_CHECK_HOROVOD=${DEVICE_HOROVOD:-1} LAKEHOUSE_BUNDLE=gpu_bundle timeout -k 10 "${DEVICE_BUILD_S:-240}" \
  bash scripts/gpu_check.sh "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
echo "install + build: exit $? after $SECONDS s"
grep -E "horovod [0-9]" "$OUT/gpu_check.log" | tail -2
if [ "${DEVICE_KEEP_WHEEL:-0}" = 1 ] && [ ! -d hvdparts ] && ls hvdcache/*/horovod-*.whl >/dev/null 2>&1; then
  d=$(ls -d hvdcache/*/ | head -1); basename "$d" > "$OUT/hvd_key.txt"
  split -b 15M "$d"/horovod-*.whl "$OUT/hvd_whl_part_"
fi

# wanted NAME: whether DEVICE_PARTS (a list of names; empty: every part) names it
wanted() { [ -z "${DEVICE_PARTS:-}" ] || [[ " $DEVICE_PARTS " == *" $1 "* ]]; }
# part NAME SECONDS ARGS...: one bench run bounded by SECONDS (or what is left, less a margin), its log appended;
# PART_OVERRIDES: config key=value words after the others (argparse takes the overrides as one run of words)
part() {
  local name=$1 want=$2; shift 2
  wanted "$name" || return 0
  local left=$((LIMIT - SECONDS - 5))
  [ "$want" -gt "$left" ] && want=$left
  if [ "$want" -lt 30 ]; then echo "$name: not run, ${left} s left"; return; fi
  echo "== $name (bounded at $want s)" >> "$OUT/bench.log"
  # shellcheck disable=SC2086  # DEVICE_BENCH_FLAGS and PART_OVERRIDES are words
  timeout "$want" python3 -m pipeline.cli bench "$@" ${DEVICE_BENCH_FLAGS:-} --conf conf/local.yaml \
    --out "$OUT/$name.json" data.reader=arrow ${PART_OVERRIDES:-} >> "$OUT/bench.log" 2>&1
  echo "$name: exit $? after $SECONDS s"
}
# The decode tests first (they check the GPU decode against the CPU one), then the figures, then the rest of the tier in
# what is left (the 2026-11-27 call: install + build 130 s, tier 231 s, step overhead 73 s, photos 190+ s, archs 70 s:
# more than one call's 10 minutes at full sizes, hence --quick, and the archs part last).
# tier NAME SECONDS TESTS...: the tests of TESTS one pytest each, all of them bounded by SECONDS (or what is left), each
# by DEVICE_TEST_S or what is left of that; each test's outcome and failure in gpu_check.log as it ends. A test that the
# bound cuts is said to be cut, not failed (the 2026-11-28 call lost a whole pytest's report when its bound's SIGINT
# reached the Horovod ranks of the test under way and the process was then killed).
tier() {
  local name=$1 want=$2; shift 2
  wanted "$name" || return 0
  local end=$((SECONDS + want)) stop=$((LIMIT - 10)) ids id left rc n=0 bad=0 cut=0
  [ "$end" -gt "$stop" ] && end=$stop
  ids=$(timeout 60 python3 -m pytest "$@" -q --collect-only -p no:cacheprovider 2>/dev/null | grep "::")
  for id in $ids; do
    left=$((end - SECONDS))
    [ "$left" -gt "${DEVICE_TEST_S:-150}" ] && left=${DEVICE_TEST_S:-150}
    if [ "$left" -lt 20 ]; then echo "CUT (not run: ${left} s left) $id" >> "$OUT/gpu_check.log"; cut=$((cut + 1)); continue; fi
    timeout -k 10 "$left" python3 -m pytest "$id" -ra -s -p no:cacheprovider --timeout="$left" \
      --junitxml="$OUT/${name}_$n.xml" >> "$OUT/gpu_check.log" 2>&1
    rc=$?; n=$((n + 1))
    case $rc in
      0|5) echo "PASSED-OR-SKIPPED $id" >> "$OUT/gpu_check.log" ;;
      124|137) echo "CUT (by the bound, ${left} s) $id" >> "$OUT/gpu_check.log"; cut=$((cut + 1)) ;;
      *) echo "FAILED (pytest exit $rc) $id" >> "$OUT/gpu_check.log"; bad=$((bad + 1)) ;;
    esac
  done
  echo "$name: $n run, $bad failed, $cut cut, after $SECONDS s"
  grep -E "^(PASSED-OR-SKIPPED|FAILED|CUT)|mean \|gpu - cpu\|" "$OUT/gpu_check.log" | tail -16
}
tier junit_decode 90 tests/gpu/test_gpu_decode.py
# the photo loader alone: decode=gpu (nvJPEG alone, then with a share of each batch on the CPU's decode workers:
# data.decode_cpu_share, DEVICE_CPU_SHARES), and decode=cpu over 1 and 4 worker processes (16: in gpu_photos below);
# each in a fresh process, after ~15 s of rendering photos (the 2026-11-28 call's 1,4,16 did not fit 90 s: bounded at
# 150, 180 with the shares)
if wanted photos_loader; then
  left=$((LIMIT - SECONDS - 5)); [ "$left" -gt 180 ] && left=180
  timeout "$left" python3 -m bench.photos_loader --rows 2048 --batches 8 --workers "${DEVICE_LOADER_WORKERS:-1,4}" \
    --cpu-shares "${DEVICE_CPU_SHARES:-0.25,0.4}" --out "$OUT/photos_loader.json" >> "$OUT/bench.log" 2>&1
  echo "photos_loader: exit $? after $SECONDS s"
fi
# the framework's cost per step on the GPU (issue 36: at most 0.25 ms at world size 1), then where it goes
part step_overhead 60 --only step_overhead --quick
if wanted step_profile; then
  left=$((LIMIT - SECONDS - 5)); [ "$left" -gt 45 ] && left=45
  timeout "$left" python3 -m bench.step_profile --steps 300 --conf conf/local.yaml --out "$OUT/step_profile.json" \
    data.reader=arrow >> "$OUT/bench.log" 2>&1; echo "step_profile: exit $? after $SECONDS s"
fi
# ImageNet-shaped photos: the loader alone (decode=cpu|gpu) and timm resnet50/resnet18 at 224 px in bf16, decode=gpu
# with DEVICE_TRAIN_CPU_SHARE of each batch on the CPU's decode workers (data.decode_cpu_share; 0: nvJPEG alone, as the
# calls before it)
PART_OVERRIDES="data.decode_cpu_share=${DEVICE_TRAIN_CPU_SHARE:-0}" part gpu_photos 230 --gpu --only photos --quick
grep -E "bench.report: |Error" "$OUT/bench.log" | grep -v "^ *backend=\|machine:" | sed 's/.*report: //' | tail -40
# the rest of the tier in the time left, each test bounded; a test cut by the call's end is reported as not run
tier junit_rest 600 tests/gpu --ignore=tests/gpu/test_gpu_decode.py
# train() over a plain loop per arch and precision at 32 px (0.38-0.78 on c912d8d), if anything is left
part gpu_archs 75 --gpu --only archs --quick
# The device tool brings back at most 8 files: the reports, the tier's per-test XML, lscpu and the card's samples go in
# one archive beside the two logs (and the Horovod wheel's parts, when kept).
[ -n "${SMI_PID:-}" ] && kill "$SMI_PID" 2>/dev/null
( cd "$OUT" && tar czf reports.tgz --exclude=reports.tgz --exclude='hvd_*' --exclude=bench.log --exclude=gpu_check.log \
    -- * && find . -maxdepth 1 -type f ! -name reports.tgz ! -name 'hvd_*' ! -name bench.log ! -name gpu_check.log \
    -delete )
echo "into \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
