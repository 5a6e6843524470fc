"""Fault injection: real processes, signals and files; nothing hangs, nothing half-written, every run status true."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Tuple

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, cli, free_port, make_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

RANK_MARKER = "horovod.runner.run_task"


def _paths(tmp: Path, table: Path):
    return [f"delta.table={table}", f"data.cache_dir={tmp}/cache", f"train.checkpoint_dir={tmp}/ckpt",
            f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"mlflow.artifact_location={tmp}/artifacts",
            "data.batch_size=16", "train.warmup_epochs=0"]


def _start_train(tmp: Path, table: Path, *extra: str) -> subprocess.Popen:
    log = open(tmp / "train.log", "wb")
    return subprocess.Popen(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *_paths(tmp, table), *extra),
                            stdout=subprocess.PIPE, stderr=log, cwd=tmp, start_new_session=True)


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen = None, tmp: Path = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"training exited ({proc.returncode}) before {what}:\n{_log(tmp)}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}:\n{_log(tmp) if tmp else ''}")


def _log(tmp: Path) -> str:
    path = tmp / "train.log"
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def _ranks_of(proc: subprocess.Popen):
    out = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            argv = child.cmdline()
            if argv and "python" in os.path.basename(argv[0]) and RANK_MARKER in " ".join(argv):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def _run_ckpt(tmp: Path):
    """The run's last.ckpt (checkpoints live in <checkpoint_dir>/<run_id>/), or None before the first."""
    found = sorted((tmp / "ckpt").glob("*/last.ckpt"))
    return found[0] if found else None


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _alive(procs) -> list:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _alive_after(procs, wait_s: float = 2.0) -> list:
    """`_alive(procs)` once none is left or `wait_s` has passed (the bound a sleep of `wait_s` gave them)."""
    deadline = time.monotonic() + wait_s
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(procs)


def _runs(tmp: Path, experiment: str = "lakehouse-local"):
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    versions = client.search_model_versions("name='lakehouse_classifier'")  # [] when none; raises if the query fails
    return client, runs, versions


@pytest.fixture
def table(digits_table, tmp_path) -> Path:
    dst = tmp_path / "table"
    shutil.copytree(digits_table, dst)
    return dst


def test_rank_sigkilled_fails_in_bound_then_resume_continues(table, tmp_path):
    """Faults 1 and 2: a rank SIGKILLed mid-epoch; then `train.ckpt_restore=last` resumes."""
    proc = _start_train(tmp_path, table, "train.max_epochs=30", "train.early_stopping.enabled=false")
    try:
        _wait_for(lambda: _run_ckpt(tmp_path), 400, "the first checkpoint", proc, tmp_path)
        ckpt = _run_ckpt(tmp_path)
        ranks = _ranks_of(proc)
        assert len(ranks) == 2, [r.cmdline() for r in ranks]
        everything = psutil.Process(proc.pid).children(recursive=True)
        killed_rank = ranks[1].environ().get("HOROVOD_RANK")
        t0 = time.monotonic()
        ranks[1].kill()
        proc.wait(timeout=180)
        elapsed = time.monotonic() - t0
    finally:
        _kill_group(proc)
    assert proc.returncode not in (0, None)
    assert elapsed < 120, f"job took {elapsed:.0f} s to exit after a rank died"
    assert f"rank {killed_rank}: ended without reporting an error" in _log(tmp_path)  # the killed rank is named
    assert _alive_after(everything) == [], "processes left behind"
    _, runs, versions = _runs(tmp_path)
    assert [r.info.status for r in runs] == ["FAILED"] and versions == []

    import torch

    saved_epoch = torch.load(ckpt, map_location="cpu", weights_only=False)["epoch"]
    out = subprocess.run(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *_paths(tmp_path, table),
                             f"train.ckpt_restore={ckpt.parent.name}/last", f"train.max_epochs={saved_epoch + 2}",
                             "mlflow.experiment=resumed"),
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["epochs"] == saved_epoch + 2
    client, runs, _ = _runs(tmp_path, "resumed")
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "val_loss")]
    assert steps == [saved_epoch + 1]  # the epoch count continues after the checkpoint's epoch


def test_killed_while_writing_checkpoint_keeps_previous(tmp_path):
    """Fault 3: SIGKILL during a checkpoint write leaves the previous file intact under the final name."""
    script = textwrap.dedent(f"""
        import sys, torch
        from pipeline.distributed.callbacks import AtomicCheckpointIO
        io = AtomicCheckpointIO()
        path = {str(tmp_path / "last.ckpt")!r}
        io.save_checkpoint({{"epoch": 1, "w": torch.ones(4)}}, path)
        print("first", flush=True)
        io.save_checkpoint({{"epoch": 2, "w": torch.randn(150_000_000)}}, path)  # ~600 MB
        print("second", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "first"
        _wait_for(lambda: any(p.name.startswith(".tmp-") and p.stat().st_size > 1_000_000
                              for p in tmp_path.iterdir()), 120, "the second write to start")
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    import torch

    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == 1 and torch.equal(ckpt["w"], torch.ones(4))


def test_truncated_cache_file_is_named(spark, table, tmp_path):
    """Fault 4: a converted Parquet file truncated: a clear error naming it, before any rank reads."""
    from pipeline.data.cache import remove_entry
    from pipeline.data.convert import ConversionError, class_names_of, convert_for_training
    from pipeline.lakehouse.delta import get_engine

    cfg = make_config(tmp_path, f"delta.table={table}")
    df, _ = get_engine("delta-rs").read(spark, str(table))
    data = convert_for_training(spark, df, cfg, 2, class_names_of(df))
    victim = data.train.file_urls[0].replace("file://", "")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as fh:
        fh.truncate(size // 2)
    try:
        with pytest.raises(ConversionError) as err:  # the same pinned table again: a cache hit, then the plan
            convert_for_training(spark, df, cfg, 2, class_names_of(df))
        assert victim in str(err.value) and "unreadable" in str(err.value)
    finally:
        remove_entry(data.entry_url)


def test_append_during_pinned_training_and_retyped_append(spark, digits_dir, table, tmp_path):
    """Faults 6 and 7: rows appended while a training pinned to version 0 runs; a retyped append is refused."""
    from deltalake import DeltaTable

    from pipeline.lakehouse.delta import SchemaMismatchError, get_engine
    from pipeline.lakehouse.sample_data import render_digits

    # new images (another size: other bytes; the table's own files again would be skipped as already in it)
    more = tmp_path / "more_digits"
    render_digits(str(more), size=24, limit=100)
    proc = _start_train(tmp_path, table, "train.max_epochs=2")
    try:
        _wait_for(lambda: "launching" in _log(tmp_path), 400, "the ranks to start", proc, tmp_path)
        out = subprocess.run(cli("ingest", "--conf", str(ROOT / "conf/local.yaml"), "--source", str(more),
                                 f"delta.table={table}"),
                             capture_output=True, text=True, timeout=400, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["delta_version"] == 1
        df, _ = get_engine("delta-rs").read(spark, str(table), 0)
        retyped = df.limit(2).withColumn("width", df.width.cast("string"))
        with pytest.raises(SchemaMismatchError, match="column 'width' is string"):
            get_engine("delta-rs").write(retyped, str(table), "append")
        assert DeltaTable(str(table)).version() == 1
        stdout, _ = proc.communicate(timeout=600)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, _log(tmp_path)
    summary = json.loads(stdout.decode().strip().splitlines()[-1])
    assert summary["delta_version"] == 0 and summary["rows_train"] + summary["rows_val"] == 600
    client, runs, _ = _runs(tmp_path)
    plan = json.load(open(client.download_artifacts(runs[0].info.run_id, "shard_plan.json", str(tmp_path))))
    per_epoch = plan["train"]["steps_per_epoch"] * plan["train"]["batch_size"]
    for rank in (0, 1):
        history = client.get_metric_history(runs[0].info.run_id, f"rows_read_rank_{rank}")
        assert [m.value for m in history] == [per_epoch, per_epoch]


def _val_fraction_for(table: Path, val_rows: int) -> float:
    """A data.val_fraction that puts exactly `val_rows` rows of `table` in the val split.

    The split keys on each row's data.split_key (a fixed fraction gave a different count in every temporary folder
    when it was the absolute path: 0.003 of 600 rows was 0 rows in about one folder in six).
    """
    from deltalake import DeltaTable

    from pipeline.config import Config
    from pipeline.lakehouse.split import SPLIT_BUCKETS, row_key, split_bucket

    rows = DeltaTable(str(table)).to_pyarrow_table(columns=["path", "content"]).to_pylist()
    key = Config().data.split_key
    buckets = sorted(split_bucket(row_key(key, r["path"], r["content"])) for r in rows)
    assert buckets[val_rows - 1] < buckets[val_rows], f"two paths share a bucket at the cut of {val_rows} rows"
    return (buckets[val_rows - 1] + 1) / SPLIT_BUCKETS


def _small_val(table: Path, most: int) -> Tuple[int, float]:
    """(n, fraction) for the first n in 3..most whose cut falls between two buckets (paths can share one)."""
    for n in range(3, most + 1):
        try:
            return n, _val_fraction_for(table, n)
        except AssertionError:
            continue
    raise AssertionError(f"no cut between 3 and {most} val rows falls between two buckets")


def test_more_ranks_than_row_groups_and_empty_table(table, tmp_path):
    """Fault 8: a clear error with the numbers before any rank is handed a job (no MLflow run is even opened; the
    ranks started ahead, train.early_start, are called off)."""
    val_rows, val_fraction = _small_val(table, 7)  # at most 7 val rows: fewer non-empty row groups than 8 ranks
    t0 = time.monotonic()
    out = subprocess.run(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *_paths(tmp_path, table),
                             "train.np=-8", "data.partitions_per_worker=1", f"data.val_fraction={val_fraction}"),
                         capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.returncode == 1 and time.monotonic() - t0 < 300
    assert f"val split: {val_rows} rows" in out.stderr and "8 ranks" in out.stderr and "train.np" in out.stderr
    assert "imported ahead in" not in out.stderr and "training failed" not in out.stderr  # no rank took a job
    assert _runs(tmp_path)[1] == []

    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    empty = tmp_path / "empty"
    write_deltalake(str(empty), pa.schema(DeltaTable(str(table)).schema().to_arrow()).empty_table())
    out = subprocess.run(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *_paths(tmp_path, empty)),
                         capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.returncode == 1 and "no rows" in out.stderr and str(empty) in out.stderr


def test_mlflow_down_at_start_is_bounded(table, tmp_path):
    """Fault 10 (at start): bounded retries, then an error naming the key; no Spark work, nothing registered."""
    port = free_port()
    t0 = time.monotonic()
    out = subprocess.run(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *_paths(tmp_path, table),
                             f"mlflow.tracking_uri=http://127.0.0.1:{port}", "mlflow.retries=2",
                             "mlflow.retry_wait_s=1"),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1 and time.monotonic() - t0 < 120
    assert "mlflow.tracking_uri" in out.stderr and str(port) in out.stderr


def test_sigterm_to_driver_checkpoints_and_ends_killed(table, tmp_path):
    """Fault 11: SIGTERM: the ranks stop together, rank 0 writes a last checkpoint, the run ends KILLED."""
    proc = _start_train(tmp_path, table, "train.max_epochs=30", "train.early_stopping.enabled=false")
    try:
        _wait_for(lambda: _run_ckpt(tmp_path), 400, "the first checkpoint", proc, tmp_path)
        ckpt = _run_ckpt(tmp_path)
        first_mtime = ckpt.stat().st_mtime
        everything = psutil.Process(proc.pid).children(recursive=True)
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        _kill_group(proc)
    assert proc.returncode == 143, _log(tmp_path)
    assert elapsed < 90
    assert "SIGTERM" in _log(tmp_path)
    assert ckpt.stat().st_mtime > first_mtime  # a last checkpoint at the signal
    import torch

    assert "state_dict" in torch.load(ckpt, map_location="cpu", weights_only=False)
    assert _alive_after(everything) == []
    _, runs, versions = _runs(tmp_path)
    assert [r.info.status for r in runs] == ["KILLED"] and versions == []


def test_mlflow_down_mid_run_is_bounded_kept_offline_and_registers_nothing(table, tmp_path):
    """Fault 10 (mid-run, never back while the job runs): training goes on, the job waits mlflow.reconnect_wait_s at
    its end, then exits 3 within a bound with the run left in its offline folder; once the server is back on the same
    store no model version exists (sync-run registers later: test_tracking_outage.py); the run the job could not end
    is recorded in mlflow.unended_runs and the next connection ends it FINISHED (its true status) at the time the
    job ended."""
    from conftest import start_mlflow_server, stop_mlflow_server
    from pipeline.config import load_config
    from pipeline.tracking.runs import configure

    root = tmp_path / "server"
    root.mkdir()
    server, uri = start_mlflow_server(root)
    port = uri.rsplit(":", 1)[1]
    journal = tmp_path / "unended.jsonl"
    mlflow_keys = [f"mlflow.tracking_uri={uri}", "mlflow.artifact_location=null", "mlflow.retries=2",
                   "mlflow.retry_wait_s=1", "mlflow.reconnect_wait_s=5", f"mlflow.unended_runs={journal}"]
    proc = _start_train(tmp_path, table, *mlflow_keys, "train.max_epochs=4", "train.early_stopping.enabled=false")
    try:
        _wait_for(lambda: "epoch 0:" in _log(tmp_path), 400, "the first epoch", proc, tmp_path)
        stop_mlflow_server(server)
        t0 = time.monotonic()
        proc.wait(timeout=400)
        elapsed = time.monotonic() - t0
    finally:
        _kill_group(proc)
        stop_mlflow_server(server)
    assert proc.returncode == 3, _log(tmp_path)  # trained; the run is in its offline folder
    assert elapsed < 300, f"{elapsed:.0f} s after the server went down"
    assert list(tmp_path.rglob("offline_run/run.json")), "no offline run folder left by the job"
    server, uri = start_mlflow_server(root, int(port))
    try:
        client = MlflowClient(uri)
        assert client.search_model_versions("name='lakehouse_classifier'") == []
        runs = client.search_runs([client.get_experiment_by_name("lakehouse-local").experiment_id])
        assert len(runs) == 1 and runs[0].info.status == "RUNNING"  # the server was down when the job ended it
        recorded = [json.loads(line) for line in journal.read_text().splitlines()]
        assert [(e["run_id"], e["status"], e["tracking_uri"]) for e in recorded] == [(runs[0].info.run_id, "FINISHED", uri)]
        import mlflow

        previous_uri = mlflow.get_tracking_uri()
        try:
            configure(load_config(str(ROOT / "conf/local.yaml"), mlflow_keys).mlflow)  # what the next job does first
        finally:
            mlflow.set_tracking_uri(previous_uri)
        run = client.get_run(runs[0].info.run_id)
        assert run.info.status == "FINISHED" and run.info.end_time == recorded[0]["end_time_ms"]
        assert not journal.exists()
    finally:
        stop_mlflow_server(server)


def test_a_stuck_ddp_rank_fails_the_job_within_the_stall_timeout(table, tmp_path):
    """A rank that stays alive but stops answering (a deadlock, a hung kernel) must not hold the job for torch's
    30-minute default: the other rank's collective times out after train.stall_timeout_s, the job fails with the
    rank named, the run ends FAILED and no process is left behind. (25 s: the ranks met in torch.distributed's
    set-up ~2 s apart on a quiet machine, and that set-up is bounded by it too: a loaded one spreads them further.)"""
    stall = 25
    proc = _start_train(tmp_path, table, "train.backend=ddp", "train.max_epochs=3",
                        "debug.fail_at_step=3", "debug.fail_rank=1", "debug.fail_with=hang",
                        f"train.stall_timeout_s={stall}")
    try:
        _wait_for(lambda: "imported ahead in" in _log(tmp_path), 400, "the ranks", proc, tmp_path)
        everything = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()  # the rank gets stuck a few steps later
        proc.wait(timeout=stall + 180)
        elapsed = time.monotonic() - t0
    finally:
        _kill_group(proc)
    log = _log(tmp_path)
    assert proc.returncode not in (0, None), log
    assert elapsed < stall + 120, f"the job took {elapsed:.0f} s to fail after its ranks started:\n{log}"
    assert "rank 0: RuntimeError" in log and f"train.stall_timeout_s={stall} s" in log, log
    assert _alive_after(everything) == [], "processes left behind"
    _, runs, versions = _runs(tmp_path)
    assert [r.info.status for r in runs] == ["FAILED"] and versions == []


def test_a_stuck_horovod_rank_is_ended_by_the_driver_within_the_stall_timeout(tmp_path):
    """Horovod's own stall shutdown does not fire on a gloo CPU build (nothing within 75 s, measured), so the driver
    watches the ranks' progress markers (pipeline/distributed/progress.py): a real 2-rank horovod.run whose rank 1
    hangs after its first collective, rank 0 waiting in the next one, ends within train.stall_timeout_s of their last
    progress, the failure naming the bound and both ranks; no rank left, and the driver's SIGINT/SIGTERM handlers are
    as they were. (The rank function stands in for the training loop's progress marks.)"""
    pytest.importorskip("horovod.torch")
    import horovod

    from pipeline.config import load_config
    from pipeline.distributed import launcher
    from pipeline.distributed.backends.horovod import _signals_left_to_the_driver, gloo_checked_by_the_ranks
    from pipeline.distributed.loop import TrainJob
    from pipeline.distributed.rank_failures import DistributedTrainingError
    from pipeline.distributed.rank_signals import rank_processes

    stall = 5

    def rank_fn(job_dir):  # pickled by value (a closure): the ranks need not import this test module
        import time as _time

        import horovod.torch as hvd
        import torch

        from pipeline.distributed.job_folder import JobFolder
        from pipeline.distributed.rank_process import repair_horovod_env

        repair_horovod_env()
        hvd.init()
        folder = JobFolder(job_dir)
        hvd.allreduce(torch.ones(1), name="first")
        folder.write(hvd.rank(), "progress", "1")
        if hvd.rank() == 1:
            _time.sleep(300)  # stuck: alive, never reaching the next collective
        hvd.allreduce(torch.ones(1), name="second")
        return hvd.rank()

    def launch_ranks(job):
        assert job.heartbeat_s  # the driver watches this launch
        with _signals_left_to_the_driver(), gloo_checked_by_the_ranks():
            return horovod.run(rank_fn, args=(job.job_dir,), num_proc=2, use_gloo=True, hosts="localhost:2",
                               verbose=0, start_timeout=60)

    cfg = load_config(str(ROOT / "conf/local.yaml"), ["train.np=-2", "train.backend=horovod",
                                                      f"train.stall_timeout_s={stall}"])
    job = TrainJob(cfg=cfg, data=None, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"))
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    original, launcher._launch = launcher._launch, launch_ranks
    try:
        t0 = time.monotonic()
        with pytest.raises(DistributedTrainingError) as info:
            launcher.launch(job)
        elapsed = time.monotonic() - t0
    finally:
        launcher._launch = original
    text = str(info.value)
    assert f"train.stall_timeout_s={stall} s" in text and "rank 0 (last at step 1" in text, text
    assert "rank 1 (last at step 1" in text, text
    assert elapsed < 55, f"the stuck launch took {elapsed:.0f} s to end"
    assert rank_processes() == []  # no rank left behind
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
