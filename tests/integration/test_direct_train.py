"""`lakehouse train data.source=direct` end to end: the digits sample ingested, trained on 2 Horovod ranks straight from
the table's own Parquet files (no Spark, no cache entry) through to a registered version; the JSON line, the run and
the version say the source; the validation rows are the converted path's; a relaunch on fewer ranks is re-planned."""
import json
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def _run(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, cwd=tmp)
    (tmp / f"{args[0]}.log").write_text(out.stderr)
    assert out.returncode == 0, f"lakehouse {args[0]} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct_train")
    paths = [f"delta.table={tmp}/delta/digits", f"data.cache_dir={tmp}/cache", f"train.checkpoint_dir={tmp}/ckpt",
             f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"mlflow.artifact_location={tmp}/artifacts",
             "mlflow.experiment=direct", "mlflow.registered_model=direct"]
    conf = ["--conf", str(ROOT / "conf/local.yaml"), *paths]
    _run(tmp, "sample-data", "--out", str(tmp / "images"), "--limit", "200")
    _run(tmp, "ingest", "--source", str(tmp / "images"), "--mode", "overwrite", *conf)
    return tmp, conf


@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_train_direct_on_two_ranks_registers_and_says_direct(digits, backend):
    from mlflow.tracking import MlflowClient

    tmp, conf = digits
    out = _run(tmp, "train", *conf, "data.source=direct", "data.decode=cpu", "data.decode_workers=1", "train.np=-2",
               "train.max_epochs=1", f"train.backend={backend}", f"mlflow.registered_model=direct-{backend}",
               f"train.checkpoint_dir={tmp}/ckpt-{backend}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["data_source"] == "direct" and summary["world_size"] == 2 and summary["backend"] == backend
    assert summary["rows_train"] + summary["rows_val"] == 200 and summary["model_version"] == 1
    assert not (tmp / "cache").exists() or not any((tmp / "cache").iterdir())  # nothing converted, nothing cached
    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["data_source"] == "direct"
    assert run.data.params["data.source"] == "direct"
    version = client.get_model_version(f"direct-{backend}", str(summary["model_version"]))
    assert version.tags["data_source"] == "direct"


def test_direct_validation_rows_are_the_converted_paths_by_path(digits, spark):
    """The same split rule on both paths: the direct path's validation rows (by path) are those the converted path
    puts in its val split (its Spark filter over the same pinned version)."""
    from pipeline.config import load_config
    from pipeline.data.direct import DirectShardReader
    from pipeline.data.source import prepare_direct
    from pipeline.lakehouse.delta import get_engine
    from pipeline.lakehouse.split import split_frame

    tmp, conf = digits
    cfg = load_config(str(ROOT / "conf/local.yaml"), conf[2:] + ["data.source=direct", "data.decode=cpu"])
    data, pinned = prepare_direct(cfg)
    direct = set()
    for rank in range(data.val.world_size):
        reader = DirectShardReader(data.val, rank, data.val.world_size, workers=1)
        for _, group in reader.iter_groups(range(len(reader))):
            direct.update(group.path.to_pylist())
    df, _ = get_engine("delta-rs").read(spark, cfg.delta.table, pinned.version)
    _, val = split_frame(df, cfg.data.val_fraction, cfg.data.split_key)
    converted = {r["path"] for r in val.select("path").collect()}
    assert direct and direct == converted


def test_a_relaunch_on_fewer_ranks_is_planned_again_over_the_same_files(digits):
    """The restart policy's re-plan (source.data_for_launch): direct data planned for 2 ranks, relaunched on 1, reads
    every train row of the pinned files in one share, with the plan's steps."""
    from pipeline.config import load_config
    from pipeline.data.plan import derive_plan
    from pipeline.data.source import data_for_launch, prepare_direct

    tmp, conf = digits
    cfg = load_config(str(ROOT / "conf/local.yaml"), conf[2:] + ["data.source=direct", "data.decode=cpu",
                                                                              "train.np=-2"])
    data, _ = prepare_direct(cfg)
    was = derive_plan(cfg, data, 2)
    plan = was.relaunched(restore_from=None, world_size=1, cause="a task lost")
    again, plan = data_for_launch(data, was, plan)
    assert again.train.world_size == 1 and again.plan is plan.shards
    assert again.train.rows_per_rank == [sum(data.index.counts("train"))]
    assert plan.steps_per_epoch == again.plan.train.steps_per_epoch == again.train.rows // plan.batch_size
    same, same_plan = data_for_launch(data, was, was.relaunched(restore_from=None))
    assert same.train is data.train and same_plan.shards is was.shards


def test_prepare_data_for_direct_starts_no_spark_session_and_writes_no_cache(digits):
    """The workflow's one branch on data.source: the direct data, pinned with its files digest, and Spark left
    unstarted (Horovod's ranks on this machine need none)."""
    from pipeline.config import load_config
    from pipeline.data.direct import DirectData
    from pipeline.lakehouse.spark import SparkOnDemand
    from pipeline.workflow import prepare_data

    tmp, conf = digits
    cfg = load_config(str(ROOT / "conf/local.yaml"), conf[2:] + ["data.source=direct", "data.decode=cpu",
                                                                  "train.backend=horovod", "train.np=-2",
                                                                  f"data.cache_dir={tmp}/cache_prepare"])
    spark = SparkOnDemand(cfg)
    data, pinned = prepare_data(spark, cfg)
    assert isinstance(data, DirectData) and not spark.started
    assert pinned.files_digest == data.files_digest and pinned.num_files == len(data.pinned.files)
    assert data.class_names and data.plan.train.world_size == 2 and data.lineage()["source"] == "direct"
    assert not (tmp / "cache_prepare").exists()


def test_the_doctor_says_whether_the_direct_path_reads_the_table_and_why_not(digits, tmp_path, capsys):
    from pipeline.config import load_config
    from pipeline.doctor import direct_path, run_doctor

    tmp, conf = digits
    ok, why = direct_path(load_config(str(ROOT / "conf/local.yaml"), conf[2:]))
    assert ok and why.startswith(f"{tmp}/delta/digits@0: ") and "200 row(s)" in why
    missing = load_config(str(ROOT / "conf/local.yaml"), conf[2:] + [f"delta.table={tmp_path}/none",
                                                                      "data.source=direct", "data.decode=cpu"])
    ok, why = direct_path(missing)
    assert not ok and "delta.table" in why and "\n" not in why
    assert run_doctor(missing) == 1
    out = capsys.readouterr().out
    assert "direct path        no: " in out and "config data.source=direct but the direct path cannot read" in out
