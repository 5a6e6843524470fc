"""The direct path's pure logic: the row-level plan over a table's own files, the protocol check, the filesystem a URI
and its storage options build, and data.source's validation."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.config_parse import ConfigError
from pipeline.data.direct import SplitIndex, plan_direct, plan_ranges
from pipeline.lakehouse import delta_files
from pipeline.lakehouse.delta_files import DataFile, DeltaFiles, check_direct_readable
from pipeline.lakehouse.partition import PlanError


def _covered(runs, counts):
    """Every (file, row) the runs cover, as a list (duplicates kept)."""
    return [(f, i) for rank in runs for f, start, stop in rank for i in range(start, stop)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_shares_are_equal_and_a_multiple_of_world(world):
    counts = [7, 0, 1, 250, 3, 0, 41]  # uneven files, empty ones among them
    runs = plan_ranges(counts, world, drop_remainder=True)
    rows = [sum(stop - start for _, start, stop in r) for r in runs]
    assert rows == [sum(counts) // world] * world
    covered = _covered(runs, counts)
    assert len(covered) == len(set(covered)) == sum(counts) // world * world
    assert all(0 <= start < stop <= counts[f] for r in runs for f, start, stop in r)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_val_shares_cover_every_row_once_within_one_row(world):
    counts = [5, 0, 11, 2]
    runs = plan_ranges(counts, world, drop_remainder=False)
    rows = [sum(stop - start for _, start, stop in r) for r in runs]
    assert max(rows) - min(rows) <= 1
    covered = _covered(runs, counts)
    assert sorted(covered) == [(f, i) for f, n in enumerate(counts) for i in range(n)]


def test_one_large_file_is_split_between_ranks_at_the_row_level():
    runs = plan_ranges([1000, 10, 10], 2, drop_remainder=True)
    assert runs == [[(0, 0, 510)], [(0, 510, 1000), (1, 0, 10), (2, 0, 10)]]


def test_plan_is_deterministic():
    counts = list(np.random.default_rng(3).integers(0, 500, 200))
    assert plan_ranges(counts, 3, True) == plan_ranges(list(counts), 3, True)


def _pinned(counts):
    files = tuple(DataFile(f"file:///t/part-{i:05d}.parquet", 100 * n, int(n)) for i, n in enumerate(counts))
    return DeltaFiles(table="/t", version=4, files=files, digest="d", min_reader_version=1)


def _index(counts, val_every=5):
    train, val = [], []
    for n in counts:
        rows = np.arange(n, dtype=np.int64)
        val.append(rows[rows % val_every == 0])
        train.append(rows[rows % val_every != 0])
    return SplitIndex(train=train, val=val, split_key="path", val_fraction=0.2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_direct_gives_equal_steps_and_keeps_every_val_row(world):
    counts = [97, 3, 1, 400, 12]
    data = plan_direct(_pinned(counts), _index(counts), world, batch_size=8)
    assert len(set(data.plan.train.rows_per_rank)) == 1
    assert data.train.rows == data.plan.train.total_rows == sum(data.plan.train.rows_per_rank)
    assert data.left_out == sum(_index(counts).counts("train")) % world
    assert data.val.rows == sum(_index(counts).counts("val"))
    assert data.plan.train.steps_per_epoch == data.plan.train.rows_per_rank[0] // 8
    for rank in range(world):  # a rank's rows are the split's own rows of each file
        for f, rows in data.train.rank_rows(rank):
            assert np.all(rows % 5 != 0) and np.all(rows < counts[f])
    assert data.lineage()["files_digest"] == "d" and data.lineage()["source"] == "direct"


def test_plan_direct_refuses_a_rank_without_rows():
    counts = [2]
    with pytest.raises(PlanError, match="rank"):
        plan_direct(_pinned(counts), _index(counts, val_every=100), 3, batch_size=8)


def test_a_million_rows_in_uneven_files_plan_in_seconds(capsys):
    rng = np.random.default_rng(0)
    counts = []
    while sum(counts) < 1_000_000:  # files of 1 to 2,000 rows, as appends and compactions leave them
        counts.append(int(rng.integers(1, 2_000)))
    counts[-1] -= sum(counts) - 1_000_000
    tracemalloc.start()
    t0 = time.perf_counter()
    pinned = _pinned(counts)
    data = plan_direct(pinned, _index(counts), 3, batch_size=64)
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    with capsys.disabled():
        print(f"\ndirect plan: 1,000,000 rows in {len(counts)} files over 3 ranks in {elapsed:.3f} s, "
              f"peak {peak / 2 ** 20:.1f} MB traced")
    assert sum(data.plan.train.rows_per_rank) + data.left_out + data.val.rows == 1_000_000
    assert elapsed < 10
    assert peak < 500 * 2 ** 20


@pytest.mark.parametrize("features, mode, named", [
    (["deletionVectors"], None, "deletionVectors"),
    (["columnMapping"], "name", "columnMapping (mode name"),
    ([], "id", "columnMapping (mode id"),
    (["someFutureFeature"], None, "someFutureFeature"),
])
def test_unreadable_features_are_refused_naming_table_and_feature(features, mode, named):
    with pytest.raises(ConfigError) as err:
        check_direct_readable("/data/t", 3, features, mode)
    assert "/data/t" in str(err.value) and named in str(err.value)


def test_safe_features_and_mode_none_are_read():
    check_direct_readable("/data/t", 3, ["timestampNtz", "columnMapping"], "none")
    check_direct_readable("/data/t", 1, None, None)


class _Recorder:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __call__(self, **kwargs):
        self.calls.append((self.name, kwargs))
        return self.name


def test_uri_and_storage_options_reach_the_filesystem(monkeypatch):
    import pyarrow.fs as pafs

    calls = []
    for name in ("S3FileSystem", "GcsFileSystem", "AzureFileSystem"):
        monkeypatch.setattr(pafs, name, _Recorder(calls, name), raising=False)
    fs, path = delta_files.arrow_filesystem(
        "s3://bucket/tables/t/part-0.parquet",
        {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_REGION": "eu-west-1",
         "AWS_ENDPOINT_URL": "http://minio:9000", "AWS_ALLOW_HTTP": "true"})
    assert (fs, path) == ("S3FileSystem", "bucket/tables/t/part-0.parquet")
    assert calls[-1][1] == {"access_key": "AK", "secret_key": "SK", "region": "eu-west-1",
                            "endpoint_override": "http://minio:9000", "scheme": "http"}
    fs, path = delta_files.arrow_filesystem("gs://b/t/x.parquet", {"google_anonymous": "true",
                                                                   "google_endpoint_url": "http://gcs:4443"})
    assert (fs, path) == ("GcsFileSystem", "b/t/x.parquet")
    assert calls[-1][1] == {"anonymous": True, "endpoint_override": "http://gcs:4443"}
    fs, path = delta_files.arrow_filesystem("abfss://cont@acct.dfs.core.windows.net/t/x.parquet",
                                            {"azure_storage_account_key": "KEY"})
    assert (fs, path) == ("AzureFileSystem", "cont/t/x.parquet")
    assert calls[-1][1] == {"account_name": "acct", "account_key": "KEY"}
    fs, path = delta_files.arrow_filesystem("file:///tmp/t/x.parquet", {"AWS_REGION": "ignored"})
    assert isinstance(fs, pafs.LocalFileSystem) and path == "/tmp/t/x.parquet"


def test_an_unknown_scheme_is_refused_naming_the_uri():
    with pytest.raises(ConfigError, match="hdfs://nn/t/x.parquet"):
        delta_files.arrow_filesystem("hdfs://nn/t/x.parquet")


def test_storage_options_stay_out_of_the_repr():
    pinned = DeltaFiles(table="/t", version=0, files=(), digest="d", min_reader_version=1,
                        storage_options={"AWS_SECRET_ACCESS_KEY": "very-secret"})
    assert "very-secret" not in repr(pinned)


def test_data_source_is_validated_naming_the_key():
    assert load_config(overrides=["data.source=direct", "data.decode=cpu"]).data.source == "direct"
    assert load_config().data.source == "converted"
    with pytest.raises(ConfigError, match="'data.source'.*not one of converted, direct"):
        load_config(overrides=["data.source=copy"])
    with pytest.raises(ConfigError, match="'data.source'.*data.decode"):
        load_config(overrides=["data.source=direct", "data.decode=convert"])


def test_a_table_without_a_column_the_ranks_read_is_refused_naming_it():
    from pipeline.data.direct import split_index
    from pipeline.data.shards import ConversionError

    pinned = DeltaFiles(table="/t", version=2, files=(), digest="d", min_reader_version=1,
                        columns=("path", "label", "label_index", "content"), partition_columns=("label_index",))
    with pytest.raises(ConversionError, match="/t version 2.*label_index"):
        split_index(pinned, 0.2, "path")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_run_plan_derived_from_a_direct_plan_keeps_its_shares(world):
    from pipeline.data.plan import derive_plan

    counts = [97, 3, 1, 400, 12]
    data = plan_direct(_pinned(counts), _index(counts), world, batch_size=8)
    cfg = load_config(overrides=["data.source=direct", "data.decode=cpu", "data.batch_size=8",
                                 "data.min_steps_per_epoch=0"])
    plan = derive_plan(cfg, data, world_size=world)
    assert plan.shards.train.rows_per_rank == data.plan.train.rows_per_rank
    assert plan.shards.val.rows_per_rank == data.plan.val.rows_per_rank
    assert plan.steps_per_epoch == data.plan.train.steps_per_epoch
