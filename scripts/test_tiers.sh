#!/usr/bin/env bash
# `make test`'s tiers: the classic profile's full suite, the modern and dbr-15.4 profiles' data-path tests
# (`-m datapath`), then the vision tier (timm) in .venv-vision; one summary line at the end.
#
# The three other venvs are set up in the background while the classic suite runs (a cold machine spends ~10 minutes
# on them: downloads, unpacking, a Horovod build for the vision venv's torch), at the lowest CPU and I/O priority
# (nice 19, ionice idle), one after another, each into its own log. The tests keep the cores: a niced build gets the
# cycles they leave. A tier whose set-up failed is said, with its log's tail, and not run (a half-built venv gives only
# import errors). Every tier runs even when an earlier one fails; the exit status is the worst of them.
#   VISION_TESTS="..."   the vision tier's test files (the Makefile's list)
#   LAKEHOUSE_SETUP_INLINE=1   set the other venvs up after the classic suite instead, in the foreground
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
LOGS=work/setup-logs
mkdir -p "$LOGS"
TIERS=("modern:.venv-modern/.installed" "dbr-15.4:.venv-dbr154/.installed" "vision:.venv-vision/.installed")

setup_tiers() {  # each tier's set-up in turn: its make target's output in $LOGS/<tier>.log, its exit status in .rc
  for t in "${TIERS[@]}"; do
    name=${t%%:*}
    rm -f "$LOGS/$name.rc"
    "$MAKE" --no-print-directory "${t#*:}" > "$LOGS/$name.log" 2>&1
    echo $? > "$LOGS/$name.rc"
  done
}

bg=""
if [ "${LAKEHOUSE_SETUP_INLINE:-0}" != 1 ]; then
  echo "== setting up the modern, dbr-15.4 and vision venvs in the background (logs: $LOGS/)"
  (  # the subshell and everything it starts: the lowest CPU and I/O priority
    renice -n 19 -p "$BASHPID" >/dev/null
    ! command -v ionice >/dev/null 2>&1 || ionice -c 3 -p "$BASHPID"
    setup_tiers
  ) &
  bg=$!
fi

status=0
.venv/bin/python -m pytest tests -ra --durations=40 --durations-min=20
rc=$?
[ $rc -eq 0 ] || status=1
summary="classic: pytest exit $rc"

if [ -n "$bg" ]; then
  t0=$(date +%s)
  wait "$bg"
  echo "== the background set-up ended $(( $(date +%s) - t0 )) s after the classic suite"
else
  setup_tiers
fi

set_up() {  # $1 tier name: 0 when its set-up succeeded, else its log's tail is shown
  local rc
  rc=$(cat "$LOGS/$1.rc" 2>/dev/null || echo "none")
  [ "$rc" = 0 ] && return 0
  echo "== $1: set-up failed (exit $rc); the end of $LOGS/$1.log:"
  tail -n 40 "$LOGS/$1.log" 2>/dev/null
  return 1
}

for p in modern:.venv-modern dbr-15.4:.venv-dbr154; do
  name=${p%%:*}
  venv=${p#*:}
  if set_up "$name"; then
    echo "== $name profile: data-path tests ($venv)"
    "$venv/bin/python" -m pytest tests -m datapath -ra
    rc=$?
    if [ $rc -eq 5 ]; then
      echo "$name profile: no test is marked datapath"
    elif [ $rc -ne 0 ]; then
      status=1
    fi
    summary="$summary; $name: pytest exit $rc"
  else
    status=1
    summary="$summary; $name: set-up failed"
  fi
done

if set_up vision; then
  echo "== vision tier: timm backbones (.venv-vision)"
  # shellcheck disable=SC2086  # the Makefile's list of files, split on spaces
  .venv-vision/bin/python -m pytest ${VISION_TESTS:?set VISION_TESTS: the vision tier test files} -ra
  rc=$?
  [ $rc -eq 0 ] || status=1
  summary="$summary; vision: pytest exit $rc"
else
  status=1
  summary="$summary; vision: set-up failed"
fi

echo "== make test: $summary"
exit $status
