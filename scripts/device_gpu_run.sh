#!/usr/bin/env bash
# One device-tool call (<= 10 minutes) on a bare GPU machine: the GPU tier (scripts/gpu_check.sh: bundle install,
# Horovod built with NCCL, tests/gpu with the decode=gpu tests), then the GPU figures, each part bounded so that a slow
# one cannot starve the rest, and each writing its own report as it ends: the ImageNet-shaped photos
# (`bench --gpu --only photos`), the photo loader alone (bench.photos_loader), the step overhead
# (`lakehouse bench --only step_overhead`); on request the step profile and the per-arch Lightning / plain loop figures
# (`bench --gpu --only archs`). The GPU bench reads with the arrow reader where Petastorm is absent.
#   The call, from the repository root here:
#     bash scripts/fetch_gpu_bundle.sh            (once, networked: gpu_bundle/, <= 58 MiB, it says the carry's size)
#     run(command="DEVICE_TREE=<git rev-parse --short HEAD> DEVICE_LIMIT_S=560 bash scripts/device_gpu_run.sh",
#         carry=["gpu_bundle"] or ["gpu_bundle", "hvdparts"], timeout_s=600)
#   carry: gpu_bundle/ (the wheels and Horovod's sdist) and, when there, hvdparts/ (a Horovod wheel an earlier call
#   kept, below): both git-ignored; with the tree (~4 MiB) at most 64 MiB together, which fetch_gpu_bundle.sh checks.
# What comes back ($OUT, at most 8 files): summary.txt (what this script printed), reports.tgz (rebuilt after every
# part, so a call cut short keeps what ended: run_info.txt with the tree and the GPU, bench.log, gpu_check.log (the
# tier, one pytest per test), gpu_check.json, the parts' JSON reports, the tier's per-test XML, smi.csv (the card's
# load once a second), lscpu.txt) and, with DEVICE_KEEP_WHEEL=1, the Horovod wheel's parts. The reports are written
# into a folder outside $OUT (DEVICE_REPORTS, default a new temporary folder).
#   DEVICE_LIMIT_S=560     the call's budget; the last part gets what the others leave
#   DEVICE_BUILD_S=270     the bound of bundle install + Horovod build; each GPU test is bounded by DEVICE_TEST_S=150
#   DEVICE_HOROVOD=0       no Horovod build (~150 s saved): the photo jobs run in one process, the tests that need
#                          Horovod are not run
#   DEVICE_BENCH_FLAGS     e.g. --quick for every bench part
#   DEVICE_CPU_SHARES=0.25,0.4   data.decode_cpu_share values of the photo loader's decode=gpu figures (photos_loader)
#   DEVICE_TRAIN_CPU_SHARE=0     data.decode_cpu_share of the photo trainings with decode=gpu (gpu_photos)
#   DEVICE_PARTS           the parts to run, in the script's order: junit_decode gpu_photos junit_rest photos_loader
#                          step_overhead step_profile gpu_archs (default: all but step_profile and gpu_archs)
#   DEVICE_TREE            the tree's commit, recorded in run_info.txt (no .git travels to the device machine);
#                          beside it the sources' checksum: `bash scripts/device_gpu_run.sh --tree-sum` prints it here
#   DEVICE_KEEP_WHEEL=1    the Horovod wheel this call built, its debug info stripped, into $OUT as hvd_whl_part_* with
#                          hvd_key.txt: put them in hvdparts/ here, carry it, and the next call skips the build
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# the sources' checksum: the same here and there for the same tree (no .git there)
tree_sum() {
  find pipeline bench tests scripts conf setup.py -name __pycache__ -prune -o -type f \
    \( -name '*.py' -o -name '*.sh' -o -name '*.yaml' -o -name '*.txt' -o -name '*.ini' \) -print0 2>/dev/null \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}
if [ "${1:-}" = --tree-sum ]; then tree_sum; exit 0; fi

ALL_PARTS="junit_decode gpu_photos junit_rest photos_loader step_overhead step_profile gpu_archs"
PARTS=${DEVICE_PARTS:-junit_decode gpu_photos junit_rest photos_loader step_overhead}
for p in $PARTS; do
  [[ " $ALL_PARTS " == *" $p "* ]] || { echo "DEVICE_PARTS: no part $p (parts: $ALL_PARTS)" >&2; exit 2; }
done
export PYTHONUNBUFFERED=1 LAKEHOUSE_WHEEL_CACHE=$PWD/hvdcache
OUT=${OUT:-work/device}
mkdir -p "$OUT"
REP=${DEVICE_REPORTS:-$(mktemp -d "${TMPDIR:-/tmp}/device_reports.XXXXXX")}
mkdir -p "$REP"
LIMIT=${DEVICE_LIMIT_S:-560}
KILL_AFTER=15  # a bound's SIGKILL this long after its SIGTERM (a process that outlives SIGTERM cannot hold the rest)
: > "$OUT/summary.txt"
# say LINE...: printed and kept in $OUT/summary.txt
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
# pack: $REP into $OUT/reports.tgz, replaced whole (a temporary file renamed over it), after every part
pack() {
  local rc=0
  tar czf "$OUT/reports.tgz.part" --warning=no-file-changed -C "$REP" . 2>/dev/null || rc=$?
  # 1: a file (smi.csv) grew while it was read; the archive is whole
  if [ "$rc" -le 1 ]; then mv -f "$OUT/reports.tgz.part" "$OUT/reports.tgz"; else rm -f "$OUT/reports.tgz.part"; fi
}

# what ran where: the tree (DEVICE_TREE, else git's where .git is there) and its sources' checksum, the GPU
{
  echo "tree: ${DEVICE_TREE:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  git status --short 2>/dev/null | head -20 | sed 's/^/  changed: /'
  echo "sources' checksum: $(tree_sum)  (bash scripts/device_gpu_run.sh --tree-sum here)"
  echo "when: $(date -u +%Y-%m-%dT%H:%M:%SZ)  parts: $PARTS  limit: $LIMIT s"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4)"
} > "$REP/run_info.txt"
tee -a "$OUT/summary.txt" < "$REP/run_info.txt"
# the cores: physical or hyperthreads (the CPU decode's per-core figure depends on it)
{ lscpu; echo; nproc; } > "$REP/lscpu.txt" 2>&1
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv -l 1 > "$REP/smi.csv" 2>&1 &
  SMI_PID=$!
fi
if ls hvdparts/hvd_whl_part_* >/dev/null 2>&1; then
  KEY=$(cat hvdparts/hvd_key.txt)
  mkdir -p "hvdcache/$KEY"
  cat hvdparts/hvd_whl_part_* > "hvdcache/$KEY/horovod-0.28.1-cp312-cp312-linux_x86_64.whl"
  say "Horovod wheel from hvdparts/ ($KEY): no build"
fi
# the bundle installed and Horovod built with NCCL (deps ~50 s, Horovod ~145 s on 16 cores); no tests, no figures
GPU_CHECK_TESTS=0 GPU_CHECK_HOROVOD=${DEVICE_HOROVOD:-1} LAKEHOUSE_BUNDLE=gpu_bundle \
  timeout -k "$KILL_AFTER" "${DEVICE_BUILD_S:-270}" bash scripts/gpu_check.sh "$REP/gpu_check.json" \
  > "$REP/gpu_check.log" 2>&1
say "install + build: exit $? after $SECONDS s"
grep -E "horovod [0-9]" "$REP/gpu_check.log" | tail -2 | tee -a "$OUT/summary.txt"
if [ "${DEVICE_KEEP_WHEEL:-0}" = 1 ] && [ ! -d hvdparts ] && ls hvdcache/*/horovod-*.whl >/dev/null 2>&1; then
  d=$(ls -d hvdcache/*/ | head -1); basename "$d" > "$OUT/hvd_key.txt"
  whl=$(ls "$d"horovod-*.whl | head -1)
  # its shared objects without their debug info (~60 of a gloo build's 62 MB): the parts fit the carry beside the
  # bundle; RECORD rewritten for the new contents
  python3 - "$whl" "$REP/hvd_stripped.whl" <<'EOF' || cp "$whl" "$REP/hvd_stripped.whl"
import base64, csv, hashlib, io, os, subprocess, sys, tempfile, zipfile
src, dst = sys.argv[1:3]
rows, tmp = [], tempfile.mkdtemp()
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    for info in zin.infolist():
        if info.filename == record:
            continue
        data = zin.read(info)
        if info.filename.endswith(".so"):
            path = os.path.join(tmp, "lib.so")
            with open(path, "wb") as f:
                f.write(data)
            try:  # binutils' strip: kept as built where it is missing or fails
                if subprocess.run(["strip", "--strip-debug", path]).returncode == 0:
                    with open(path, "rb") as f:
                        data = f.read()
            except OSError:
                pass
        info.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append([info.filename, f"sha256={digest}", str(len(data))])
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows + [[record, "", ""]])
    zout.writestr(record, text.getvalue())
print(f"horovod wheel kept: {os.path.getsize(src) >> 20} MB, {os.path.getsize(dst) >> 20} MB stripped")
EOF
  split -b 15M "$REP/hvd_stripped.whl" "$OUT/hvd_whl_part_"; rm -f "$REP/hvd_stripped.whl"
  say "kept: $(cd "$OUT" && ls hvd_* | tr '\n' ' ')"
fi
pack

# wanted NAME: whether the parts to run (PARTS) name it
wanted() { [[ " $PARTS " == *" $1 "* ]]; }
# bounded NAME WANT LOG CMD...: CMD bounded by WANT seconds (or what is left of the call, less a margin), SIGKILLed
# KILL_AFTER s after the bound's SIGTERM, its output appended to LOG; then $REP packed again
bounded() {
  local name=$1 want=$2 log=$3; shift 3
  local left=$((LIMIT - SECONDS - 5))
  [ "$want" -gt "$left" ] && want=$left
  if [ "$want" -lt 30 ]; then say "$name: not run, ${left} s left"; return; fi
  echo "== $name (bounded at $want s)" >> "$log"
  timeout -k "$KILL_AFTER" "$want" "$@" >> "$log" 2>&1
  local rc=$?
  case $rc in
    124|137) say "$name: cut by its bound ($want s, exit $rc) after $SECONDS s" ;;
    *) say "$name: exit $rc after $SECONDS s" ;;
  esac
  pack
}
# part NAME SECONDS ARGS...: one bench run bounded by SECONDS (or what is left), its log appended to bench.log;
# PART_OVERRIDES: config key=value words after the others (argparse takes the overrides as one run of words)
part() {
  local name=$1 want=$2; shift 2
  wanted "$name" || return 0
  # shellcheck disable=SC2086  # DEVICE_BENCH_FLAGS and PART_OVERRIDES are words
  bounded "$name" "$want" "$REP/bench.log" python3 -m pipeline.cli bench "$@" ${DEVICE_BENCH_FLAGS:-} \
    --conf conf/local.yaml --out "$REP/$name.json" data.reader=arrow ${PART_OVERRIDES:-}
}
# The tests' own timeout markers (900 s) win over pytest's --timeout: this plugin (-p) gives each test the command
# line's instead, so that pytest-timeout records a test the bound would cut, before the bound's signals.
PLUGIN=$(mktemp -d "${TMPDIR:-/tmp}/device_plugin.XXXXXX")
cat > "$PLUGIN/device_bound.py" <<'EOF'
import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    timeout = config.getoption("timeout", None)
    if timeout:
        for item in items:
            item.add_marker(pytest.mark.timeout(timeout), append=False)
EOF
# The order (estimates from the calls of 2026-11-27/28; DEVICE_LIMIT_S=560):
#   install + build  154-212 s (bound 270; ~50 s when hvdparts/ holds a kept wheel)
#   junit_decode      ~80 s (bound 120)            the GPU decode against the CPU's: ends at 234-292 s
#   gpu_photos       131-156 s (bound 230)         the ImageNet-shaped trainings, the main figures: ends at 365-448 s
#   junit_rest       what is left, ~100-185 s      Horovod/DDP/FSDP tests, test_gpu_pipeline first (the launcher's path)
#   photos_loader    ~125 s (bound 180)            in what is left: with a kept wheel (the build's ~145 s saved)
#   step_overhead     ~50 s (bound 60)             likewise
#   step_profile      ~45 s (bound 45), gpu_archs ~70 s (bound 75): only when DEVICE_PARTS names them
# tier NAME SECONDS TESTS...: the tests of TESTS one pytest each, all of them bounded by SECONDS (or what is left), each
# by DEVICE_TEST_S or what is left of that (a test is not started with under 30 s left), pytest-timeout 15 s inside
# that; each test's outcome and failure in gpu_check.log as it ends. A test that the bound or pytest-timeout cuts is
# said to be cut, not failed (the 2026-11-28 call lost a whole pytest's report when its bound's SIGINT reached the
# Horovod ranks of the test under way).
tier() {
  local name=$1 want=$2; shift 2
  wanted "$name" || return 0
  local end=$((SECONDS + want)) stop=$((LIMIT - 10)) ids id left rc n=0 bad=0 cut=0 log=$REP/gpu_check.log from
  from=$(($( { wc -l < "$log"; } 2>/dev/null || echo 0) + 1))  # this tier's lines of the log
  [ "$end" -gt "$stop" ] && end=$stop
  ids=$(timeout -k 5 60 python3 -m pytest "$@" -q --collect-only -p no:cacheprovider 2>/dev/null | grep "::")
  [ -n "$ids" ] || say "$name: no tests collected from $*"
  for id in $ids; do
    left=$((end - SECONDS))
    [ "$left" -gt "${DEVICE_TEST_S:-150}" ] && left=${DEVICE_TEST_S:-150}
    if [ "$left" -lt 30 ]; then echo "CUT (not run: ${left} s left) $id" >> "$log"; cut=$((cut + 1)); continue; fi
    PYTHONPATH="$PLUGIN${PYTHONPATH:+:$PYTHONPATH}" timeout -k "$KILL_AFTER" "$left" \
      python3 -m pytest "$id" -ra -s -p no:cacheprovider -p device_bound --timeout="$((left - 15))" \
      --junitxml="$REP/${name}_$n.xml" >> "$log" 2>&1
    rc=$?
    # pytest-timeout's failure: the test ran out of the time left to it, which says nothing of the product
    [ "$rc" = 1 ] && grep -q "Timeout (&gt;.* from pytest-timeout" "$REP/${name}_$n.xml" 2>/dev/null && rc=timeout
    n=$((n + 1))
    case $rc in
      0|5) echo "PASSED-OR-SKIPPED $id" >> "$log" ;;
      124|137) echo "CUT (by the bound, ${left} s) $id" >> "$log"; cut=$((cut + 1)) ;;
      timeout) echo "CUT (by pytest-timeout, $((left - 15)) s of ${left} s) $id" >> "$log"; cut=$((cut + 1)) ;;
      *) echo "FAILED (pytest exit $rc) $id" >> "$log"; bad=$((bad + 1)) ;;
    esac
    pack
  done
  say "$name: $n run, $bad failed, $cut cut, after $SECONDS s"
  tail -n "+$from" "$log" | grep -E "^(PASSED-OR-SKIPPED|FAILED|CUT)|mean \|gpu - cpu\|" | tail -16 \
    | tee -a "$OUT/summary.txt"
  pack
}

# the decode tests first: they check the GPU decode against the CPU one
tier junit_decode 120 tests/gpu/test_gpu_decode.py
# ImageNet-shaped photos: the loader alone (decode=cpu|gpu) and timm resnet50/resnet18 at 224 px in bf16, decode=gpu
# with DEVICE_TRAIN_CPU_SHARE of each batch on the CPU's decode workers (data.decode_cpu_share; 0: nvJPEG alone, as the
# calls before it)
PART_OVERRIDES="data.decode_cpu_share=${DEVICE_TRAIN_CPU_SHARE:-0}" part gpu_photos 230 --gpu --only photos --quick
# the rest of the tier in the time left, each test bounded; a test cut by the call's end is reported as not run
tier junit_rest 600 tests/gpu --ignore=tests/gpu/test_gpu_decode.py
# the photo loader alone: decode=gpu (nvJPEG alone, then with a share of each batch on the CPU's decode workers:
# data.decode_cpu_share, DEVICE_CPU_SHARES), and decode=cpu over 1 and 4 worker processes (16: in gpu_photos);
# each in a fresh process, after ~15 s of rendering photos (the 2026-11-28 call's 1,4,16 did not fit 90 s)
if wanted photos_loader; then
  bounded photos_loader 180 "$REP/bench.log" python3 -m bench.photos_loader --rows 2048 --batches 8 \
    --workers "${DEVICE_LOADER_WORKERS:-1,4}" --cpu-shares "${DEVICE_CPU_SHARES:-0.25,0.4}" \
    --out "$REP/photos_loader.json"
fi
# the framework's cost per step on the GPU (issue 36: at most 0.25 ms at world size 1), then, on request, where it goes
part step_overhead 60 --only step_overhead --quick
if wanted step_profile; then
  bounded step_profile 45 "$REP/bench.log" python3 -m bench.step_profile --steps 300 --conf conf/local.yaml \
    --out "$REP/step_profile.json" data.reader=arrow
fi
# train() over a plain loop per arch and precision at 32 px (0.38-0.78 on c912d8d), on request
part gpu_archs 75 --gpu --only archs --quick

[ -n "${SMI_PID:-}" ] && kill "$SMI_PID" 2>/dev/null
[ -f "$REP/bench.log" ] && grep -E "bench.report: |Error" "$REP/bench.log" | grep -v "^ *backend=\|machine:" \
  | sed 's/.*report: //' | tail -40 | tee -a "$OUT/summary.txt"
pack
say "reports (in reports.tgz): $(cd "$REP" && ls | tr '\n' ' ')"
say "into \$OUT: $(cd "$OUT" && ls | tr '\n' ' ') after $SECONDS s"
