#!/usr/bin/env bash
# `make test`'s tiers: the classic profile's full suite, the modern and dbr-15.4 profiles' data-path tests
# (`-m datapath`), then the vision tier (timm) in .venv-vision; one summary line at the end.
#
# All four venvs are set up first, at once: the classic one in the foreground, the modern, dbr-15.4 and vision ones one
# after another in the background, each into its own log; the tests begin when every set-up has ended. Set-ups are
# downloads, unpacking and one Horovod build, and overlap well with each other; beside the tests they did not (the
# vision venv writes ~6 GB, and with this machine's I/O scheduler, none or mq-deadline, `ionice` changes nothing: the
# stop whose set-ups ran beside the classic suite took 5,027 s in CI against 4,334 s before). The vision venv of this
# run has no Horovod build (LAKEHOUSE_VISION_HOROVOD=0, ~4 minutes on 2 cores): its tier trains on DDP ranks. A tier
# whose set-up failed is said, with its log's tail, and not run (a half-built venv gives only import errors). Every
# tier runs even when an earlier one fails; the exit status is the worst of them.
#   VISION_TESTS="..."   the vision tier's test files (the Makefile's list)
#   LAKEHOUSE_SETUP_INLINE=1   one set-up after another, each before its own tier (the order before 2026-11-27)
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
    LAKEHOUSE_VISION_HOROVOD=0 "$MAKE" --no-print-directory "${t#*:}" > "$LOGS/$name.log" 2>&1
    echo $? > "$LOGS/$name.rc"
  done
}

t0=$(date +%s)
bg=""
if [ "${LAKEHOUSE_SETUP_INLINE:-0}" != 1 ]; then
  echo "== setting up the classic venv, and the modern, dbr-15.4 and vision venvs beside it (logs: $LOGS/)"
  setup_tiers &
  bg=$!
fi
"$MAKE" --no-print-directory .venv/.installed
classic_rc=$?
if [ -n "$bg" ]; then
  t1=$(date +%s)
  wait "$bg"
  echo "== set-ups: classic $((t1 - t0)) s, all $(( $(date +%s) - t0 )) s"
fi
if [ $classic_rc -ne 0 ]; then
  echo "== make test: classic: set-up failed (exit $classic_rc)"
  exit 1
fi

status=0
.venv/bin/python -m pytest tests -ra --durations=40 --durations-min=20
rc=$?
[ $rc -eq 0 ] || status=1
summary="classic: pytest exit $rc"

[ -n "$bg" ] || setup_tiers

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
