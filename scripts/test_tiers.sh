#!/usr/bin/env bash
# `make test`'s tiers: the classic profile's full suite, the modern and dbr-15.4 profiles' data-path tests
# (`-m datapath`), then the vision tier (timm) in .venv-vision; one summary line at the end.
#
# All four venvs are set up at once: the classic one in the foreground, the vision, dbr-15.4 and modern ones one after
# another beside it, each into its own log. Once the classic venv is ready, lane A starts: the bench's tests (they check
# what the bench reports, never how fast), then the classic tests that assert no tight timing (LANE_TESTS), beside the
# set-ups still going; once every set-up has ended, lane B starts on its own two files, then on the same list, and the
# vision tier and the classic unit tests run beside the two, and the modern and dbr-15.4 data-path tiers in the
# background at a low CPU weight (below: they soak up the idle cores until the end). The lanes share the list file by
# file until all of it has run; then the classic tests they did not run (the integration and multi-host tests with time
# bounds, kills and namespaces among them) run on a machine quiet but for that low-weight background. (A fresh clone,
# 2026-11-28, before any lane: the classic set-up 447 s, all set-ups 1,092 s, the bench's tests ended at 1,618 s, the
# other tiers and unit tests at 2,046 s, then 2,956 s of integration and multi-host tests.) Set-ups (downloads,
# unpacking, one Horovod build) overlap well with each other, not with timed tests: the vision venv writes ~6 GB, and
# with this machine's I/O scheduler (none or mq-deadline) `ionice` changes nothing (the stop whose set-ups ran beside
# the whole classic suite took 5,027 s in CI against 4,334 s before). The vision venv of this run has no Horovod build
# (LAKEHOUSE_VISION_HOROVOD=0, ~4 minutes on 2 cores): its tier trains on DDP ranks. A tier whose set-up failed is said,
# with its log's tail, and not run (a half-built venv gives only import errors). Every tier runs even when an earlier
# one fails; the exit status is the worst of them. One exception: a modern, dbr-15.4 or vision set-up that refused to
# start for lack of disk (need_disk's message; the disk of a CI machine is shared and varies, seen from 8 to 80 GiB
# free) is said in the summary as "NOT RUN (disk ...)", with a warning at the summary's end, and does not fail the
# run; LAKEHOUSE_REQUIRE_ALL_TIERS=1 makes it fail. The set-ups' free space is checked once for all of them before
# they start (each set-up's own check sees the same free space when they start at once): where their sum is not
# free, the vision, dbr-15.4 and modern set-ups run after the classic one, each checking the space then left.
# A data-path tier that selects no test (pytest's exit 5) fails the run: tests are marked datapath for every profile.
#   VISION_TESTS="..."   the vision tier's test files (the Makefile's list)
#   LAKEHOUSE_SETUP_INLINE=1   the classic set-up and whole suite first, then the other set-ups one after another
#   LAKEHOUSE_SOAK_SHARES=N   the data-path tiers' CPU weight in the background (default 64; 0: in the foreground)
#   LAKEHOUSE_TIER_TIMEOUT_S=N   each tier's wall-clock bound (default 3600; 0: none): a lane, the vision tier, a
#     data-path tier (in the background too), the classic unit tests, the quiet phase; LAKEHOUSE_SETUP_INLINE's whole
#     classic suite, one session, gets three times it. A tier past it is stopped (`timeout`: SIGTERM to its process
#     group, SIGKILL LAKEHOUSE_TIER_KILL_AFTER_S later, default 30), said naming it and the bound, and fails the run.
#     The longest tiers measured took ~1,900-2,000 s (docs/testing.md: lane A; modern's data-path tests in the
#     background), more on a slower machine. A hung tier no longer holds the run until CI's own limit, naming nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
# `make test`'s recipe is not a recursive one (it names no $(MAKE), so that `make -n test` only prints it): under
# `make -jN` make passes the jobserver's name in MAKEFLAGS but not the jobserver itself, and each sub-make below would
# warn "jobserver unavailable". The other flags stay; each sub-make builds one venv, with -jN of its own if given.
if [[ ${MAKEFLAGS:-} == *--jobserver-* ]]; then
  MAKEFLAGS=$(sed -E 's/ ?--jobserver-(auth|fds)=[^ ]*//g' <<< "$MAKEFLAGS")
  export MAKEFLAGS
fi
LOGS=work/setup-logs
mkdir -p "$LOGS"
# The vision set-up first: it builds no Horovod, and its downloads and ~7 GB of writes overlap the classic set-up's
# Horovod build; the dbr-15.4 and modern venvs, whose torch and Python are the classic one's, then find its wheel in
# the cache (scripts/build_horovod.sh's lock). In the other order the modern set-up waited for that build with the
# cores part idle (2026-11-28: the cores' idle time in the first 600 s rose from 61 to 178 core-seconds).
TIERS=("vision:.venv-vision/.installed" "dbr-15.4:.venv-dbr154/.installed" "modern:.venv-modern/.installed")

# Each tier runs under `bounded`: coreutils `timeout` in a process group of its own, so that a tier past
# TIER_TIMEOUT_S is killed with all its processes (ones that made a session of their own, such as a test's server,
# excepted). Being out of the terminal's group, a tier would miss a Ctrl-C or a SIGTERM sent to the run: `stop_tiers`
# passes it on to every tier's group. TIER_STATE holds one file per running tier (named by its group), "timed-out"
# (the tiers past the bound, for the summary) and "stop" (no tier starts once the run is stopping).
TIER_TIMEOUT_S=${LAKEHOUSE_TIER_TIMEOUT_S:-3600}
TIER_KILL_AFTER_S=${LAKEHOUSE_TIER_KILL_AFTER_S:-30}
TIER_STATE=$PWD/$LOGS/tiers.$$
soak=""
for v in TIER_TIMEOUT_S TIER_KILL_AFTER_S; do
  if ! [[ ${!v} =~ ^[0-9]+$ ]]; then
    echo "== make test: LAKEHOUSE_$v=${!v} is not a whole number of seconds"
    exit 2
  fi
done
if [ "$TIER_TIMEOUT_S" -gt 0 ] && ! command -v timeout > /dev/null; then
  echo "== make test: LAKEHOUSE_TIER_TIMEOUT_S=$TIER_TIMEOUT_S needs coreutils' timeout, not on PATH (0: no bound)"
  exit 2
fi
rm -rf "$TIER_STATE"
mkdir -p "$TIER_STATE"
on_exit() {  # the soak cgroup (once its tiers ended) and this run's tier state
  [ -z "$soak" ] || rmdir "$soak" "/sys/fs/cgroup/cpuacct/lakehouse-soak-$$" 2>/dev/null
  rm -rf "$TIER_STATE"
}
trap on_exit EXIT
stop_tiers() {  # $1: the signal the run got: passed on to every running tier; then the run ends
  local f groups=() pids
  touch "$TIER_STATE/stop"
  for f in "$TIER_STATE"/group-*; do
    [ -e "$f" ] && groups+=("${f##*-}")
  done
  echo "== make test: stopped by SIG$1: passed on to the running tiers (${#groups[@]})"
  [ ${#groups[@]} -eq 0 ] || kill -"$1" "${groups[@]}" 2>/dev/null  # each `timeout` passes it on to its group
  # shellcheck disable=SC2206  # the lanes' and the background tiers' subshells, where they run
  pids=(${lane_a:-} ${lane_b:-} ${soak_pid:-} "${groups[@]}")
  [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}" 2>/dev/null  # within TIER_KILL_AFTER_S: then `timeout` sends SIGKILL
  for f in "${groups[@]}"; do  # what outlived its tier's command (`timeout` waits for that alone)
    kill -KILL -- "-$f" 2>/dev/null
  done
  exit $((128 + $(kill -l "$1")))
}
for sig in INT TERM HUP; do
  # shellcheck disable=SC2064  # the signal's name, now
  trap "stop_tiers $sig" "$sig"
done
bounded() {  # $1 the tier's name, $2 its bound in seconds (0: none), then its command; returns its exit status
  local name=$1 bound=$2 start pid rc late
  shift 2
  [ ! -e "$TIER_STATE/stop" ] || return 143
  if ! command -v timeout > /dev/null; then  # only with a bound of 0 (checked above): no group of its own
    "$@"
    return
  fi
  start=$(date +%s)  # `timeout 0`: no bound, but the tier's own group all the same (a signal to the run reaches it)
  timeout --kill-after="$TIER_KILL_AFTER_S" "$bound" "$@" &  # `&` and `wait`: a signal to the run is taken at once
  pid=$!
  touch "$TIER_STATE/group-$pid"
  wait "$pid"
  rc=$?
  rm -f "$TIER_STATE/group-$pid"
  late=$(( $(date +%s) - start >= bound ))
  if [ "$bound" -gt 0 ] && { [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ "$late" -eq 1 ]; }; }; then
    kill -KILL -- "-$pid" 2>/dev/null  # what outlived the tier in its group (timeout waits for its command alone)
    echo "== $name: TIMED OUT after $bound s (LAKEHOUSE_TIER_TIMEOUT_S): its processes were killed; it fails the run"
    echo "$name ($bound s)" >> "$TIER_STATE/timed-out"
    return 124
  fi
  return $rc
}

setup_tiers() {  # each tier's set-up in turn: its make target's output in $LOGS/<tier>.log, its exit status in .rc
  for t in "${TIERS[@]}"; do
    name=${t%%:*}
    rm -f "$LOGS/$name.rc"
    LAKEHOUSE_VISION_HOROVOD=0 "$MAKE" --no-print-directory "${t#*:}" > "$LOGS/$name.log" 2>&1
    echo $? > "$LOGS/$name.rc"
  done
}

# The free space the set-ups want at once. Each set-up checks its own need (scripts/need_disk.sh: 5 GiB for a profile,
# 10 for the vision venv) when it starts, but the classic set-up and the others start together and see the same free
# space: 10-14 GiB passed every check and the disk filled half-way through the installs. So where the classic set-up
# runs beside the others, what the venvs still to install take once installed (USE_GIB_*, measured) and pip's slack
# are summed here, once, before any starts (~20 GiB for all four). (The vision, dbr-15.4 and modern set-ups run one after another: each one's own check
# sees what the ones before it wrote.)
disk_fits_all() {  # 0 when the free space holds every set-up still to run at once
  local want parts t n free free_tmp list
  [ -f scripts/need_disk.sh ] || return 0  # a copy of this script alone (tests/unit/test_test_tiers.py's stand-ins)
  [ ! -f .venv/.installed ] || return 0  # no classic set-up beside the others
  . scripts/need_disk.sh
  want=$((USE_GIB_PROFILE + SETUP_SLACK_GIB))
  parts=("classic $USE_GIB_PROFILE GiB" "pip's unpacking $SETUP_SLACK_GIB GiB")
  for t in "${TIERS[@]}"; do
    [ ! -f "${t#*:}" ] || continue
    n=$USE_GIB_PROFILE
    [ "${t%%:*}" != vision ] || n=$USE_GIB_VISION
    want=$((want + n))
    parts+=("${t%%:*} $n GiB")
  done
  free=$(free_gib .)
  free_tmp=$(free_gib "${TMPDIR:-/tmp}")  # pip unpacks there; the smaller of the two counts
  [ -z "$free_tmp" ] || [ -z "$free" ] || [ "$free_tmp" -ge "$free" ] || free=$free_tmp
  if [ ${#parts[@]} -le 2 ] || [ -z "$free" ] || [ "$free" -ge "$want" ]; then
    return 0
  fi
  list=$(printf ', %s' "${parts[@]}")
  echo "== set-ups: the $((${#parts[@]} - 1)) set-ups to run need about $want GiB free together (${list:2}), and this" \
    "machine has $free GiB free (. and ${TMPDIR:-/tmp}): the other set-ups run after the classic one instead of" \
    "beside it, one after another, each checking the space then left (one that does not fit is NOT RUN (disk))." \
    "Free some space to run them all (old venvs, clones, pip's cache)."
  return 1
}

t0=$(date +%s)
bg=""
setup_after_classic=0
if [ "${LAKEHOUSE_SETUP_INLINE:-0}" != 1 ]; then
  if disk_fits_all; then
    echo "== setting up the classic venv, and the vision, dbr-15.4 and modern venvs beside it (logs: $LOGS/)"
    setup_tiers &
    bg=$!
  else
    setup_after_classic=1
  fi
fi
"$MAKE" --no-print-directory .venv/.installed
classic_rc=$?
t1=$(date +%s)
if [ $setup_after_classic = 1 ] && [ $classic_rc -eq 0 ]; then
  echo "== setting up the vision, dbr-15.4 and modern venvs, one after another (logs: $LOGS/)"
  setup_tiers &
  bg=$!
fi
if [ $classic_rc -ne 0 ]; then
  [ -z "$bg" ] || wait "$bg"
  echo "== make test: classic: set-up failed (exit $classic_rc)"
  exit 1
fi

status=0
summary=""
BENCH_TESTS=tests/integration/test_bench.py
# The lane's tests after the bench's, larger files first: none asserts a tight time bound (a hang guard of minutes at
# most), kills a process on a timer, needs the network namespaces or a heartbeat of a few seconds kept beside the vision
# set-up's writes (test_tune_resume's 2 s, 6 s of grace; test_gate_race's lease settled in 0.5 s: lane B's own, below),
# or looks for processes by name across the machine (test_early_start_jobs), so none minds sharing the cores, the disk
# and the process table. (A rank killed at a given step or checkpoint write, as in test_fsdp, is not a kill on a timer.)
LANE_TESTS=(training tune fsdp horovod_strategy notebooks small_table photos_decode lakehouse data_path direct_train
  cache_leases tracking secrets predict_races gate_fair spark_session_ownership databricks_install ingest_races
  ingest_accounting spark_on_demand gate_chance horovod_one_rank table_location_gate run_checkpoints sync_resume
  doctor_notebook direct_source ingest_formats ingest_hostile_names submit_master)
LANE_TESTS=("${LANE_TESTS[@]/#/tests/integration/test_}")
LANE_TESTS=("${LANE_TESTS[@]/%/.py}")
# Lane B's own, first: tests whose heartbeat or lease needs writes to land within seconds, which the set-ups' disk
# writes could stall (the vision venv writes ~6 GB) but no longer can once they ended, when lane B starts. In the
# quiet phase they used the cores 16-17 % of the time (test_gate_race 84 s, test_tune_resume 21 s, fresh clone of
# 2026-11-28): they mostly wait.
LANE_B_TESTS=(tests/integration/test_gate_race.py tests/integration/test_tune_resume.py)
LANE_RECORD=$PWD/work/lane-ran.tsv  # absolute: a test may change the working directory
LANE_CLAIMS=$PWD/$LOGS/lane-claims  # the files the lanes took (tests/conftest.py)
DISK_REFUSAL="needs about [0-9]* GiB free"  # scripts/need_disk.sh
disk_skipped=()  # the tiers not run for lack of disk, named again at the summary's end
set_up() {  # $1 tier name: 0 when its set-up succeeded, else its log's tail is shown
  local rc
  rc=$(cat "$LOGS/$1.rc" 2>/dev/null || echo "none")
  [ "$rc" = 0 ] && return 0
  echo "== $1: set-up failed (exit $rc); the end of $LOGS/$1.log:"
  tail -n 40 "$LOGS/$1.log" 2>/dev/null
  return 1
}
not_set_up() {  # $1 tier name: its set-up failed; a refusal for lack of disk is said and, by default, not a failure
  local need has
  if grep -q "$DISK_REFUSAL" "$LOGS/$1.log" 2>/dev/null && [ "${LAKEHOUSE_REQUIRE_ALL_TIERS:-0}" != 1 ]; then
    need=$(grep -o "$DISK_REFUSAL" "$LOGS/$1.log" | head -1 | grep -o "[0-9]*")
    has=$(grep -o "which has [0-9]* GiB" "$LOGS/$1.log" | head -1 | grep -o "[0-9]*")
    echo "== $1: NOT RUN: this machine lacks the disk its venv needs (about $need GiB, $has GiB free);" \
      "LAKEHOUSE_REQUIRE_ALL_TIERS=1 makes this a failure"
    summary="$summary; $1: NOT RUN (disk: needs $need GiB, $has free)"
    disk_skipped+=("$1")
  else
    status=1
    summary="$summary; $1: set-up failed"
  fi
}
datapath_tiers() {  # the modern and dbr-15.4 profiles' data-path tests; each one's exit status in $LOGS/<name>.test-rc
  local p name venv
  for p in modern:.venv-modern dbr-15.4:.venv-dbr154; do
    name=${p%%:*}
    venv=${p#*:}
    rm -f "$LOGS/$name.test-rc"
    set_up "$name" || continue  # said in the summary by datapath_summary
    echo "== $name profile: data-path tests ($venv)"
    bounded "$name" "$TIER_TIMEOUT_S" "$venv/bin/python" -m pytest tests -m datapath -ra
    echo $? > "$LOGS/$name.test-rc"  # 5, no test selected, fails the tier (datapath_summary)
  done
}
datapath_summary() {  # the data-path tiers in the summary and the status (they may have run in the background)
  local name rc
  for name in modern dbr-15.4; do
    if [ -f "$LOGS/$name.test-rc" ]; then
      rc=$(cat "$LOGS/$name.test-rc")
      [ "$rc" = 0 ] || status=1
      if [ "$rc" = 5 ]; then  # pytest's "no tests collected": the data-path tests were not found, a failure
        echo "== $name profile: FAILED: \`pytest tests -m datapath\` selected no test (pytest exit 5)"
        summary="$summary; $name: pytest exit 5 (no datapath test selected)"
      else
        summary="$summary; $name: pytest exit $rc"
      fi
    elif [ "$(cat "$LOGS/$name.rc" 2>/dev/null)" = 0 ]; then
      status=1
      summary="$summary; $name: set up, but its tests left no exit status"
    else
      not_set_up "$name"
    fi
  done
}
vision_tier() {
  local rc
  if set_up vision; then
    echo "== vision tier: timm backbones (.venv-vision)"
    # shellcheck disable=SC2086  # the Makefile's list of files, split on spaces
    bounded vision "$TIER_TIMEOUT_S" .venv-vision/bin/python -m pytest \
      ${VISION_TESTS:?set VISION_TESTS: the vision tier test files} -ra
    rc=$?
    [ $rc -eq 0 ] || status=1
    summary="$summary; vision: pytest exit $rc"
  else
    not_set_up vision
  fi
}
# The data-path tiers soak up the quiet phase's idle cores. The quiet phase's tests (time bounds, kills, namespaces)
# left the cores idle ~35 % of its 1,884 s (fresh clone of 2026-11-29: 62-77 % busy), while until then the cores were
# busy ~99 % of the time, the modern and dbr-15.4 tiers' 1,141 s among it. So, from the time lane B starts, those two
# run in the background, in a cpu cgroup of low weight (cpu.shares LAKEHOUSE_SOAK_SHARES, default 64 against 1,024 for
# each session of this run): where they contend for a core, the lanes and the quiet tests keep nearly all of it; where
# a core is idle, the data-path tests take it. Started only once the lanes end (fresh clone fc21, 2026-11-30), they ran
# in 1,295 s of the quiet phase (672 CPU-s), whose tests then took 1,922 s against 1,635-1,688, while the lanes gained
# nothing seen (2,210 s in); so they start with lane B again. The lanes' and quiet phase's ends say how busy the cores were, and the lanes' end and the
# data-path tiers' end what CPU those used (a cpuacct group). (Probe on this machine, three busy loops on 2 cores for
# 6 s: with the third in such a cgroup at 1,024 it took a whole core and the other two shared one; at 128 or
# 16 the two ran as fast as one alone and the third still got about a third of a core.) Their own bounds (a command in
# 120 s at the least) are minutes, not seconds. Where no such cgroup can be made (not root, no writable cgroup v1 cpu
# controller; LAKEHOUSE_SOAK_SHARES=0), they run in the foreground before the vision tier, as before.
SOAK_SHARES=${LAKEHOUSE_SOAK_SHARES:-64}
soak_cgroup() {  # prints the path of a new cpu cgroup of weight SOAK_SHARES, or nothing where none can be made
  local dir=/sys/fs/cgroup/cpu/lakehouse-soak-$$
  [ "$SOAK_SHARES" -gt 0 ] 2>/dev/null && [ -w /sys/fs/cgroup/cpu ] && [ -f /sys/fs/cgroup/cpu/cpu.shares ] || return 0
  mkdir "$dir" 2>/dev/null || return 0
  if echo "$SOAK_SHARES" > "$dir/cpu.shares" 2>/dev/null; then
    echo "$dir"
    # where cpuacct is its own v1 controller, a group of the same name counts the CPU the background tiers used
    # (said when the lanes end and when they end: what the soak took from the lanes, what it left to the quiet phase)
    [ -f "$dir/cpuacct.usage" ] || [ ! -w /sys/fs/cgroup/cpuacct ] ||
      mkdir "/sys/fs/cgroup/cpuacct/lakehouse-soak-$$" 2>/dev/null
  else
    rmdir "$dir" 2>/dev/null
  fi
}
soak_cpu() {  # the CPU the background tiers used so far ("N CPU-s"), where a cpuacct group counts it
  local f
  for f in "$soak/cpuacct.usage" "/sys/fs/cgroup/cpuacct/lakehouse-soak-$$/cpuacct.usage" ""; do
    [ -z "$f" ] || [ ! -r "$f" ] || break
  done
  if [ -n "$f" ]; then echo "$(( $(cat "$f") / 1000000000 )) CPU-s"; else echo "CPU not counted"; fi
}
busy_since() {  # $1 "user+nice+system total" of /proc/stat's cpu line at a start: the cores' busy % since then
  local now
  now=$(cpu_ticks)
  [ -n "$1" ] && [ -n "$now" ] && [ "${now#* }" -gt "${1#* }" ] &&
    echo "cores $(( 100 * (${now%% *} - ${1%% *}) / (${now#* } - ${1#* }) )) % busy"
}
cpu_ticks() {  # "busy total" jiffies of all cores (/proc/stat): busy = user + nice + system + irq + softirq
  [ -r /proc/stat ] && awk '/^cpu /{b=$2+$3+$4+$7+$8; t=b+$5+$6+$9; print b, t; exit}' /proc/stat
}

if [ -n "$bg" ]; then
  # The lanes: once the classic venv is ready, lane A starts on the bench's tests (~15 minutes; they check what the
  # bench reports, never how fast it was) and then the classic tests that assert no tight timing (LANE_TESTS); once
  # every set-up has ended, lane B starts on its own files (LANE_B_TESTS), then on the same list. The two share it file
  # by file (tests/conftest.py: LAKEHOUSE_LANE_CLAIMS), beside the vision tier and the classic unit tests (and the
  # data-path tiers, at a low weight, where a soak cgroup could be made), until every file of it has run; then the
  # integration and multi-host tests that wait for a quiet machine run, leaving out those the lanes ran
  # (LAKEHOUSE_LANE_DONE; one a lane skipped runs again). With one lane, which stopped when the tiers ended, ~640 s of
  # the lane's tests were left to run one at a time on the quiet machine; with two, the whole list ran before the tiers
  # ended, and a fresh clone took 3,996 s against 4,177 (docs/testing.md: the cores are now busy ~99 % of the time until
  # the quiet phase, so a third lane would only share them).
  echo "== classic: lanes A and B (the bench's tests, then tests without tight timing), beside the other set-ups and" \
    "tiers (output: $LOGS/lane-a.log, $LOGS/lane-b.log)"
  rm -rf "$LANE_RECORD" "$LANE_CLAIMS"
  lane() {  # $1: the lane's name, then its own files; its tests are those of its files whose file it claims first
    local name=$1
    shift
    bounded "lane ${name^^}" "$TIER_TIMEOUT_S" env LAKEHOUSE_LANE_RECORD="$LANE_RECORD" \
      LAKEHOUSE_LANE_CLAIMS="$LANE_CLAIMS" .venv/bin/python -m pytest "$@" "$BENCH_TESTS" "${LANE_TESTS[@]}" -ra \
      --durations=10 --junitxml="work/junit-lane-$name.xml" > "$LOGS/lane-$name.log" 2>&1
  }
  lane a &
  lane_a=$!
  wait "$bg"
  echo "== set-ups: classic $((t1 - t0)) s, all $(( $(date +%s) - t0 )) s; lane B starts"
  lane b "${LANE_B_TESTS[@]}" &
  lane_b=$!
  ticks_lanes=$(cpu_ticks)
  soak=$(soak_cgroup)  # on_exit removes it
  soak_pid=""
  if [ -n "$soak" ]; then
    echo "== the modern and dbr-15.4 data-path tiers run in the background, beside the lanes and then the quiet" \
      "phase, at a low CPU weight (cpu.shares $SOAK_SHARES in $soak; output: $LOGS/datapath.log)"
    (
      echo "$BASHPID" > "$soak/cgroup.procs" || echo "== could not join $soak: the data-path tiers run at full weight"
      [ ! -d "/sys/fs/cgroup/cpuacct/lakehouse-soak-$$" ] ||
        echo "$BASHPID" > "/sys/fs/cgroup/cpuacct/lakehouse-soak-$$/cgroup.procs" 2>/dev/null
      datapath_tiers
    ) > "$LOGS/datapath.log" 2>&1 &
    soak_pid=$!
  else
    datapath_tiers
  fi
  vision_tier
  echo "== classic: unit tests"
  bounded "classic unit tests" "$TIER_TIMEOUT_S" .venv/bin/python -m pytest tests/unit -ra
  rc_unit=$?
  echo "== the other tiers and the unit tests ended ($(( $(date +%s) - t0 )) s in); waiting for the lanes"
  wait "$lane_a"
  rc_lane=$?
  wait "$lane_b"
  rc_b=$?
  [ $rc_lane -ne 0 ] || rc_lane=$rc_b
  echo "== classic: the lanes ended ($(( $(date +%s) - t0 )) s in, $(wc -l < "$LANE_RECORD" 2>/dev/null || echo 0)" \
    "tests run; since the set-ups ended: $(busy_since "$ticks_lanes")${soak:+, the data-path tiers $(soak_cpu)});" \
    "their output:"
  ticks_quiet=$(cpu_ticks)
  cat "$LOGS/lane-a.log" "$LOGS/lane-b.log"
  echo "== classic: integration and multi-host tests (those the lanes did not run)"
  bounded "classic quiet phase" "$TIER_TIMEOUT_S" env LAKEHOUSE_LANE_DONE="$LANE_RECORD" .venv/bin/python -m pytest \
    tests -ra --durations=40 --durations-min=20 --junitxml=work/junit-classic.xml --ignore=tests/unit
  rc=$?
  [ $rc -ne 0 ] || rc=$rc_unit
  [ $rc -ne 0 ] || rc=$rc_lane
  if [ -n "$soak_pid" ]; then
    echo "== the quiet phase ended ($(( $(date +%s) - t0 )) s in; $(busy_since "$ticks_quiet")); waiting for the" \
      "data-path tiers"
    wait "$soak_pid"
    echo "== the data-path tiers ended ($(( $(date +%s) - t0 )) s in; in all $(soak_cpu)); their output:"
    cat "$LOGS/datapath.log"  # on_exit removes the cgroup
  fi
else
  bounded classic $((3 * TIER_TIMEOUT_S)) .venv/bin/python -m pytest tests -ra --durations=40 --durations-min=20 \
    --junitxml=work/junit-classic.xml
  rc=$?
fi
[ $rc -eq 0 ] || status=1
summary="classic: pytest exit $rc$summary"
if [ -z "$bg" ]; then
  setup_tiers
  datapath_tiers
  vision_tier
fi
datapath_summary
if [ -s "$TIER_STATE/timed-out" ]; then  # each also failed its tier (exit 124) above
  status=1
  mapfile -t timed_out < "$TIER_STATE/timed-out"
  joined=$(printf ', %s' "${timed_out[@]}")
  summary="$summary; timed out (LAKEHOUSE_TIER_TIMEOUT_S): ${joined:2}"
fi
if [ ${#disk_skipped[@]} -gt 0 ]; then  # a pass that did not run every tier says so where a CI log's tail shows it
  summary="$summary; WARNING: NOT RUN for lack of disk: ${disk_skipped[*]} (not counted as failures;"
  summary="$summary LAKEHOUSE_REQUIRE_ALL_TIERS=1 makes them fail)"
fi

echo "== make test: $summary"
exit $status
