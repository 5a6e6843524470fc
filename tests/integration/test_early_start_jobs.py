"""Ranks started early (`train.early_start`) in real jobs: on both backends and both sources, the local ranks start
while the driver pins, plans (or converts) and opens the run, then take the job from the hand-off folder and train to
a registered version; a job whose preparation fails calls them off: it ends with the preparation's error, and leaves
neither a rank process nor its hand-off folder behind."""
import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

RANK_MARKERS = ("horovod.runner.run_task", "torch.distributed.run", "torchrun")


def _run(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp / "tmp"), "LAKEHOUSE_PROGRESS": "0"}
    (tmp / "tmp").mkdir(exist_ok=True)
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env)


def _ok(out: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert out.returncode == 0, f"lakehouse {what} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def _rank_processes_since(t0: float, tmp: Path) -> list:
    """This job's rank processes started since t0. Ranks inherit the job's TMPDIR (`_run`), which is this test's own:
    another test's ranks started beside it (`make test` runs other tiers beside this one) are not counted."""
    found = []
    since = t0 - 1.0  # psutil's create_time counts from a boot time in whole seconds: it can read up to 1 s early
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        argv = " ".join(proc.info["cmdline"] or [])
        started = proc.info["create_time"]
        if not (started and started >= since and any(m in argv for m in RANK_MARKERS)):
            continue
        try:
            ours = proc.environ().get("TMPDIR") == str(tmp / "tmp")
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):  # ended meanwhile, or another user's
            continue
        if ours:
            found.append((proc.pid, argv[:200]))
    return found


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("early_start")
    paths = [f"delta.table={tmp}/delta/digits", f"data.cache_dir={tmp}/cache", f"train.checkpoint_dir={tmp}/ckpt",
             f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"mlflow.artifact_location={tmp}/artifacts",
             "mlflow.experiment=early", "train.max_epochs=1", "train.np=-2", "mlflow.gate_min_lift=null"]
    conf = ["--conf", str(ROOT / "conf/local.yaml"), *paths]
    _ok(_run(tmp, "sample-data", "--out", str(tmp / "images"), "--limit", "200"), "sample-data")
    _ok(_run(tmp, "ingest", "--source", str(tmp / "images"), "--mode", "overwrite", *conf), "ingest")
    return tmp, conf


@pytest.mark.parametrize("backend,source", [("horovod", "direct"), ("ddp", "converted")])
def test_the_ranks_start_ahead_and_take_the_job_from_the_driver(digits, backend, source):
    tmp, conf = digits
    extra = ["data.decode=cpu", "data.decode_workers=1"] if source == "direct" else []
    out = _ok(_run(tmp, "train", *conf, f"train.backend={backend}", f"data.source={source}", *extra,
                   f"mlflow.registered_model=early-{backend}-{source}"), "train")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["model_version"] == 1 and summary["world_size"] == 2 and summary["data_source"] == source
    logs = out.stdout + out.stderr
    assert "start ahead; they import while the driver prepares the job" in logs
    # each rank took its job from the hand-off, after importing ahead
    taken = [line for line in logs.splitlines() if "imported ahead in" in line and "waited" in line]
    assert len(taken) == 2, logs[-4000:]
    assert not list((tmp / "tmp").glob("lakehouse-start-*"))  # the hand-off folder (and the signed job) removed


def test_the_same_job_without_early_start_trains_as_before(digits):
    tmp, conf = digits
    out = _ok(_run(tmp, "train", *conf, "train.backend=horovod", "data.source=direct", "data.decode=cpu",
                   "data.decode_workers=1", "train.early_start=false", "mlflow.registered_model=early-off"), "train")
    assert json.loads(out.stdout.strip().splitlines()[-1])["model_version"] == 1
    assert "imported ahead in" not in out.stdout + out.stderr


@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_a_job_whose_preparation_fails_calls_the_early_ranks_off(digits, backend):
    tmp, conf = digits
    t0 = time.time()
    out = _run(tmp, "train", *conf, f"train.backend={backend}", "data.source=direct", "data.decode=cpu",
               "delta.version=99", "mlflow.registered_model=early-fails", timeout=300)
    took = time.time() - t0
    assert out.returncode != 0
    assert "99" in out.stderr and "version" in out.stderr.lower(), out.stderr[-3000:]
    if "Killed" in out.stdout + out.stderr:  # ranks still importing were killed: said, not left to read as an OOM kill
        assert "'Killed' / 'exit status 137' lines are that stop" in out.stderr, out.stderr[-3000:]
    assert took < 120, f"the failed job took {took:.0f} s"
    deadline = time.time() + 15  # a rank still importing when called off leaves once its imports are done
    while _rank_processes_since(t0, tmp) and time.time() < deadline:
        time.sleep(0.5)
    assert _rank_processes_since(t0, tmp) == []
    assert not list((tmp / "tmp").glob("lakehouse-start-*"))
