"""Data plane on real parts: Spark local[2], Delta via delta-rs, Petastorm converters and the DataModule."""
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import make_config
from pipeline.data.cache import remove_entry

pytestmark = [pytest.mark.integration, pytest.mark.datapath, pytest.mark.timeout(600)]


def _ingest(spark, cfg, source, mode="append"):
    from pipeline.lakehouse.ingest import ingest_folder

    return ingest_folder(spark, cfg, str(source), mode=mode)


def _read(spark, cfg, version=None):
    from pipeline.lakehouse.delta import get_engine

    return get_engine("delta-rs").read(spark, cfg.delta.table, version)


def _subset(src: Path, dst: Path, per_class: int, classes=None, skip: int = 0) -> Path:
    for cls in sorted(os.listdir(src)):
        if classes and cls not in classes:
            continue
        (dst / cls).mkdir(parents=True, exist_ok=True)
        for name in sorted(os.listdir(src / cls))[skip:skip + per_class]:
            shutil.copy(src / cls / name, dst / cls / name)
    return dst


def test_ingest_append_and_time_travel(spark, digits_dir, tmp_path, monkeypatch):
    cfg = make_config(tmp_path)
    first = _subset(digits_dir, tmp_path / "a", 5)
    r0 = _ingest(spark, cfg, first)
    assert r0.version == 0 and r0.rows_written == 50 and r0.skipped == []
    second = _subset(digits_dir, tmp_path / "b", 3, classes={"one", "two"}, skip=5)
    r1 = _ingest(spark, cfg, second)
    assert r1.version == 1 and r1.rows_written == 6
    # a re-run (a retried job) appends nothing: every file is already in the table, no commit; they are counted in
    # full and listed up to the bound (the first by path), so a re-run over millions of files lists a few thousand
    monkeypatch.setattr("pipeline.lakehouse.ingest._LISTED_ALREADY", 4)
    again = _ingest(spark, cfg, second)
    assert (again.version, again.rows_written, again.skipped_counts()) == (1, 0, {"already_in_table": 6})
    summary = again.summary()
    assert (summary["skipped"], summary["skipped_not_listed"], summary["skipped_counts"]) == (
        6, 2, {"already_in_table": 6})
    assert summary["skipped_files"] == sorted(str(p) for p in second.rglob("*.png"))[:4]
    # an append keeps label indices stable
    assert r1.classes["one"] == r0.classes["one"] and r1.classes["two"] == r0.classes["two"]

    df0, pinned0 = _read(spark, cfg, 0)
    df1, pinned1 = _read(spark, cfg)
    assert (pinned0.version, df0.count()) == (0, 50)
    assert (pinned1.version, df1.count()) == (1, 56)
    row = df1.filter("label = 'one'").first()
    assert row.width == 32 and row.height == 32 and row.mode == "L" and row.content[:4] == b"\x89PNG"
    assert set(df1.columns) >= {"path", "label", "label_index", "width", "height", "content"}
    # each row's stored digest is its bytes' SHA-256 (what an append and the content split read instead of the bytes)
    assert all(r.sha256 == hashlib.sha256(r.content).hexdigest() for r in df1.select("sha256", "content").collect())


def test_an_append_to_a_table_without_digests_keeps_its_columns_and_finds_its_bytes(spark, digits_dir, tmp_path,
                                                                                     caplog):
    """A table written before ingest stored digests: an append hashes the table's bytes to skip those it holds,
    writes the table's own columns (no schema change, no refusal), and says how to gain the column; an overwrite
    writes it."""
    from deltalake import DeltaTable
    from pyspark.sql import functions as F

    from pipeline.lakehouse.delta import get_engine
    from pipeline.lakehouse.ingest import TABLE_COLUMNS

    cfg = make_config(tmp_path)
    first = _subset(digits_dir, tmp_path / "a", 2, classes={"one", "two"})
    _ingest(spark, cfg, first)
    df, _ = _read(spark, cfg)
    get_engine("delta-rs").write(df.drop("sha256"), cfg.delta.table, "overwrite")  # as an older ingest left it
    old = DeltaTable(cfg.delta.table)
    assert "sha256" not in old.schema().to_arrow().names
    more = _subset(digits_dir, _subset(digits_dir, tmp_path / "b", 1, classes={"one"}), 3, classes={"three"})
    with caplog.at_level("WARNING", logger="pipeline.lakehouse.ingest"):
        res = _ingest(spark, cfg, more)
    assert (res.version, res.rows_written, res.skipped_counts()) == (old.version() + 1, 3, {"already_in_table": 1})
    assert "has no sha256 column" in caplog.text and "--mode overwrite" in caplog.text
    after, _ = _read(spark, cfg)
    assert "sha256" not in after.columns and after.count() == 7
    # another writer's row whose digest is not of a digest's form: its bytes are hashed, so a copy is still found
    bad = after.withColumn("sha256", F.when(F.col("label") == "three", F.lit("NOT A DIGEST")))
    bad = spark.createDataFrame(bad.collect(), bad.schema)  # held, not read lazily from the table it overwrites
    get_engine("delta-rs").write(bad.select(*[c for c in TABLE_COLUMNS]), cfg.delta.table, "overwrite")
    again_more = _ingest(spark, cfg, more)
    assert (again_more.rows_written, again_more.skipped_counts()) == (0, {"already_in_table": 4})
    over = _ingest(spark, cfg, more, mode="overwrite")
    again, _ = _read(spark, cfg, over.version)
    assert again.count() == 4
    assert all(r.sha256 == hashlib.sha256(r.content).hexdigest() for r in again.select("sha256", "content").collect())


def test_bad_file_skipped_and_listed_or_fails_whole_ingest(spark, digits_dir, tmp_path):
    src = _subset(digits_dir, tmp_path / "src", 2)
    bad = src / "three" / "corrupt.png"
    bad.write_bytes(b"\x89PNG but truncated")
    cfg_fail = make_config(tmp_path, "ingest.on_bad_file=fail")
    from pipeline.lakehouse.ingest import IngestError

    with pytest.raises(IngestError) as err:
        _ingest(spark, cfg_fail, src)
    assert str(bad) in str(err.value) and "nothing written" in str(err.value)
    from deltalake import DeltaTable

    assert not DeltaTable.is_deltatable(cfg_fail.delta.table)

    cfg = make_config(tmp_path)
    res = _ingest(spark, cfg, src)
    assert res.rows_written == 20
    assert [(s.path, s.reason) for s in res.skipped] == [(str(bad), "undecodable")]
    assert "not a decodable image" in res.skipped[0].detail
    # and with fail, an existing table keeps its version
    with pytest.raises(IngestError):
        _ingest(spark, cfg_fail, src)  # same table path
    assert DeltaTable(cfg.delta.table).version() == 0


def test_cli_ingest_reports_skipped_files(digits_dir, tmp_path):
    import subprocess

    from conftest import cli

    src = _subset(digits_dir, tmp_path / "src", 1)
    (src / "five" / "bad.png").write_bytes(b"nope")
    cfg_args = [f"delta.table={tmp_path}/t"]
    out = subprocess.run(cli("ingest", "--source", str(src), *cfg_args), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["delta_version"] == 0 and result["rows_written"] == 10 and result["skipped"] == 1
    assert result["skipped_files"] == [str(src / "five" / "bad.png")]
    assert result["skipped_counts"] == {"undecodable": 1} and result["files_found"] == 11


def test_schema_mismatched_append_is_refused(spark, digits_table, tmp_path):
    from deltalake import DeltaTable

    from pipeline.lakehouse.delta import SchemaMismatchError, get_engine

    table = tmp_path / "copy"
    shutil.copytree(digits_table, table)
    cfg = make_config(tmp_path, f"delta.table={table}")
    before = DeltaTable(str(table)).version()
    df, _ = _read(spark, cfg)
    retyped = df.limit(3).withColumn("label_index", df.label_index.cast("string")).withColumn("extra", df.width)
    with pytest.raises(SchemaMismatchError) as err:
        get_engine("delta-rs").write(retyped, str(table), "append")
    msg = str(err.value)
    assert "new column 'extra'" in msg and "column 'label_index' is string" in msg
    assert DeltaTable(str(table)).version() == before
    assert _read(spark, cfg)[0].count() == df.count()


def test_missing_table_and_version_are_clear(spark, digits_table, tmp_path):
    from pipeline.lakehouse.delta import DeltaError

    cfg = make_config(tmp_path, f"delta.table={tmp_path}/nothing")
    with pytest.raises(DeltaError, match="does not exist"):
        _read(spark, cfg)
    cfg = make_config(tmp_path, f"delta.table={digits_table}")
    with pytest.raises(DeltaError, match="no version 7.*0 to 0"):
        _read(spark, cfg, 7)


def test_partition_columns_come_through(spark, tmp_path):
    import pyarrow as pa
    from deltalake import write_deltalake

    table = str(tmp_path / "parted")
    write_deltalake(table, pa.table({"x": [1, 2, 3, 4], "label": ["a", "b", "a", "c"]}), partition_by=["label"])
    cfg = make_config(tmp_path, f"delta.table={table}")
    df, pinned = _read(spark, cfg)
    rows = sorted((r.x, r.label) for r in df.collect())
    assert rows == [(1, "a"), (2, "b"), (3, "a"), (4, "c")]
    assert df.columns == ["x", "label"]


def test_unreadable_feature_is_refused(spark, tmp_path):
    import pyarrow as pa
    from deltalake import write_deltalake

    from pipeline.lakehouse.delta import DeltaError

    table = tmp_path / "dv"
    write_deltalake(str(table), pa.table({"x": [1, 2]}))
    proto = {"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["deletionVectors"],
                          "writerFeatures": ["deletionVectors"]}}
    info = {"commitInfo": {"timestamp": 1, "operation": "SET TBLPROPERTIES"}}
    (table / "_delta_log" / "00000000000000000001.json").write_text(json.dumps(info) + "\n" + json.dumps(proto) + "\n")
    cfg = make_config(tmp_path, f"delta.table={table}")
    with pytest.raises(DeltaError, match="deletionVectors"):
        _read(spark, cfg)


def test_deleted_data_file_is_named_before_training(spark, digits_table, tmp_path):
    from deltalake import DeltaTable

    from pipeline.lakehouse.delta import DeltaError

    table = tmp_path / "copy"
    shutil.copytree(digits_table, table)
    victim = DeltaTable(str(table)).file_uris()[0]
    os.unlink(victim)
    cfg = make_config(tmp_path, f"delta.table={table}")
    with pytest.raises(DeltaError) as err:
        _read(spark, cfg)
    assert victim in str(err.value)


def test_spark_split_matches_python_rule(spark, digits_table, tmp_path):
    from pipeline.data.convert import split_frame
    from pipeline.lakehouse.split import is_validation

    cfg = make_config(tmp_path, f"delta.table={digits_table}")
    df, _ = _read(spark, cfg)
    train, val = split_frame(df, 0.2)
    val_paths = {r.path for r in val.select("path").collect()}
    train_paths = {r.path for r in train.select("path").collect()}
    assert not val_paths & train_paths and len(val_paths) + len(train_paths) == df.count()
    assert 0.1 < len(val_paths) / df.count() < 0.3  # both sides hold rows: the checks below are not vacuous
    assert all(is_validation(p, 0.2) for p in val_paths)
    assert not any(is_validation(p, 0.2) for p in train_paths)


@pytest.mark.parametrize("reader", ["petastorm", "arrow"])
def test_datamodule_two_shards_equal_steps_and_cover_plan(spark, digits_table, tmp_path, reader):
    from conftest import require_reader
    from pipeline.config import DataConfig
    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.data.datamodule import make_datamodule

    require_reader(reader)
    cfg = make_config(tmp_path, f"delta.table={digits_table}", "data.batch_size=16")
    df, _ = _read(spark, cfg)
    data = convert_for_training(spark, df, cfg, 2, class_names_of(df))
    try:
        assert data.plan.train.total_rows + data.plan.val.total_rows == 600
        assert data.plan.train.balance() <= 1.05  # row groups sized by the plan
        steps, val_rows, val_batches, labels = [], [], [], set()
        for rank in range(2):
            dm = make_datamodule(data, rank, 2, DataConfig(reader_workers=1, memory_cache_mb=0, reader=reader))  # files each pass
            try:
                for _ in range(2):  # two epochs: the same steps every time
                    n = 0
                    for x, y in dm.train_dataloader():
                        assert x.shape == (16, 1, 32, 32) and y.dtype.is_floating_point is False
                        labels.update(y.tolist())
                        n += 1
                    steps.append(n)
                    dm.train_loader.check_rows()
                seen, sizes = 0, []
                for x, y in dm.val_dataloader():
                    seen += len(y)
                    sizes.append(len(y))
                    assert x.shape[1:] == (1, 32, 32) and len(x) == len(y)
                dm.val_loader.check_rows()
                assert len(dm.val_dataloader()) == len(sizes)
                val_rows.append(seen)
                val_batches.append(sizes)
            finally:
                dm.teardown("fit")
        assert len(set(steps)) == 1 and steps[0] == data.plan.train.steps_per_epoch
        assert val_rows == data.plan.val.rows_per_rank and sum(val_rows) == data.plan.val.total_rows
        # every rank runs the same validation steps (FSDP gathers parameters in each forward); the rank with fewer
        # rows ends its pass with empty batches, and only there
        assert [len(b) for b in val_batches] == [data.plan.val.eval_steps] * 2, val_batches
        for sizes in val_batches:
            full = [n for n in sizes if n]
            assert all(n == 16 for n in full[:-1]) and sizes[:len(full)] == full
        assert labels <= set(range(10)) and len(labels) == 10
    finally:
        remove_entry(data.entry_url)
    assert not os.path.exists(data.entry_url.replace("file://", ""))


def _row_keys(batches) -> list:
    return [row.numpy().tobytes() for x, _ in batches for row in x]


def _parquet_files(converter) -> list:
    return [u.replace("file://", "") for u in converter.file_urls]


@pytest.mark.parametrize("reader", ["petastorm", "arrow"])
def test_shard_kept_in_memory_after_one_pass(spark, digits_table, tmp_path, reader):
    """data.memory_cache_mb: a shard that fits is read once (by either reader), then served from memory
    (the converted files are deleted after the first pass to prove it), its row groups in a new order each pass."""
    from conftest import require_reader

    require_reader(reader)
    from pipeline.config import DataConfig
    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.data.datamodule import make_datamodule
    from pipeline.data.loader import ShardLoader

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "data.batch_size=16", "data.partitions_per_worker=4")
    df, _ = _read(spark, cfg)
    data = convert_for_training(spark, df, cfg, 2, class_names_of(df))
    # no shuffle buffer: the rows come in row-group order, so the passes can be cut out of the stream of rows
    dm = make_datamodule(data, 1, 2, DataConfig(reader_workers=1, memory_cache_mb=64, shuffle_buffer=0, reader=reader))
    try:
        train, val = dm.train_dataloader(), dm.val_dataloader()
        assert train.keeps_in_memory and val.keeps_in_memory and 0 < train.shard_mb() < 64
        next(iter(val))  # a pass cut short, as by Lightning's sanity check: nothing is kept from it
        first_val = _row_keys(val)
        val.check_rows()
        # Lightning takes exactly len(loader) batches and never asks for the end; with a pass that ends on its
        # last batch the reader is still open at that point, and the shard must be kept all the same (one batch
        # holds the largest shard, so every rank's pass is one batch)
        whole = dataclasses.replace(data.plan.val, batch_size=max(data.plan.val.rows_per_rank))
        one_batch = ShardLoader(data.val, whole, rank=1, world_size=2, channels=data.channels,
                                image_size=data.image_size, endless=False, workers=1, shuffle_buffer=0, seed=7,
                                memory_cache_mb=64, reader=reader)
        # Petastorm's reader does not promise the order of its row groups between two readers: compare the rows
        same = (lambda a, b: a == b) if reader == "arrow" else (lambda a, b: sorted(a) == sorted(b))
        assert len(one_batch) == 1 and same(_row_keys(itertools.islice(one_batch, len(one_batch))), first_val)
        plan = data.plan.train
        shard_rows, epoch_rows = plan.rows_per_rank[1], plan.rows_per_epoch_per_rank
        stream = []
        while len(stream) < shard_rows:
            stream += _row_keys(train)
        train.check_rows()
        for path in _parquet_files(data.train) + _parquet_files(data.val):
            os.remove(path)
        assert _row_keys(val) == first_val and len(first_val) == data.plan.val.rows_per_rank[1]
        assert same(_row_keys(one_batch), first_val)
        for _ in range(3):
            stream += _row_keys(train)
            train.check_rows()
        passes = [stream[k:k + shard_rows] for k in range(0, len(stream) - shard_rows + 1, shard_rows)]
        assert len(passes) >= 3 and plan.row_groups_per_rank[1] >= 4
        assert all(len(p) == len(set(p)) == shard_rows and set(p) == set(passes[0]) for p in passes)
        assert any(p != passes[0] for p in passes[1:])  # the row groups are reordered between passes
    finally:
        dm.teardown("fit")
        remove_entry(data.entry_url)


def test_too_few_row_groups_fails_before_training(spark, digits_dir, tmp_path):
    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.lakehouse.partition import PlanError

    src = _subset(digits_dir, tmp_path / "tiny", 1, classes={"one", "two", "three"})
    cfg = make_config(tmp_path, "data.partitions_per_worker=1", "data.val_fraction=0.01")
    _ingest(spark, cfg, src)
    df, _ = _read(spark, cfg)
    with pytest.raises(PlanError) as err:
        convert_for_training(spark, df, cfg, 4, class_names_of(df))
    msg = str(err.value)
    assert "4 ranks" in msg and "row group" in msg and "train.np" in msg


def test_arrow_train_stream_is_the_same_from_files_and_from_memory(spark, digits_table, tmp_path):
    """The arrow reader's train stream is a function of the seed alone: read from the files every pass (one
    read-ahead spanning the passes) or kept in memory after the first, it yields the same rows in the same order,
    pass after pass, and each pass is checked against the plan."""
    from pipeline.config import DataConfig
    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.data.datamodule import make_datamodule

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "data.batch_size=16", "data.reader=arrow")
    df, _ = _read(spark, cfg)
    data = convert_for_training(spark, df, cfg, 2, class_names_of(df))
    streams = {}
    try:
        for cache_mb in (0, 64):
            dm = make_datamodule(data, 1, 2, DataConfig(reader_workers=2, memory_cache_mb=cache_mb, shuffle_buffer=64,
                                                        reader="arrow", seed=3))
            try:
                train = dm.train_dataloader()
                assert train.keeps_in_memory == (cache_mb > 0)
                stream = []
                for _ in range(4):
                    stream.append(_row_keys(train))
                    train.check_rows()
                streams[cache_mb] = stream
            finally:
                dm.teardown("fit")
    finally:
        remove_entry(data.entry_url)
    assert streams[0] == streams[64]
    assert len({tuple(epoch) for epoch in streams[0]}) == 4  # a new order every epoch
