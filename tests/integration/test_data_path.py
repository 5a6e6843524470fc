"""The data path on either install profile: content-keyed cache, both readers on one plan, exact mid-epoch resume,
what the ranks import. Real Spark local[2], a real Delta table (delta-rs), real Horovod ranks over gloo."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, available_readers, cli, make_config, require_reader

pytestmark = [pytest.mark.integration, pytest.mark.datapath, pytest.mark.timeout(900)]


def _read(spark, table):
    from pipeline.lakehouse.delta import get_engine

    return get_engine("delta-rs").read(spark, str(table))


def _convert(spark, cfg, table, world=2):
    from pipeline.data.convert import class_names_of, convert_for_training

    df, pinned = _read(spark, table)
    return convert_for_training(spark, df, cfg, world, class_names_of(df), pinned)


def test_second_job_reuses_the_cache_and_cache_command(spark, digits_table, tmp_path):
    """A second conversion of the same pinned version is a cache hit (no Spark write); `lakehouse cache ls|clear`
    see and free it; the size bound evicts the least recently used entry, never the one in use."""
    from pipeline.data import cache

    cfg = make_config(tmp_path, f"delta.table={digits_table}")
    first = _convert(spark, cfg, digits_table)
    manifest = cache.read_manifest(first.entry_url)
    again = _convert(spark, cfg, digits_table)
    assert again.key == first.key and again.train.file_urls == first.train.file_urls
    assert cache.read_manifest(first.entry_url)["created"] == manifest["created"]  # not converted again
    other = _convert(spark, make_config(tmp_path, f"delta.table={digits_table}", "data.image_size=16"), digits_table)
    assert other.key != first.key

    conf = ["--conf", str(ROOT / "conf/local.yaml"), f"data.cache_dir={cfg.data.cache_dir}"]
    out = subprocess.run(cli("cache", "ls", *conf), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    listed = json.loads(out.stdout.strip().splitlines()[-1])
    assert {e["key"] for e in listed["entries"]} == {first.key, other.key}
    assert all(e["bytes"] > 0 and e["complete"] for e in listed["entries"])
    assert listed["entries"][0]["key"] == other.key  # most recently used first

    # a bound smaller than both entries: the least recently used goes, the one in use stays
    assert cache.enforce_bound(cfg.data.cache_dir, 1e-6, keep=first.key) == [other.key]
    out = subprocess.run(cli("cache", "clear", "--key", first.key, *conf), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["cleared"] == [first.key]
    assert cache.list_entries(cfg.data.cache_dir) == []
    out = subprocess.run(cli("cache", "clear", "--key", "nope", *conf), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "nope" in out.stderr


def test_entry_of_another_format_is_rebuilt_not_misread(spark, digits_table, tmp_path):
    from pipeline.data import cache

    cfg = make_config(tmp_path, f"delta.table={digits_table}")
    first = _convert(spark, cfg, digits_table)
    manifest = cache.read_manifest(first.entry_url)
    manifest["format"], manifest["columns"] = 1, ["pixels", "label_index"]  # as another profile/version wrote it
    cache.write_manifest(first.entry_url, manifest)
    again = _convert(spark, cfg, digits_table)
    rebuilt = cache.read_manifest(again.entry_url)
    assert rebuilt["format"] != 1 and rebuilt["created"] > manifest["created"]
    assert again.plan.train.total_rows == first.plan.train.total_rows


def _one_pass_ids(data, reader, rank, split="val"):
    from pipeline.data.loader import ShardLoader

    s = getattr(data, split)
    plan = getattr(data.plan, split)
    loader = ShardLoader(s, plan, rank=rank, world_size=2, channels=data.channels, image_size=data.image_size,
                         endless=False, workers=1, shuffle_buffer=0, seed=1, reader=reader, track_ids=True)
    batches = list(loader)
    loader.check_rows()
    return loader.ids_read, batches


def test_both_readers_read_the_same_shards(spark, digits_table, tmp_path):
    """Switching data.reader changes nothing else: per rank the same rows (ids), labels and pixels; the plan's
    row-group order is the one Petastorm's reader uses."""
    import torch

    from pipeline.data.readers import shard_row_ids

    cfg = make_config(tmp_path, f"delta.table={digits_table}")
    data = _convert(spark, cfg, digits_table)
    readers = available_readers()
    if "petastorm" in readers:
        from pipeline.data.convert import petastorm_row_group_rows

        assert petastorm_row_group_rows(data.train) == data.train.row_group_rows
    for split in ("train", "val"):
        for rank in range(2):
            expected = shard_row_ids(getattr(data, split), rank, 2)
            seen = {}
            for reader in readers:
                ids, batches = _one_pass_ids(data, reader, rank, split)
                assert sorted(ids) == sorted(expected), (reader, split, rank)
                order = sorted(range(len(ids)), key=lambda i: ids[i])
                x = torch.cat([b[0] for b in batches])[order]
                y = torch.cat([b[1] for b in batches])[order]
                seen[reader] = (x, y)
            if len(seen) == 2:
                assert torch.equal(seen["petastorm"][0], seen["arrow"][0])
                assert torch.equal(seen["petastorm"][1], seen["arrow"][1])
        assert len(set(shard_row_ids(getattr(data, split), 0, 2)) & set(shard_row_ids(getattr(data, split), 1, 2))) == 0


@pytest.mark.parametrize("reader", ["petastorm", "arrow"])
def test_two_rank_horovod_train_registers_with_each_reader(spark, digits_table, tmp_path, reader):
    """The 2-rank Horovod job end to end (pinned read, plan, convert, read, train, register) with each reader:
    the same rows per rank per epoch, equal weights across ranks."""
    from mlflow.tracking import MlflowClient

    from pipeline import workflow

    require_reader(reader)
    cfg = make_config(tmp_path, f"delta.table={digits_table}", f"data.reader={reader}", "data.batch_size=16",
                      "train.np=-2", "train.max_epochs=2", "train.warmup_epochs=0")
    summary = workflow.train(spark, cfg)
    assert summary["world_size"] == 2 and summary["model_version"] == 1 and summary["epochs"] == 2
    client = MlflowClient(summary["tracking_uri"])
    hist = client.get_metric_history(summary["run_id"], "rows_read_rank_1")
    plan = _convert(spark, cfg, digits_table).plan  # a cache hit: the plan the job trained on
    assert [m.value for m in hist] == [plan.train.rows_per_epoch_per_rank] * 2
    ranks = json.loads(open(client.download_artifacts(summary["run_id"], "ranks.json", str(tmp_path))).read())
    assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]


def test_arrow_reader_names_the_file_and_row_group(spark, digits_table, tmp_path):
    from pipeline.data.shards import ConversionError

    cfg = make_config(tmp_path, f"delta.table={digits_table}")
    data = _convert(spark, cfg, digits_table)
    victim = data.val.file_urls[0].replace("file://", "")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as fh:
        fh.truncate(size // 3)
    with pytest.raises(ConversionError) as err:
        _one_pass_ids(data, "arrow", 0, "val")
    assert victim in str(err.value) and "row group" in str(err.value)


def test_arrow_stream_resumes_exactly(spark, digits_table, tmp_path):
    """The arrow train stream stopped after k batches and resumed at k reads exactly the rows an uninterrupted one
    reads from there, in the same order (across epoch and pass boundaries, from memory or from the files)."""
    from pipeline.config import DataConfig
    from pipeline.data.datamodule import make_datamodule

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "data.batch_size=16")
    data = _convert(spark, cfg, digits_table)
    steps = data.plan.train.steps_per_epoch

    def stream(memory_mb, resume=0, epochs=3):
        dm = make_datamodule(data, 1, 2, DataConfig(reader="arrow", memory_cache_mb=memory_mb, shuffle_buffer=64),
                             track_ids=True)
        loader = dm.train_dataloader()
        loader.resume_at(resume)
        ids = []
        for _ in range(epochs):
            for _ in loader:
                pass
            loader.check_rows()
            ids += loader.ids_read
        dm.teardown("fit")
        return ids

    whole = stream(64)
    assert whole == stream(0)  # the same stream whether served from memory or read from the files
    cut = steps + steps // 2 + 1  # mid-way through the second epoch
    resumed = stream(64, resume=cut, epochs=2)
    assert resumed == whole[cut * 16:] and len(resumed) == (3 * steps - cut) * 16


def test_mid_epoch_checkpoint_resume_trains_like_uninterrupted(spark, digits_table, tmp_path):
    """train.checkpoint_every_n_steps + data.reader=arrow: a run that dies mid-epoch and resumes from last.ckpt ends
    with exactly the weights of a run that never stopped (no step twice into the optimizer, no row skipped)."""
    from pipeline.data.convert import class_names_of
    from pipeline.distributed.launcher import launch
    from pipeline.distributed.loop import TrainJob

    def run(name, *extra):
        cfg = make_config(tmp_path / name, f"delta.table={digits_table}", "data.reader=arrow", "data.batch_size=16",
                          "train.backend=single", "train.np=1", "train.max_epochs=2", "train.warmup_epochs=0",
                          f"data.cache_dir={tmp_path}/cache", "train.checkpoint_every_n_steps=1", *extra)
        data = _convert(spark, cfg, digits_table, world=1)
        job = TrainJob(cfg=cfg, data=data, delta_table=str(digits_table), delta_version=0,
                       job_dir=str(tmp_path / name / "job"))
        return launch(job)[0], data

    whole, data = run("whole")
    cut = data.plan.train.steps_per_epoch + 3  # dies inside the second epoch
    with pytest.raises(Exception, match="injected failure"):
        run("cut", f"debug.fail_at_step={cut}")
    resumed, _ = run("cut", "train.ckpt_restore=last")
    assert resumed.epochs == whole.epochs == 2
    assert resumed.final_weights_digest == whole.final_weights_digest


def test_arrow_ranks_import_no_spark_petastorm_or_mlflow(spark, digits_table, tmp_path):
    """What a rank reading with `arrow` imports: torch, Lightning, Horovod, pyarrow, numpy; not pyspark, petastorm,
    mlflow or pandas (they stay on the driver)."""
    import horovod

    from pipeline.distributed.loop import TrainJob

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "data.reader=arrow", "data.batch_size=16",
                      "train.np=-2", "train.max_epochs=1")
    data = _convert(spark, cfg, digits_table)
    job = TrainJob(cfg=cfg, data=data, delta_table=str(digits_table), delta_version=0, job_dir=str(tmp_path / "job"))

    def rank_fn(job):
        import sys

        from pipeline.distributed.backends.horovod import horovod_worker

        result = horovod_worker(job)
        return result.rank, result.epochs, sorted(m.split(".")[0] for m in sys.modules)

    results = horovod.run(rank_fn, args=(job,), np=2, use_gloo=True, start_timeout=120, verbose=0)
    assert sorted(r[0] for r in results) == [0, 1] and all(r[1] == 1 for r in results)
    for _, _, modules in results:
        assert {"torch", "pytorch_lightning", "horovod", "pyarrow", "numpy"} <= set(modules)
        assert not {"pyspark", "petastorm", "mlflow", "pandas", "py4j"} & set(modules), \
            sorted({"pyspark", "petastorm", "mlflow", "pandas", "py4j"} & set(modules))
