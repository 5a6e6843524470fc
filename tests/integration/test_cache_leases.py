"""Cache entries in use are leased: another job's size bound and `lakehouse cache clear` keep an entry a live job
holds (naming the holder), proceed once it ends, and are not blocked by a dead job's lease. Real Spark local[2], the
shared Delta table (delta-rs), real conversions, the real `lakehouse` command and real processes."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, cli, make_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _convert(spark, cfg, table, leases=None):
    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.lakehouse.delta import get_engine

    df, pinned = get_engine("delta-rs").read(spark, str(table))
    return convert_for_training(spark, df, cfg, 2, class_names_of(df), pinned, leases=leases)


def _read_whole(data):
    """Every rank reads its whole shard of both splits with the arrow reader, as the plan says."""
    from pipeline.data.loader import ShardLoader

    for split in ("train", "val"):
        plan = getattr(data.plan, split)
        ids = []
        for rank in range(2):
            loader = ShardLoader(getattr(data, split), plan, rank=rank, world_size=2, channels=data.channels,
                                 image_size=data.image_size, endless=False, workers=1, shuffle_buffer=0, seed=1,
                                 reader="arrow", track_ids=True)
            list(loader)
            loader.check_rows()  # the rows this rank read are the plan's
            ids += loader.ids_read
        assert len(set(ids)) == plan.total_rows == getattr(data, split).rows


def _lakehouse(*args, cache_dir):
    conf = ["--conf", str(ROOT / "conf/local.yaml"), f"data.cache_dir={cache_dir}"]
    out = subprocess.run(cli("cache", *args, *conf), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_held_entry_outlives_another_jobs_bound_and_cache_clear(spark, digits_table, tmp_path):
    from pipeline.data import cache
    from pipeline.data.leases import JobLeases, read_holders, this_host

    host, _ = this_host()
    tight = "data.cache_max_gb=0.000001"  # smaller than any entry: every conversion evicts all it may
    cfg_a = make_config(tmp_path, f"delta.table={digits_table}", tight)
    cfg_b = make_config(tmp_path, f"delta.table={digits_table}", tight, "data.image_size=16")
    cache_dir = cfg_a.data.cache_dir
    fs, root = cache.filesystem(cache_dir)

    job_a = JobLeases("train job-a")
    a = _convert(spark, cfg_a, digits_table, leases=job_a)  # job A converts its entry and holds it while it trains
    b = _convert(spark, cfg_b, digits_table)  # another job: its conversion pushes the cache over the bound
    assert a.key != b.key
    assert {e["key"] for e in cache.list_entries(cache_dir)} == {a.key, b.key}  # A, least recently used, kept
    _read_whole(a)

    # a job on this host that took a lease on B and was killed before releasing it
    code = ("import os, signal, pyarrow.fs as f; from pipeline.data.leases import JobLeases\n"
            f"JobLeases('train killed').take(f.LocalFileSystem(), {root!r}, {b.key!r})\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.Popen([sys.executable, "-c", code])
    assert killed.wait(timeout=120) == -signal.SIGKILL
    [stale] = read_holders(fs, root)[b.key]
    assert (stale.job, stale.pid, stale.host) == ("train killed", killed.pid, host)

    listed, _ = _lakehouse("ls", cache_dir=cache_dir)
    held = {e["key"]: e["held_by"] for e in listed["entries"]}
    assert held[b.key] == [] and [(h["job"], h["pid"], h["host"]) for h in held[a.key]] == \
        [("train job-a", os.getpid(), host)]

    out, err = _lakehouse("clear", cache_dir=cache_dir)
    assert out["cleared"] == [b.key]  # the dead job's lease did not block
    assert [k["key"] for k in out["kept"]] == [a.key]
    assert [(h["job"], h["pid"], h["host"]) for h in out["kept"][0]["held_by"]] == [("train job-a", os.getpid(), host)]
    assert f"kept cache entry {a.key}: in use by job 'train job-a' (pid {os.getpid()} on host {host}" in err
    assert not os.path.exists(stale.file)
    _read_whole(a)  # still whole after the clear

    job_a.release()  # job A's training ended
    again = _convert(spark, cfg_b, digits_table)  # the next conversion's bound now evicts A
    assert [e["key"] for e in cache.list_entries(cache_dir)] == [again.key]
    assert cache.read_manifest(a.entry_url) is None
    out, _ = _lakehouse("clear", cache_dir=cache_dir)
    assert out == {"cache_dir": cache_dir, "cleared": [again.key], "kept": []}
    assert cache.list_entries(cache_dir) == []


def test_a_sweep_keeps_every_entry_it_converted(spark, digits_table, tmp_path):
    """`lakehouse tune` searching data.image_size: the sweep holds each size's entry until it ends, so trial k+1's
    conversion under a tight bound leaves trial k's entry for the later trials that reuse it."""
    from pipeline.data import cache
    from pipeline.data.leases import JobLeases

    tight = "data.cache_max_gb=0.000001"
    cfg = make_config(tmp_path, f"delta.table={digits_table}", tight)
    with JobLeases("tune study sizes") as sweep:
        first = _convert(spark, cfg, digits_table, sweep)
        second = _convert(spark, make_config(tmp_path, f"delta.table={digits_table}", tight, "data.image_size=16"),
                          digits_table, sweep)
        assert sorted(sweep.keys) == sorted([first.key, second.key])
        _read_whole(first)  # a later trial with the first size reads it whole
        assert {e["key"] for e in cache.list_entries(cfg.data.cache_dir)} == {first.key, second.key}
    assert all(e["held_by"] == [] for e in cache.list_entries(cfg.data.cache_dir))  # released when the sweep ends


def test_train_holds_its_entry_while_the_ranks_run_and_releases_it(spark, digits_table, tmp_path, monkeypatch):
    """`workflow.train` (one process, one epoch): while its ranks run, its entry is leased by this pid and a `cache
    clear` beside it keeps the entry; when the job ends the lease is gone."""
    from pipeline import workflow
    from pipeline.data import cache

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "data.batch_size=16", "train.max_epochs=1",
                      "train.warmup_epochs=0", "train.backend=single", "train.np=1", "train.threads_per_rank=1",
                      "mlflow.promote=false")
    real, seen = workflow.launch_with_restarts, {}

    def launch(job, **kw):
        seen["held"] = {e["key"]: e["held_by"] for e in cache.list_entries(cfg.data.cache_dir)}
        seen["clear"] = cache.clear(cfg.data.cache_dir)  # beside the running job, from this process
        return real(job, **kw)

    monkeypatch.setattr(workflow, "launch_with_restarts", launch)  # the name workflow.train_in_run calls
    summary = workflow.train(spark, cfg)
    assert summary["epochs"] == 1 and summary["rows_train"] + summary["rows_val"] == 600
    [(key, held_by)] = seen["held"].items()
    assert [(h["job"], h["pid"]) for h in held_by] == [("train", os.getpid())]
    assert seen["clear"]["cleared"] == [] and [k["key"] for k in seen["clear"]["kept"]] == [key]
    [entry] = cache.list_entries(cfg.data.cache_dir)
    assert entry["key"] == key and entry["held_by"] == []  # kept for the next job, released
    assert cache.clear(cfg.data.cache_dir) == {"cleared": [key], "kept": []}


def _files(folder) -> dict:
    """Every file under `folder` with its bytes."""
    from pathlib import Path

    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cache_clear_in_a_shared_folder_deletes_only_the_caches_entries(spark, digits_table, tmp_path):
    """`data.cache_dir` pointed at a folder that also holds a Delta table and checkpoints (issue 37, defect 5): a real
    conversion's entry is listed and cleared; the table and the checkpoint folder are neither listed nor deleted, they
    survive byte for byte, and `cache clear --key <one of them>` is refused naming the folder."""
    import deltalake
    import pyarrow as pa

    from pipeline.data import cache

    shared = tmp_path / "shared"
    cfg = make_config(tmp_path, f"delta.table={digits_table}", f"data.cache_dir={shared}")
    deltalake.write_deltalake(str(shared / "scores"), pa.table({"path": ["a.png", "b.png"], "label": [0, 1]}))
    deltalake.write_deltalake(str(shared / "scores"), pa.table({"path": ["c.png"], "label": [2]}), mode="append")
    (shared / "ckpt").mkdir()
    (shared / "ckpt" / "best.ckpt").write_bytes(os.urandom(4096))
    before = {name: _files(shared / name) for name in ("scores", "ckpt")}

    data = _convert(spark, cfg, digits_table)
    other = _convert(spark, make_config(tmp_path, f"delta.table={digits_table}", f"data.cache_dir={shared}",
                                        "data.image_size=16"), digits_table)
    out, _ = _lakehouse("clear", "--key", other.key, cache_dir=str(shared))
    assert out["cleared"] == [other.key]
    out, _ = _lakehouse("clear", cache_dir=str(shared))
    assert {name: _files(shared / name) for name in before} == before  # neither the table nor the checkpoint went
    assert out["cleared"] == [data.key] and out["kept"] == []
    assert not (shared / data.key).exists() and not (shared / other.key).exists()
    assert deltalake.DeltaTable(str(shared / "scores")).to_pyarrow_table().num_rows == 3

    data = _convert(spark, cfg, digits_table)  # converted again: the cache marked its entry before writing it
    assert json.loads((shared / data.key / cache.MARKER).read_text())["key"] == data.key
    listed, _ = _lakehouse("ls", cache_dir=str(shared))
    assert [e["key"] for e in listed["entries"]] == [data.key]
    conf = ["--conf", str(ROOT / "conf/local.yaml"), f"data.cache_dir={shared}"]
    for name in before:
        out = subprocess.run(cli("cache", "clear", "--key", name, *conf), capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and f"{shared}/{name} is not a converted-data cache entry" in out.stderr, \
            out.stderr[-2000:]
    assert {name: _files(shared / name) for name in before} == before
    assert [e["key"] for e in cache.list_entries(str(shared))] == [data.key]
