"""scripts/test_tiers.sh's control flow with stand-in venvs and make: every tier runs, the data-path tiers in a
low-weight cpu cgroup where one can be made (else in the foreground), and a failure in any of them fails the run and is
named in the summary. The stand-ins print which cpu cgroup they ran in; nothing here installs or tests anything real."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = (".venv", ".venv-modern", ".venv-dbr154", ".venv-vision")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


def _tree(tmp: Path, failing: str) -> Path:
    (tmp / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/test_tiers.sh", tmp / "scripts/test_tiers.sh")
    make = tmp / "fake-make"
    make.write_text('#!/bin/bash\nt=${@: -1}; mkdir -p "$(dirname "$t")"; touch "$t"\n')
    make.chmod(0o755)
    for venv in VENVS:
        python = tmp / venv / "bin/python"
        python.parent.mkdir(parents=True)
        code = 1 if venv == failing else 0
        python.write_text(f'#!/bin/bash\necho "[{venv}] $* in $(grep -m1 ":cpu:\\|:cpu,cpuacct:" /proc/self/cgroup '
                          f'| cut -d: -f3)"\nexit {code}\n')
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
