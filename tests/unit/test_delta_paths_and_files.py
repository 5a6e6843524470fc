"""Delta log paths become file paths URL-decoded (partition values with a space, `%`, `#` or `:`), the direct reader
stays within the open-file limit on a share of many files, and a direct split's encoded row size counts the whole
files' rows."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.direct import (DirectShardReader, DirectSplit, SplitIndex, decode_row_id, direct_row_ids,
                                  plan_direct, plan_ranges, split_index)
from pipeline.lakehouse.delta import DeltaRsEngine
from pipeline.lakehouse.delta_files import DataFile, DeltaFiles, pin_files

SOURCES = ["cam 1", "50%", "a#b", "x:y", "100% a#b:c d", "plain"]


def _partitioned_table(path, rows_per_source=3) -> int:
    from deltalake import write_deltalake

    n = rows_per_source * len(SOURCES)
    write_deltalake(str(path), pa.table({
        "content": [f"img-{i}".encode() for i in range(n)],
        "label_index": pa.array([i % 2 for i in range(n)], pa.int64()),
        "path": [f"/img/{SOURCES[i % len(SOURCES)]}/{i}.png" for i in range(n)],
        "source": [SOURCES[i % len(SOURCES)] for i in range(n)],
    }), partition_by=["source"])
    return n


def test_a_table_partitioned_by_values_that_need_url_encoding_is_pinned_and_read_whole(tmp_path):
    table = tmp_path / "t"
    n = _partitioned_table(table)
    assert "source=cam%201" in os.listdir(table)  # Hive-escaped on disk, `source=cam%25201` in the log

    pinned = pin_files(str(table))
    assert len(pinned.files) == len(SOURCES) and pinned.num_rows == n
    assert all(os.path.isfile(f.uri) for f in pinned.files)

    data = plan_direct(pinned, split_index(pinned, 0.3, "path"), 1, 2)
    ids = direct_row_ids(data.train, 0, 1) + direct_row_ids(data.val, 0, 1)
    assert sorted(ids) == sorted((f << 32) | r for f, d in enumerate(pinned.files) for r in range(d.rows))
    readers = [DirectShardReader(split, 0, 1) for split in (data.train, data.val)]
    paths = [p for r in readers for _, g in r.iter_groups(range(len(r))) for p in g.path.to_pylist()]
    assert sorted(paths) == sorted(f"/img/{SOURCES[i % len(SOURCES)]}/{i}.png" for i in range(n))

    engine = DeltaRsEngine()
    pin = engine.pin(str(table))
    assert (pin.num_files, pin.num_rows, pin.files_digest) == (len(SOURCES), n, pinned.digest)
    _, groups, _ = engine._snapshot(str(table), None)
    assert {dict(key)["source"] for key in groups} == set(SOURCES)
    for key, files in groups.items():
        value = dict(key)["source"]
        for f in files:
            assert os.path.isfile(f)
            assert set(pq.read_table(f, columns=["path"]).column(0).to_pylist()) <= {
                f"/img/{value}/{i}.png" for i in range(n)}


def test_a_removed_partition_file_is_gone_from_the_later_version_only(tmp_path):
    from deltalake import DeltaTable

    table = tmp_path / "t"
    n = _partitioned_table(table)
    DeltaTable(str(table)).delete("source = 'cam 1'")  # a remove action, its path %-encoded like the add's

    latest, first = pin_files(str(table)), pin_files(str(table), version=0)
    assert (len(first.files), first.num_rows) == (len(SOURCES), n)
    assert (len(latest.files), latest.num_rows) == (len(SOURCES) - 1, n - 3)
    gone = {f.uri for f in first.files} - {f.uri for f in latest.files}
    assert len(gone) == 1 and "cam%201" in gone.pop()
    assert DeltaRsEngine().pin(str(table)).num_files == len(SOURCES) - 1


@pytest.mark.parametrize("path, want", [
    ("source=cam%25201/part-0.parquet", "/t/source=cam%201/part-0.parquet"),
    ("a%20b.parquet", "/t/a b.parquet"),
    ("file:///data/t/source=50%2525/x.parquet", "/data/t/source=50%25/x.parquet"),
    ("file:/data/t/a%23b.parquet", "/data/t/a#b.parquet"),
    ("s3://bucket/t/source=x%253Ay/p.parquet", "s3://bucket/t/source=x%3Ay/p.parquet"),
    ("/abs/t/p%20q.parquet", "/abs/t/p q.parquet"),
])
def test_a_log_path_is_decoded_once_and_joined_onto_the_root(path, want):
    from pipeline.lakehouse.delta_files import log_file_uri

    assert log_file_uri("/t/", path) == want


def _many_files(folder, count, rows=5, row_group=2):
    """`count` small Parquet files of the direct path's columns; (uris, sizes, rows of each)."""
    uris = []
    for i in range(count):
        uri = str(folder / f"part-{i:05d}.parquet")
        pq.write_table(pa.table({"content": [f"{i}-{r}".encode() for r in range(rows)],
                                 "label_index": pa.array([r % 3 for r in range(rows)], pa.int64()),
                                 "path": [f"/img/{i}/{r}.png" for r in range(rows)]}), uri, row_group_size=row_group)
        uris.append(uri)
    return uris, [os.path.getsize(u) for u in uris], [rows] * count


def _split(uris, sizes, counts, world=1):
    # every row but each file's row 1: one chunk a contiguous slice, one a take
    positions = [np.asarray([r for r in range(n) if r != 1], np.int64) for n in counts]
    return DirectSplit("train", uris, sizes, positions, plan_ranges([len(p) for p in positions], world, False))


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc/self/fd")
def test_the_reader_holds_no_file_open_when_made_and_a_few_per_thread_when_reading(tmp_path, monkeypatch):
    from pipeline.data import readers

    monkeypatch.setattr(readers, "OPEN_FILES_PER_THREAD", (4, 4))  # here the limit would allow all 60 open
    uris, sizes, counts = _many_files(tmp_path, 60)
    split = _split(uris, sizes, counts)
    before = _open_fds()
    reader = DirectShardReader(split, 0, 1, workers=2)
    assert _open_fds() == before
    assert reader.open_files == 4
    got = {}
    for _, group in reader.iter_groups(range(len(reader))):
        for rid, content, path in zip(group.row_id.to_pylist(), group.pixels.to_pylist(), group.path.to_pylist()):
            got[decode_row_id(rid)] = (content, path)
        assert _open_fds() - before <= (reader.workers + 1) * reader.open_files
    want = {(f, r): (f"{f}-{r}".encode(), f"/img/{f}/{r}.png") for f, p in enumerate(split.positions) for r in p}
    assert got == want


def test_a_share_of_more_files_than_the_open_file_limit_is_read_whole(tmp_path):
    uris, sizes, counts = _many_files(tmp_path, 400)
    script = textwrap.dedent(f"""
        import resource, sys
        import numpy as np
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from pipeline.data.direct import DirectSplit, direct_row_ids, plan_ranges
        uris, sizes, counts = {uris!r}, {sizes!r}, {counts!r}
        positions = [np.asarray([r for r in range(n) if r != 1], np.int64) for n in counts]
        split = DirectSplit("train", uris, sizes, positions, plan_ranges([len(p) for p in positions], 1, False))
        ids = direct_row_ids(split, 0, 1)
        want = sorted((f << 32) | int(r) for f, p in enumerate(positions) for r in p)
        assert sorted(ids) == want, (len(ids), len(want))
        print("read", len(ids), "rows of", len(uris), "files")
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"read {400 * 4} rows of 400 files" in done.stdout


def test_an_encoded_rows_bytes_are_the_whole_files_bytes_over_both_splits_rows():
    counts, sizes = [100, 40, 60], [10_000, 4_000, 6_000]
    files = tuple(DataFile(f"file:///t/part-{i}.parquet", s, n) for i, (n, s) in enumerate(zip(counts, sizes)))
    pinned = DeltaFiles(table="/t", version=1, files=files, digest="d", min_reader_version=1)
    train, val = [], []
    for n in counts:
        rows = np.arange(n, dtype=np.int64)
        val.append(rows[rows % 5 == 0])
        train.append(rows[rows % 5 != 0])
    data = plan_direct(pinned, SplitIndex(train=train, val=val, split_key="path", val_fraction=0.2), 2, 4)
    assert data.train.encoded_row_bytes() == data.val.encoded_row_bytes() == 100  # 20,000 bytes over 200 rows


@pytest.mark.parametrize("folder, want", [
    ("source=cam 1", {"source": "cam 1"}),  # a space is not escaped (but on Windows)
    ("source=50%25", {"source": "50%"}),
    ("source=100%25 a%23b%3Ac d", {"source": "100% a#b:c d"}),
    ("source=x%2Fy%3Dz/day=2024-01-01 10%3A00%3A00", {"source": "x/y=z", "day": "2024-01-01 10:00:00"}),
    ("a%3Db=é ü", {"a=b": "é ü"}),
    ("source=__HIVE_DEFAULT_PARTITION__", {"source": None}),
    (".", {}),
])
def test_a_spark_partition_folder_gives_the_delta_logs_unescaped_values(folder, want):
    from pipeline.lakehouse.delta_rs import hive_partition_values

    assert hive_partition_values(folder) == want
