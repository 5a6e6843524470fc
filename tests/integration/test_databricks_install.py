"""Installing on each Databricks target replaces nothing the runtime provides: pip's own resolver, run dry, decides.

For each target, a stand-in of the runtime's Python environment: a bare venv of the target's Python (3.11 / 3.12)
holding the runtime's packages at the versions its constraints file records (metadata only: pip reads installed
distributions from their dist-info). Into it, `pip --python <it> install --dry-run --report` of what the init script
installs: requirements-<target>.txt under the constraints, resolved from PyPI as on the cluster. The report lists
what pip would install; a runtime package in it would replace the runtime's. pyspark is left out of the stand-in,
as on the cluster (there it is on sys.path, not a pip distribution), so anything that pulled it in would show.
Skipped, with the reason, only when PyPI cannot be reached.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.lakehouse.runtime import RUNTIME_PACKAGES, TARGETS, read_constraints

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "databricks"
# Replaced on purpose, and said so in the constraints file: 15.4 LTS ML ships MLflow 2.13.1 (unpinned there), the
# project logs MLflow 3 LoggedModels.
UNPINNED_RUNTIME = {"dbr-15.4-ml": {"mlflow": "2.13.1"}, "dbr-17.3-ml": {}}
REPLACED_ON_PURPOSE = {"dbr-15.4-ml": {"mlflow"}, "dbr-17.3-ml": set()}
NETWORK_ERRORS = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                  "ConnectTimeoutError", "Max retries exceeded")


@pytest.fixture(scope="module")
def pypi():
    try:
        socket.create_connection(("pypi.org", 443), timeout=15).close()
    except OSError as exc:
        pytest.skip(f"PyPI is unreachable from here (pypi.org:443: {exc}): the dry-run resolution needs it")


def find_python(version: str) -> str:
    """A working interpreter of `version` (PATH, then pyenv's installs); the message says how to get one."""
    cands = [shutil.which(f"python{version}")]
    cands += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")), reverse=True)
    for cand in filter(None, cands):
        done = subprocess.run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                              text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip() == version:
            return cand
    pytest.skip(f"no working Python {version} (PATH, ~/.pyenv/versions): the target's interpreter is needed to "
                f"resolve as its runtime does; install it (e.g. `pyenv install {version}`)")


def runtime_standin(target: str, where: Path) -> Path:
    """A bare venv of the target's Python with the runtime's packages as installed distributions (dist-info only)."""
    t = TARGETS[target]
    venv = where / f"runtime-{target}"
    subprocess.run([find_python(t.python), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
    have = {**read_constraints(t.constraints), **UNPINNED_RUNTIME[target]}
    have.pop("pyspark")  # on the runtime's sys.path, not a pip distribution
    for name, version in have.items():
        info = Path(site) / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("databricks-runtime-standin\n")
    return venv / "bin" / "python"


def dry_run(target: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    t = TARGETS[target]
    python = runtime_standin(target, tmp_path)
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
           "--report", str(tmp_path / "report.json"), "-c", str(t.constraints),
           "-r", str(SCRIPTS / f"requirements-{target}.txt"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT)
    if proc.returncode != 0 and any(e in proc.stderr for e in NETWORK_ERRORS):
        pytest.skip(f"pip could not reach the package index: {proc.stderr.strip().splitlines()[-1]}")
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("WARNING: Location"))
    return proc


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_install_keeps_every_runtime_package_at_the_runtime_version(target, tmp_path, pypi):
    proc = dry_run(target, tmp_path)
    assert proc.returncode == 0, f"pip cannot install requirements-{target}.txt beside the runtime:\n{proc.stderr}"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["environment"]["python_version"].startswith(TARGETS[target].python)
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
    for name, version in read_constraints(SCRIPTS / f"requirements-{target}.txt").items():
        assert got.get(name) == version, f"{name}: requirements-{target}.txt asks for {version}, pip picks {got.get(name)}"
    replaced = {name: got[name] for name in RUNTIME_PACKAGES if name in got}
    assert set(replaced) == REPLACED_ON_PURPOSE[target], f"{target}: pip would replace the runtime's {replaced}"
    assert "pyspark" not in got, f"{target}: something requires pyspark; pip would install a second one"


def test_asking_for_another_version_of_a_runtime_package_is_refused_not_installed(tmp_path, pypi):
    """The check can fail: setup.py's classic pyarrow beside 17.3's runtime makes pip refuse, naming the package."""
    proc = dry_run("dbr-17.3-ml", tmp_path, "pyarrow==14.0.2")
    assert proc.returncode != 0
    assert "pyarrow" in proc.stderr and ("conflict" in proc.stderr or "ResolutionImpossible" in proc.stderr), \
        proc.stderr
