"""scripts/test_tiers.sh's control flow with stand-in venvs and make: every tier runs, the data-path tiers in a
low-weight cpu cgroup where one can be made (else in the foreground), and a failure in any of them fails the run and is
named in the summary. The stand-ins print which cpu cgroup they ran in; nothing here installs or tests anything real."""
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = (".venv", ".venv-modern", ".venv-dbr154", ".venv-vision")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


def _tree(tmp: Path, failing: str = "", hanging: dict = None) -> Path:
    """The script in `tmp` beside stand-in venvs and make; `hanging`: {venv: what in its arguments makes it hang}, a
    stand-in that then ignores SIGTERM and waits on a child of its own, both of whose pids go into tmp/hung-*.pids."""
    (tmp / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/test_tiers.sh", tmp / "scripts/test_tiers.sh")
    make = tmp / "fake-make"
    make.write_text('#!/bin/bash\nt=${@: -1}; mkdir -p "$(dirname "$t")"; touch "$t"\n')
    make.chmod(0o755)
    for venv in VENVS:
        python = tmp / venv / "bin/python"
        python.parent.mkdir(parents=True)
        code = 1 if venv == failing else 0
        hang = ""
        if venv in (hanging or {}):
            hang = (f'case "$*" in *{hanging[venv]}*) trap "" TERM; sleep 300 & '
                    f'echo "$$ $!" > {tmp}/hung-{venv.strip(".")}.pids; wait;; esac\n')
        python.write_text(f'#!/bin/bash\necho "[{venv}] $* in $(grep -m1 ":cpu:\\|:cpu,cpuacct:" /proc/self/cgroup '
                          f'| cut -d: -f3)"\n{hang}exit {code}\n')
        python.chmod(0o755)
    return make


def _run(tmp: Path, make: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/test_tiers.sh"], cwd=tmp, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MAKE": str(make), "VISION_TESTS": "tests/v.py", **env})


def _soak_dir(out: subprocess.CompletedProcess) -> Path:  # the run's own cgroup (a `make test` beside has another)
    return Path(re.search(r"in (/sys/fs/cgroup/cpu/lakehouse-soak-\d+);", out.stdout).group(1))


def _soak_possible() -> bool:
    return os.geteuid() == 0 and os.access(CGROUP_CPU, os.W_OK) and (CGROUP_CPU / "cpu.shares").is_file()


def test_a_failing_data_path_tier_fails_the_run_and_is_named_wherever_it_ran(tmp_path):
    make = _tree(tmp_path, failing=".venv-dbr154")
    out = _run(tmp_path, make)
    assert out.returncode == 1, out.stdout + out.stderr
    summary = [line for line in out.stdout.splitlines() if line.startswith("== make test:")]
    assert summary == ["== make test: classic: pytest exit 0; vision: pytest exit 0; modern: pytest exit 0; "
                       "dbr-15.4: pytest exit 1"], out.stdout
    ran = [line for line in out.stdout.splitlines() if line.startswith("[.venv-")]
    data_path = [line for line in ran if "-m datapath" in line]
    assert len(data_path) == 2 and len(ran) == 3, out.stdout  # modern, dbr-15.4, then vision: each once
    if _soak_possible():
        assert all("/lakehouse-soak-" in line for line in data_path), out.stdout
        assert "at a low CPU weight (cpu.shares 64" in out.stdout
        assert not _soak_dir(out).exists(), "the soak cgroup was left behind"
        # what the phases used of the cores, and what the background tiers took (where a cpuacct group counts it)
        assert re.search(r"the lanes ended .*since the set-ups ended: cores \d+ % busy, the data-path tiers "
                         r"(\d+ CPU-s|CPU not counted)\);", out.stdout), out.stdout
        assert re.search(r"the quiet phase ended \(\d+ s in; cores \d+ % busy\)", out.stdout), out.stdout
        assert re.search(r"the data-path tiers ended \(\d+ s in; in all (\d+ CPU-s|CPU not counted)\)", out.stdout)
        assert not Path(str(_soak_dir(out)).replace("/cpu/", "/cpuacct/")).exists(), "the cpuacct group was left"
    else:
        assert all("/lakehouse-soak-" not in line for line in data_path), out.stdout
    assert all("/lakehouse-soak-" not in line for line in out.stdout.splitlines() if line.startswith("[.venv-vision]"))


def test_with_the_soak_off_the_data_path_tiers_run_in_the_foreground_before_the_vision_tier(tmp_path):
    make = _tree(tmp_path, failing=".venv-vision")
    out = _run(tmp_path, make, LAKEHOUSE_SOAK_SHARES="0")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "vision: pytest exit 1" in out.stdout and "modern: pytest exit 0; dbr-15.4: pytest exit 0" in out.stdout
    ran = [line.split("]")[0] + "]" for line in out.stdout.splitlines() if line.startswith("[.venv-")]
    assert ran == ["[.venv-modern]", "[.venv-dbr154]", "[.venv-vision]"], out.stdout
    assert "/lakehouse-soak-" not in out.stdout and "low CPU weight" not in out.stdout


@pytest.mark.skipif(not _soak_possible(), reason="needs root and a writable cgroup v1 cpu controller")
def test_the_soak_cgroup_is_removed_when_its_tiers_fail_too(tmp_path):
    make = _tree(tmp_path, failing=".venv-modern")
    out = _run(tmp_path, make)
    assert out.returncode == 1 and "modern: pytest exit 1" in out.stdout, out.stdout
    assert not _soak_dir(out).exists()


def _alive(pid: int) -> bool:  # a zombie is not (a container's pid 1 may never reap what it inherits)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _hung_pids(tmp: Path) -> list:
    return [int(p) for f in tmp.glob("hung-*.pids") for p in f.read_text().split()]


def _summary(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stdout.splitlines() if line.startswith("== make test:")]
    assert len(lines) == 1, out.stdout + out.stderr
    return lines[0]


def test_a_tier_past_its_bound_is_killed_with_its_processes_and_fails_the_run_naming_it(tmp_path):
    """A hung tier (here one that ignores SIGTERM, with a child of its own) is stopped at LAKEHOUSE_TIER_TIMEOUT_S:
    SIGTERM to its process group, SIGKILL LAKEHOUSE_TIER_KILL_AFTER_S later. It is named with the bound, fails the
    run, and the other tiers run and pass: a lane (output to its log), the vision tier in the foreground, a data-path
    tier in the background cgroup where one can be made (else in the foreground) and the one after it."""
    make = _tree(tmp_path, hanging={".venv": "junit-lane-b", ".venv-vision": "tests/v.py", ".venv-modern": "datapath"})
    start = time.monotonic()
    out = _run(tmp_path, make, LAKEHOUSE_TIER_TIMEOUT_S="3", LAKEHOUSE_TIER_KILL_AFTER_S="2")
    took = time.monotonic() - start
    assert out.returncode == 1, out.stdout + out.stderr
    summary = _summary(out)
    assert summary.startswith("== make test: classic: pytest exit 124; vision: pytest exit 124; modern: pytest exit "
                              "124; dbr-15.4: pytest exit 0; timed out (LAKEHOUSE_TIER_TIMEOUT_S): "), out.stdout
    assert sorted(summary.split("(LAKEHOUSE_TIER_TIMEOUT_S): ")[1].split(", ")) == [
        "lane B (3 s)", "modern (3 s)", "vision (3 s)"], summary
    for tier in ("lane B", "vision", "modern"):
        assert f"== {tier}: TIMED OUT after 3 s (LAKEHOUSE_TIER_TIMEOUT_S)" in out.stdout, out.stdout
    assert "lane A: TIMED OUT" not in out.stdout and "dbr-15.4: TIMED OUT" not in out.stdout
    assert took < 60, f"{took:.0f} s: the hung tiers were not stopped at their bound"  # else 300 s, or _run's 120
    hung = _hung_pids(tmp_path)
    assert len(hung) == 6, hung  # each hung tier's stand-in and its child
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in hung) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in hung if _alive(p)], "a hung tier's process outlived it"
    if _soak_possible():
        assert "[.venv-modern] -m pytest tests -m datapath -ra in /lakehouse-soak-" in out.stdout, out.stdout
        assert not _soak_dir(out).exists(), "the soak cgroup was left behind"


def test_tiers_within_the_bound_pass(tmp_path):
    make = _tree(tmp_path)
    out = _run(tmp_path, make, LAKEHOUSE_TIER_TIMEOUT_S="20")
    assert out.returncode == 0, out.stdout + out.stderr
    assert _summary(out) == ("== make test: classic: pytest exit 0; vision: pytest exit 0; modern: pytest exit 0; "
                             "dbr-15.4: pytest exit 0"), out.stdout
    assert "TIMED OUT" not in out.stdout and not list((tmp_path / "work/setup-logs").glob("tiers.*"))


@pytest.mark.parametrize("bound", ["", "0", "1h"])
def test_the_bound_is_a_whole_number_of_seconds_or_none(tmp_path, bound):
    make = _tree(tmp_path)
    out = _run(tmp_path, make, LAKEHOUSE_TIER_TIMEOUT_S=bound, LAKEHOUSE_SOAK_SHARES="0")
    if bound == "1h":
        assert out.returncode == 2 and "LAKEHOUSE_TIER_TIMEOUT_S=1h is not a whole number of seconds" in out.stdout
    else:
        assert out.returncode == 0 and "dbr-15.4: pytest exit 0" in _summary(out), out.stdout + out.stderr


@pytest.mark.parametrize("bound", ["", "0"])
def test_a_run_stopped_by_a_signal_stops_its_tiers_in_their_own_process_groups(tmp_path, bound):
    """The tiers run in process groups of their own (for the bound), out of the terminal's: SIGINT to the run (as a
    Ctrl-C) is passed on to them, and a tier's process that ignores it is killed with its group; with no bound (0)
    too."""
    make = _tree(tmp_path, hanging={".venv-vision": "tests/v.py"})
    proc = subprocess.Popen(["bash", "scripts/test_tiers.sh"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "MAKE": str(make), "VISION_TESTS": "tests/v.py",
                                 "LAKEHOUSE_SOAK_SHARES": "0", "LAKEHOUSE_TIER_KILL_AFTER_S": "2",
                                 "LAKEHOUSE_TIER_TIMEOUT_S": bound})
    try:
        deadline = time.monotonic() + 60
        while len(_hung_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        hung = _hung_pids(tmp_path)
        assert len(hung) == 2, "the vision stand-in never started"
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "stopped by SIGINT" in out, out
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in hung) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in hung if _alive(p)], "a tier's process outlived the stopped run"
