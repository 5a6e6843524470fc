# The free-space check of the set-up scripts (sourced): a venv that runs out of disk half-way is worse than none.
# need_disk GIB PATH WHAT: fail, saying how much is free and what to do, when PATH's file system (and pip's temporary
# folder's) has less than GIB GiB free.
need_disk() {
  local want=$1 path=$2 what=$3 dir free
  for dir in "$path" "${TMPDIR:-/tmp}"; do
    free=$(df -Pk "$dir" 2>/dev/null | awk 'NR==2 {printf "%d", $4 / 1048576}')
    [ -n "$free" ] || continue
    if [ "$free" -lt "$want" ]; then
      echo "$what needs about $want GiB free on the file system of $dir, which has $free GiB:" \
        "free some space (old venvs, clones, ~/.cache/pip) and re-run" >&2
      return 1
    fi
  done
}
