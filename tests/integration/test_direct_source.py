"""The direct path (data.source=direct) on real tables written by delta-rs: pinned without Spark, planned over files of
uneven sizes, every planned row read exactly once across the ranks, the converted path's validation rows (compared by
path, against a real conversion), batches the loader's assembler and CPU decoder take, and tables whose protocol
needs a feature the reader lacks refused, naming it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _rows(digits_dir: Path):
    files = sorted(p for p in digits_dir.rglob("*") if p.is_file())
    labels = sorted({p.parent.name for p in files})
    return [{"path": str(p), "label": p.parent.name, "label_index": labels.index(p.parent.name),
             "content": p.read_bytes()} for p in files]


def _write(table: Path, rows, mode: str) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    schema = pa.schema([("path", pa.string()), ("label", pa.string()), ("label_index", pa.int32()),
                        ("content", pa.binary())])
    write_deltalake(str(table), pa.Table.from_pylist(rows, schema=schema), mode=mode)


@pytest.fixture(scope="module")
def uneven_table(digits_dir, tmp_path_factory) -> Path:
    """The digits in a table of two appends with files of different sizes: 400 rows in one file, then files of
    17, 61, 5 and 117 rows (as other writers leave them)."""
    rows = _rows(digits_dir)
    table = tmp_path_factory.mktemp("direct") / "uneven"
    _write(table, rows[:400], "overwrite")
    start = 400
    for n in (17, 61, 5, 117):
        _write(table, rows[start:start + n], "append")
        start += n
    assert start == len(rows) == 600
    return table


def _direct(table, world, split_key="content", val_fraction=0.2, batch=8):
    from pipeline.data.direct import plan_direct, split_index
    from pipeline.lakehouse.delta_files import pin_files

    pinned = pin_files(str(table))
    return pinned, plan_direct(pinned, split_index(pinned, val_fraction, split_key), world, batch)


def _read_split(split, world):
    """Per rank: the (row id, path) of every row its reader yields."""
    from pipeline.data.direct import DirectShardReader

    out = []
    for rank in range(world):
        reader = DirectShardReader(split, rank, world, workers=2)
        got = []
        for _, group in reader.iter_groups(range(len(reader))):
            got += list(zip(group.row_id.to_pylist(), group.path.to_pylist()))
            assert len(group.pixels) == len(group.label_index) == len(group.row_id)
        out.append(got)
    return out


def test_pinned_without_spark_with_the_engines_digest(uneven_table):
    from pipeline.lakehouse.delta_rs import DeltaRsEngine

    pinned, _ = _direct(uneven_table, 2)
    engine = DeltaRsEngine().pin(str(uneven_table))
    assert pinned.version == engine.version == 4
    assert pinned.digest == engine.files_digest  # the lineage the converted path records for the same version
    assert sorted(f.rows for f in pinned.files) == [5, 17, 61, 117, 400]
    assert pinned.num_rows == 600


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_planned_row_is_read_exactly_once_with_equal_train_rows(uneven_table, world):
    _, data = _direct(uneven_table, world)
    for split in (data.train, data.val):
        per_rank = _read_split(split, world)
        assert [len(r) for r in per_rank] == split.rows_per_rank
        ids = [i for r in per_rank for i, _ in r]
        assert len(ids) == len(set(ids)) == split.rows
    assert len(set(data.plan.train.rows_per_rank)) == 1  # equal rows, so equal steps
    assert data.train.rows % world == 0 and data.left_out < world
    assert data.train.rows + data.left_out + data.val.rows == 600
    # the big first file is shared by ranks at the row level: no rank gets whole files only
    if world > 1:
        assert abs(data.plan.val.rows_per_rank[0] - data.plan.val.rows_per_rank[-1]) <= 1


@pytest.mark.parametrize("step", [1, 3])
def test_the_reader_yields_the_files_rows_whether_a_chunk_is_a_run_or_has_holes(uneven_table, step):
    """Every `step`-th row of each file, planned over 2 ranks (the cut falls inside the big file): a chunk of
    consecutive rows (step 1, read as a slice of its row group) and one with holes (step 3, taken) both yield exactly
    those rows of the files, in file order, with their row ids."""
    import numpy as np
    import pyarrow.parquet as pq

    from pipeline.data.direct import DirectSplit, decode_row_id, plan_ranges

    pinned, _ = _direct(uneven_table, 1)
    positions = [np.arange(0, f.rows, step, dtype=np.int64) for f in pinned.files]
    split = DirectSplit("train", [f.uri for f in pinned.files], [f.size for f in pinned.files], positions,
                        plan_ranges([len(p) for p in positions], 2, drop_remainder=False))
    assert split.runs[0][-1][1:] != (0, len(positions[split.runs[0][-1][0]]))  # rank 0 ends inside a file
    got = [row for rank in _read_split(split, 2) for row in rank]
    want = []
    for f, (file, rows) in enumerate(zip(pinned.files, positions)):
        paths = pq.read_table(file.uri.replace("file://", ""), columns=["path"]).column("path").to_pylist()
        want += [((f << 32) | int(r), paths[r]) for r in rows]
    assert got == want and [decode_row_id(i)[0] for i, _ in got] == sorted(decode_row_id(i)[0] for i, _ in got)


@pytest.mark.parametrize("split_key", ["content", "path"])
def test_validation_rows_equal_the_converted_paths(spark, uneven_table, tmp_path, split_key):
    """A real conversion (Spark's split_frame, the encoded layout keeps each row's path) and the direct plan hold out
    the same rows, compared by path; the direct train rows are the converted train rows (less those left out)."""
    import pyarrow.parquet as pq

    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.lakehouse.delta import get_engine

    cfg = make_config(tmp_path, f"delta.table={uneven_table}", "data.decode=cpu", "data.reader=arrow",
                      f"data.split_key={split_key}")
    df, pinned_spark = get_engine("delta-rs").read(spark, str(uneven_table))
    converted = convert_for_training(spark, df, cfg, 2, class_names_of(df), pinned_spark)

    def paths(split):
        return sorted(p for url in split.file_urls for p in pq.read_table(url.replace("file://", ""),
                                                                          columns=["path"]).column(0).to_pylist())

    _, data = _direct(uneven_table, 2, split_key=split_key, val_fraction=cfg.data.val_fraction)
    direct_val = sorted(p for r in _read_split(data.val, 2) for _, p in r)
    direct_train = [p for r in _read_split(data.train, 2) for _, p in r]
    assert direct_val == paths(converted.val) and len(direct_val) > 0
    conv_train = paths(converted.train)
    assert set(direct_train) <= set(conv_train) and len(direct_train) == len(conv_train) - data.left_out


def test_batches_the_loader_takes_decoded_on_the_cpu_in_a_seeded_order(uneven_table):
    """The reader's row groups go through the loader's batch assembly and CPU decoder unchanged; pass p's order is
    a pure function of (seed, p), so a resumed stream replays it."""
    from pipeline.data.batches import BatchAssembler
    from pipeline.data.decode import Decoder, EncodedRows
    from pipeline.data.direct import DirectShardReader

    _, data = _direct(uneven_table, 1)
    reader = DirectShardReader(data.train, 0, 1, workers=2)
    assert len(reader) == 5  # one chunk per row group of each file

    def stream(p):
        order = reader.order(seed=7, pass_index=p, shuffle=True)
        return [g for _, g in reader.iter_groups(order)]

    first, again, other = stream(0), stream(0), stream(1)
    ids = [g.row_id.to_pylist() for g in first]
    assert ids == [g.row_id.to_pylist() for g in again]
    assert ids != [g.row_id.to_pylist() for g in other]
    assembler = BatchAssembler(iter(first), 16, EncodedRows(data.train.encoded_row_bytes()), 64, 7, with_ids=True)
    decoder = Decoder(16, 1, False, 7, workers=1)
    try:
        batches = list(decoder.batches(iter(assembler), depth=2))
    finally:
        decoder.close()
    x, y, row_ids = batches[0]
    assert tuple(x.shape) == (16, 1, 16, 16) and len(y) == 16
    assert sum(len(b[1]) for b in batches) == data.plan.train.rows_per_rank[0]
    assert sorted(i for b in batches for i in b[2].tolist()) == sorted(i for g in first for i in g.row_id.to_pylist())


def _add_commit(table: Path, actions) -> None:
    log = table / "_delta_log"
    version = max(int(p.name.split(".")[0]) for p in log.glob("*.json")) + 1
    actions = [{"commitInfo": {"timestamp": 1, "operation": "TEST"}}] + actions
    (log / f"{version:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")


@pytest.mark.parametrize("feature", ["deletionVectors", "columnMapping"])
def test_a_table_needing_a_feature_the_reader_lacks_is_refused_naming_it(digits_dir, tmp_path, feature):
    from deltalake import DeltaTable

    from pipeline.config_parse import ConfigError
    from pipeline.lakehouse.delta_files import pin_files

    table = tmp_path / feature
    _write(table, _rows(digits_dir)[:20], "overwrite")
    pin_files(str(table))  # readable as written
    protocol = {"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": [feature],
                             "writerFeatures": [feature]}}
    if feature == "deletionVectors":
        actions = [protocol]
    else:  # column mapping by name: the files' physical names differ from the table's names
        meta = DeltaTable(str(table)).metadata()
        fields = [{"name": n, "type": t, "nullable": True,
                   "metadata": {"delta.columnMapping.id": i + 1, "delta.columnMapping.physicalName": f"col-{i}"}}
                  for i, (n, t) in enumerate([("path", "string"), ("label", "string"), ("label_index", "integer"),
                                              ("content", "binary")])]
        actions = [protocol, {"metaData": {
            "id": meta.id, "format": {"provider": "parquet", "options": {}},
            "schemaString": json.dumps({"type": "struct", "fields": fields}), "partitionColumns": [],
            "createdTime": 1, "configuration": {"delta.columnMapping.mode": "name",
                                                "delta.columnMapping.maxColumnId": "4"}}}]
    _add_commit(table, actions)
    with pytest.raises(ConfigError) as err:
        pin_files(str(table))
    assert feature in str(err.value) and str(table) in str(err.value) and "data.source" in str(err.value)
    assert pin_files(str(table), version=0).version == 0  # the version before the feature still reads


def test_file_uri_and_a_missing_file_named(uneven_table, tmp_path):
    import shutil

    from pipeline.config_parse import ConfigError
    from pipeline.lakehouse.delta_files import pin_files

    pinned = pin_files(f"file://{uneven_table}")
    assert pinned.num_rows == 600
    copy = tmp_path / "copy"
    shutil.copytree(uneven_table, copy)
    victim = sorted(p for p in copy.glob("*.parquet"))[0]
    os.remove(victim)
    with pytest.raises(ConfigError, match=victim.name):
        pin_files(str(copy))
    assert [f.uri for f in pinned.files] == sorted(f.uri for f in pinned.files)


def _direct_loader(monkeypatch, data, rank, world, memory_cache_mb):
    """The loader as it is, given a DirectSplit (it reads it with the direct reader, as data.source=direct does), a
    real CPU decoder. reader="petastorm" is asked for: a DirectSplit is always read as the arrow reader reads."""
    from pipeline.data import loader
    from pipeline.data.decode import Decoder

    return loader.ShardLoader(data.train, data.plan.train, rank, world, channels=1, image_size=16, endless=True,
                              workers=2, shuffle_buffer=64, seed=7, memory_cache_mb=memory_cache_mb, reader="petastorm",
                              track_ids=True, decoder=Decoder(16, 1, True, 7, workers=1))


@pytest.mark.parametrize("memory_cache_mb", [0, 64])
def test_the_loader_trains_epochs_and_resumes_mid_epoch_at_the_same_row(monkeypatch, uneven_table, memory_cache_mb):
    _, data = _direct(uneven_table, 2)
    first = _direct_loader(monkeypatch, data, 1, 2, memory_cache_mb)
    assert first.keeps_in_memory == (memory_cache_mb > 0)
    epochs = []
    try:
        for _ in range(2):
            batches = list(first)
            first.check_rows()
            epochs.append(list(first.ids_read))
            assert len(batches) == data.plan.train.steps_per_epoch
    finally:
        first.close()
    # each pass reads the share once (the loader checks its rows against the plan); the endless stream's shuffle
    # buffer spans passes, as on the converted path, so an epoch's batches may hold a row of the next pass
    assert set(epochs[0]) | set(epochs[1]) <= {i for i, _ in _read_split(data.train, 2)[1]}
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    resumed = _direct_loader(monkeypatch, data, 1, 2, memory_cache_mb)
    taken = 3
    resumed.resume_at(data.plan.train.steps_per_epoch + taken)  # killed after 3 steps of epoch 2
    try:
        rest = list(resumed)
    finally:
        resumed.close()
    assert len(rest) == data.plan.train.steps_per_epoch - taken
    assert resumed.ids_read == epochs[1][taken * data.plan.train.batch_size:]  # the same rows, in the same order


def test_the_loader_refuses_a_direct_split_without_a_decoder(uneven_table):
    from pipeline.data import loader

    _, data = _direct(uneven_table, 1)
    with pytest.raises(ValueError, match="data.decode"):
        loader.ShardLoader(data.train, data.plan.train, 0, 1, channels=1, image_size=16, endless=True, workers=1,
                           shuffle_buffer=0, seed=7, reader="arrow", decoder=None)


def test_the_data_module_reads_direct_data_with_the_direct_reader(uneven_table):
    """The ranks' data module takes a DirectData as it takes ConvertedData: both loaders read the direct shares
    (decoded on the CPU), every validation row of the rank's share once."""
    import dataclasses

    from pipeline.config import DataConfig
    from pipeline.data.datamodule import make_datamodule
    from pipeline.data.direct import direct_row_ids

    _, data = _direct(uneven_table, 2)
    data = dataclasses.replace(data, class_names=["a", "b"], image_size=16, channels=1)
    dm = make_datamodule(data, 1, 2, DataConfig(decode="cpu", decode_workers=1, reader="petastorm"), track_ids=True)
    try:
        assert dm.decode_used == "cpu" and dm.train_loader.direct and dm.train_loader.reader == "arrow"
        batches = list(dm.val_dataloader())
        dm.val_loader.check_rows()
        assert batches[0][0].shape[1:] == (1, 16, 16)
        assert sorted(dm.val_loader.ids_read) == sorted(direct_row_ids(data.val, 1, 2))
    finally:
        dm.teardown("fit")


def test_stored_digests_give_the_split_on_every_path_and_the_bytes_where_a_row_has_none(spark, digits_dir, tmp_path):
    """A table whose first file predates the digest column, then rows with digests: right ones, null, malformed,
    and well-formed ones that are not their bytes' (chosen to land in the other split, so the digest is seen to be
    read). The direct plan, a real conversion (Spark) and the gate's delta-rs rows hold out the same rows: those of
    the stored digest where it has the form of one, else of the bytes' hash."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import write_deltalake

    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.lakehouse.delta import get_engine
    from pipeline.lakehouse.split import HoldOut, is_validation
    from pipeline.tracking.heldout import held_out_rows

    rows = _rows(digits_dir)[:300]
    forged = 0
    for i, r in enumerate(rows[100:], start=100):
        real = hashlib.sha256(r["content"]).hexdigest()
        r["sha256"], r["key"] = real, real
        if i % 30 == 0:
            r["sha256"] = None
        elif i % 30 == 10:
            r["sha256"] = real.upper()  # not the form of a digest: the bytes decide
        elif i % 30 == 25:
            r["sha256"] = real + "\n"  # a line break after the digits: not one either (Java's `$` would take it)
        elif i % 30 == 20:
            k = 0
            while is_validation(hashlib.sha256(b"forged %d %d" % (i, k)).hexdigest(), 0.2) == is_validation(real, 0.2):
                k += 1
            r["sha256"] = r["key"] = hashlib.sha256(b"forged %d %d" % (i, k)).hexdigest()
            forged += 1
    for r in rows[:100]:
        r["key"] = hashlib.sha256(r["content"]).hexdigest()
    table = tmp_path / "digests"
    old = pa.schema([("path", pa.string()), ("label", pa.string()), ("label_index", pa.int32()),
                     ("content", pa.binary())])
    write_deltalake(str(table), pa.Table.from_pylist([{k: r[k] for k in old.names} for r in rows[:100]], schema=old),
                    mode="overwrite")
    new = pa.schema(list(old) + [("sha256", pa.string())])
    write_deltalake(str(table), pa.Table.from_pylist([{k: r[k] for k in new.names} for r in rows[100:]], schema=new),
                    mode="append", schema_mode="merge")
    expected = sorted(r["path"] for r in rows if is_validation(r["key"], 0.2))
    assert forged == 7 and 0 < len(expected) < len(rows)

    _, data = _direct(table, 2, split_key="content", val_fraction=0.2)
    assert sorted(p for r in _read_split(data.val, 2) for _, p in r) == expected

    cfg = make_config(tmp_path, f"delta.table={table}", "data.decode=cpu", "data.reader=arrow",
                      "data.split_key=content")
    df, pinned = get_engine("delta-rs").read(spark, str(table))
    converted = convert_for_training(spark, df, cfg, 2, class_names_of(df), pinned)
    assert sorted(p for url in converted.val.file_urls
                  for p in pq.read_table(url.replace("file://", ""), columns=["path"]).column(0).to_pylist()) == expected

    gate = held_out_rows(str(table), pinned.version, HoldOut(0.2, "content"))
    by_content = {r["content"]: r["path"] for r in rows}
    assert sorted(by_content[c] for chunk, _ in gate.chunks() for c in chunk) == expected
    assert len(gate.labels) == len(expected)
