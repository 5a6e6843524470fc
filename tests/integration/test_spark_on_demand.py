"""A job's Spark session is started only when Spark has work to do: the table is pinned from its Delta log (delta-rs),
a cache hit reads no DataFrame, and the ranks on this machine (horovod.run, torchrun) need no session; a
conversion, or a launch of Spark tasks, starts it. Real Spark local[2], the shared Delta table, real conversions."""
import pytest

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_a_cache_hit_with_horovod_here_asks_for_no_session(spark, digits_table, tmp_path):
    from pipeline.lakehouse.spark import SparkOnDemand
    from pipeline.workflow import prepare_data

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "train.backend=horovod", "train.np=-2")
    first = SparkOnDemand(cfg)
    data, pinned = prepare_data(first, cfg)  # a new cache: the table is read and converted through Spark
    assert first.started
    assert pinned.files_digest and pinned.num_files > 0

    again = SparkOnDemand(cfg)
    hit, pinned_again = prepare_data(again, cfg)
    assert not again.started  # pinned from the log, the entry found by its key, the classes from its manifest
    assert (hit.key, hit.class_names, hit.rows) == (data.key, data.class_names, data.rows)
    assert hit.plan.describe() == data.plan.describe()
    assert pinned_again == pinned


def test_ddp_ranks_on_this_machine_need_no_session_on_a_cache_hit(spark, digits_table, tmp_path):
    """torchrun starts DDP's local ranks (pipeline/distributed/backends/torchrun.py): a cache hit starts no JVM."""
    from pipeline.lakehouse.spark import SparkOnDemand
    from pipeline.workflow import prepare_data

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "train.backend=ddp", "train.np=-2")
    prepare_data(SparkOnDemand(cfg), cfg)
    again = SparkOnDemand(cfg)
    prepare_data(again, cfg)
    assert not again.started


def test_a_table_changed_since_its_entry_was_converted_is_converted_again(spark, digits_dir, tmp_path):
    """The key holds the data files of the pinned version as the log lists them: a new version is a miss."""
    from pipeline.lakehouse.ingest import ingest_folder
    from pipeline.lakehouse.spark import SparkOnDemand
    from pipeline.workflow import prepare_data

    table = tmp_path / "delta" / "images"
    cfg = make_config(tmp_path, f"delta.table={table}")
    ingest_folder(spark, cfg, str(digits_dir), mode="overwrite")
    data, pinned = prepare_data(SparkOnDemand(cfg), cfg)
    ingest_folder(spark, cfg, str(digits_dir), mode="overwrite")  # the same images, new files, version 1

    newer = SparkOnDemand(cfg)
    data1, pinned1 = prepare_data(newer, cfg)
    assert newer.started and pinned1.version == pinned.version + 1
    assert pinned1.files_digest != pinned.files_digest and data1.key != data.key
