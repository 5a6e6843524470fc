"""Shared test fixtures: one local[2] Spark session, a rendered digits folder and its Delta table, config factories."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("LAKEHOUSE_PROGRESS", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: real Spark / Delta / Petastorm / Horovod / MLflow (slower)")
    config.addinivalue_line("markers", "slow: multi-process training or a cluster; minutes")


# `make test`'s lanes (scripts/test_tiers.sh): sessions of tests that assert no tight timing, run beside the other
# tiers and beside each other. Given the same LAKEHOUSE_LANE_CLAIMS folder, they share their tests file by file: a
# session runs a file's tests only if it claims the file first (a file made with O_EXCL), so each file runs in one of
# them and a session that is free takes the next file no one has. Each test a session ended is written into
# LAKEHOUSE_LANE_RECORD ("ran", "failed" or "skipped", a tab, the node id); the next session, given that record as
# LAKEHOUSE_LANE_DONE, leaves out those that ran (a skipped one runs again there), so every test runs once.
_lane_failed: set = set()
_lane_skipped: set = set()


def pytest_runtest_logreport(report):
    if report.failed:
        _lane_failed.add(report.nodeid)
    elif report.skipped:
        _lane_skipped.add(report.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    record = os.environ.get("LAKEHOUSE_LANE_RECORD")
    if record:
        with open(record, "a") as f:  # one short line per write (O_APPEND): the lanes' lines never interleave
            outcome = ("failed" if item.nodeid in _lane_failed else
                       "skipped" if item.nodeid in _lane_skipped else "ran")
            f.write(f"{outcome}\t{item.nodeid}\n")


def _claim(folder: str, test_file: str) -> bool:
    """True if this session is the first to claim `test_file` (a node id's file part) in `folder`."""
    import hashlib

    name = hashlib.sha256(test_file.encode()).hexdigest()[:32]
    try:
        fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\t{test_file}\n")
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """With LAKEHOUSE_LANE_CLAIMS: pytest's own loop over the tests of the files this session claims (see above)."""
    claims = os.environ.get("LAKEHOUSE_LANE_CLAIMS")
    if not claims or session.config.option.collectonly:
        return None  # pytest's own loop
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    os.makedirs(claims, exist_ok=True)
    items, owned = session.items, {}

    def next_mine(start: int):
        """The index of the first test from `start` on whose file this session holds or claims now; None: none."""
        for i in range(start, len(items)):
            test_file = items[i].nodeid.split("::", 1)[0]
            if test_file not in owned:
                owned[test_file] = _claim(claims, test_file)
            if owned[test_file]:
                return i
        return None

    i = next_mine(0)
    while i is not None:
        # the teardown after a file's last test needs only to know that the next test is in another file: the next
        # in the list stands for it, unclaimed, so the next file is claimed once this session is free to run it
        nextitem = items[i + 1] if i + 1 < len(items) else None
        items[i].config.hook.pytest_runtest_protocol(item=items[i], nextitem=nextitem)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        i = next_mine(i + 1)
    return True


def pytest_collection_modifyitems(config, items):
    done_file = os.environ.get("LAKEHOUSE_LANE_DONE")
    if not done_file or not os.path.exists(done_file):
        return
    with open(done_file) as f:
        # a test the lane skipped (a network it could not reach while the set-ups downloaded) is given another chance
        done = {line.rstrip("\n").split("\t", 1)[1] for line in f if "\t" in line and not line.startswith("skipped")}
    left = [item for item in items if item.nodeid not in done]
    if len(left) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = left


def require_reader(reader: str) -> None:
    """Skip (with the reason) a test of a reader this install profile lacks: the modern profile has no Petastorm."""
    import importlib.util

    if reader == "petastorm" and importlib.util.find_spec("petastorm") is None:
        pytest.skip("data.reader=petastorm: Petastorm is not installed in this profile (modern)")


def available_readers() -> List[str]:
    import importlib.util

    return ["petastorm", "arrow"] if importlib.util.find_spec("petastorm") else ["arrow"]


def make_config(tmp: Path, *overrides: str, profile: str = "conf/local.yaml"):
    """The local profile with every path under `tmp`, plus overrides (data.reader=arrow where Petastorm is absent).

    The batch stays as configured on the tests' small tables (`data.min_steps_per_epoch=0`): these tests check the
    mechanics at a known batch and step count; the small-table rule has its own tests (test_small_table.py)."""
    from pipeline.config import load_config

    base = [
        "data.min_steps_per_epoch=0",
        f"delta.table={tmp}/delta/digits",
        f"data.cache_dir={tmp}/data_cache",
        f"train.checkpoint_dir={tmp}/checkpoints",
        f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
        f"mlflow.artifact_location={tmp}/mlartifacts",
    ]
    if available_readers() == ["arrow"]:
        base.append("data.reader=arrow")
    return load_config(str(ROOT / profile), base + list(overrides))


def restart_config(tmp_path: Path, name: str, table, *extra: str):
    """A 2-rank arrow job that checkpoints every 2 steps, under `tmp_path/name` with a cache shared by the test's
    jobs: what the restart tests relaunch from."""
    return make_config(tmp_path / name, f"delta.table={table}", "data.reader=arrow", "data.batch_size=16",
                       "train.np=-2", "train.max_epochs=2", "train.warmup_epochs=0",
                       f"data.cache_dir={tmp_path}/cache", "train.checkpoint_every_n_steps=2", *extra)


@pytest.fixture(autouse=True)
def _sys_path_kept():
    """A test that loads a model with mlflow.pyfunc.load_model gets the model's code folder (a partial copy of
    `pipeline`) put first on sys.path for good; later tests that spawn processes would import that copy. Each test
    leaves sys.path as it found it."""
    path = list(sys.path)
    yield
    sys.path[:] = path


@pytest.fixture(scope="session")
def spark():
    from pipeline.config import load_config
    from pipeline.lakehouse.spark import get_spark

    session = get_spark(load_config(str(ROOT / "conf/local.yaml"), ["spark.app_name=lakehouse-tests"]))
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    from pipeline.lakehouse.sample_data import render_digits

    out = tmp_path_factory.mktemp("digits")
    render_digits(str(out), limit=600)
    return out


@pytest.fixture(scope="session")
def digits_table(spark, digits_dir, tmp_path_factory) -> Path:
    """A Delta table (version 0) of the 600 rendered digits, shared read-only by the tests."""
    from pipeline.lakehouse.ingest import ingest_folder

    tmp = tmp_path_factory.mktemp("shared_table")
    cfg = make_config(tmp)
    ingest_folder(spark, cfg, str(digits_dir), mode="overwrite")
    return tmp / "delta" / "digits"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: List[str], health_url: str, log_path: Path, what: str, timeout_s: float = 90, env=None,
                 cwd=None) -> subprocess.Popen:
    """Start `cmd` in its own process group (output to `log_path`); wait until `health_url` answers 200.

    Fails the test (with the log's tail) if the process exits or is not healthy within `timeout_s`; then it is
    stopped by its process group (`stop_mlflow_server`)."""
    with open(log_path, "ab") as log_fh:
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, cwd=cwd or log_path.parent,
                                env=env or os.environ, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(health_url, timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_mlflow_server(proc)
            pytest.fail(f"{what} not healthy after {timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def start_mlflow_server(root: Path, port: int = None):
    """A real `mlflow server` on 127.0.0.1 (free port unless given), proxying artifacts; returns (proc, uri)."""
    port = port or free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner: not needed, heavy
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{root}/server.db", "--artifacts-destination", str(root / "artifacts"),
           "--workers", "1"]
    uri = f"http://127.0.0.1:{port}"
    return start_server(cmd, f"{uri}/health", root / "server.log", "mlflow server", 90, env=env, cwd=root), uri


def stop_mlflow_server(proc) -> None:
    """Stop the server and its workers: the process group it was started in."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    proc, uri = start_mlflow_server(tmp_path_factory.mktemp("mlflow_server"))
    try:
        yield uri
    finally:
        stop_mlflow_server(proc)


def cli(*args: str) -> List[str]:
    """`lakehouse ARGS` in the venv running the tests (`python -m pipeline.cli` is the console script's own code), so
    that the modern and dbr-15.4 data-path tiers run their own profile's CLI, not the classic venv's. The child finds
    `pipeline` through the venv's editable install of this checkout (`make test`'s venvs), or PYTHONPATH where set: a
    venv installed from another checkout needs PYTHONPATH=<this checkout>."""
    return [sys.executable, "-m", "pipeline.cli", *args]


def pytest_unconfigure(config):
    """Petastorm deletes leftover converter caches in atexit handlers, after pytest has put back the warning filters
    it found at start; those handlers run last-registered-first, so this one, registered last, re-installs the
    project's filters before them (otherwise pyarrow.localfs's FutureWarning is printed after the summary)."""
    import atexit

    from pipeline.log import quiet_third_party_warnings

    atexit.register(quiet_third_party_warnings)
