# shellcheck shell=bash
# The set-up scripts' early checks (sourced): the free space, the interpreter, and what the venv and the Horovod build
# need from the system. A venv that runs out of disk half-way, or a build that fails minutes in for a missing package,
# is worse than a refusal at the start that says what to do.

# GiB of free space each set-up wants before it starts: a profile's venv takes ~2.7 GiB, the vision venv ~7.1, and pip
# unpacks each wheel beside it.
# shellcheck disable=SC2034  # read by the scripts that source this one
NEED_GIB_PROFILE=5
# shellcheck disable=SC2034
NEED_GIB_VISION=10
# GiB each venv holds once installed (measured on a fresh clone, 2026-11-29: .venv 2.7, .venv-modern 2.7,
# .venv-dbr154 2.6, .venv-vision 7.2), rounded up: what the set-ups started at once take together, with
# SETUP_SLACK_GIB for pip's unpacked wheels while they install (each set-up's own NEED_GIB_* keeps its margin alone).
# shellcheck disable=SC2034
USE_GIB_PROFILE=3
# shellcheck disable=SC2034
USE_GIB_VISION=8
# shellcheck disable=SC2034
SETUP_SLACK_GIB=3

# free_gib PATH: the GiB free on PATH's file system (whole GiB, rounded down); nothing when df cannot tell.
free_gib() {
  df -Pk "$1" 2>/dev/null | awk 'NR==2 {printf "%d", $4 / 1048576}'
}

# need_disk GIB PATH WHAT: fail, saying how much is free and what to do, when PATH's file system (and pip's temporary
# folder's) has less than GIB GiB free.
need_disk() {
  local want=$1 path=$2 what=$3 dir free
  for dir in "$path" "${TMPDIR:-/tmp}"; do
    free=$(free_gib "$dir")
    [ -n "$free" ] || continue
    if [ "$free" -lt "$want" ]; then
      echo "$what needs about $want GiB free on the file system of $dir, which has $free GiB:" \
        "free some space (old venvs, clones, ~/.cache/pip) and re-run" >&2
      return 1
    fi
  done
}

# pick_python "3.11 3.12" WHAT: set PYTHON to the first interpreter that runs and is one of the versions given:
# $PYTHON if set (it must be one), else python3.11, python3.12, ..., python3. A pyenv shim of a version that is not
# active does not run, so it does not count.
pick_python() {
  local versions=$1 what=$2 wanted cands cand
  wanted="Python ${versions// / or }"
  if [ -n "${PYTHON:-}" ]; then
    _supported_python "$PYTHON" "$versions" && return 0
    echo "PYTHON=$PYTHON is not a working $wanted ($what)" >&2
    return 1
  fi
  cands="$(for v in $versions; do printf 'python%s ' "$v"; done)python3"
  for cand in $cands; do
    if _supported_python "$cand" "$versions"; then
      PYTHON=$cand
      return 0
    fi
  done
  local first=${versions%% *}
  echo "no $wanted found for $what (tried $cands); install one (Debian: apt-get install python$first" \
    "python$first-venv python$first-dev) or set PYTHON=/path/to/python" >&2
  return 1
}
_supported_python() {  # $1 an interpreter, $2 the versions ("3.11 3.12")
  "$1" -c "import sys; sys.exit(0 if '%d.%d' % sys.version_info[:2] in '$2'.split() else 1)" >/dev/null 2>&1
}

# need_tools PYTHON WHAT CHECK...: fail, naming what is missing and the Debian packages that provide it, when one of
# the CHECKs fails:
#   venv   PYTHON's venv module with ensurepip (`python3 -m venv`; Debian splits it off into python3.X-venv)
#   build  the Horovod build's compiler and tools: g++ (or $CXX), make, and PYTHON's headers (Python.h; python3.X-dev)
need_tools() {
  local python=$1 what=$2 check ver inc cxx missing=() pkgs=()
  shift 2
  ver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
    echo "$what: the interpreter $python does not run" >&2
    return 1
  }
  for check in "$@"; do
    case $check in
      venv)
        if ! "$python" -c "import venv, ensurepip" >/dev/null 2>&1; then
          missing+=("$python's venv module with ensurepip")
          pkgs+=("python$ver-venv")
        fi
        ;;
      build)
        cxx=${CXX:-g++}
        if ! command -v "${cxx%% *}" >/dev/null 2>&1; then
          missing+=("a C++ compiler ($cxx)")
          pkgs+=(g++)
        fi
        if ! command -v make >/dev/null 2>&1; then
          missing+=(make)
          pkgs+=(make)
        fi
        inc=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
        if [ ! -f "$inc/Python.h" ]; then
          missing+=("Python $ver's headers (${inc:-?}/Python.h)")
          pkgs+=("python$ver-dev")
        fi
        ;;
      *) echo "need_tools: unknown check $check" >&2; return 2 ;;
    esac
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local list
  list=$(printf '; %s' "${missing[@]}")
  echo "$what needs what this machine lacks: ${list:2}. Debian: apt-get install ${pkgs[*]}" >&2
  return 1
}

# horovod_wheel_cached PYTHON TORCH: true when scripts/build_horovod.sh's wheel cache holds a Horovod wheel built for
# PYTHON's version and torch TORCH ("2.13.0"; its cache keys read "torch2.13.0_cpu-cpu-cp311-gloo"): a set-up that
# finds one builds nothing, and needs no compiler.
horovod_wheel_cached() {
  local tag root
  tag=$("$1" -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null) || return 1
  root=${LAKEHOUSE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lakehouse-wheels}
  compgen -G "$root/horovod-*-torch${2}[_-]*-$tag-*/horovod-*.whl" > /dev/null
}
