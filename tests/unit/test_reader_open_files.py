"""The arrow reader of a converted split keeps at most a few files open per read-ahead thread (the direct reader's
mechanism, one in both), reads every row group whole, and still names a file that is gone or changed."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.readers import ArrowShardReader, pass_order, shard_row_ids
from pipeline.data.shards import ConversionError, ConvertedSplit

GROUP_ROWS = 5


def _converted_split(folder, count, groups_per_file=2) -> ConvertedSplit:
    """`count` files of the converted pixels layout (pixels, label_index int32, row_id), as the converter writes."""
    urls, row_groups = [], []
    for f in range(count):
        rows = GROUP_ROWS * groups_per_file
        ids = [f * 1000 + r for r in range(rows)]
        uri = str(folder / f"part-{f:05d}.parquet")
        pq.write_table(pa.table({"pixels": pa.array([bytes([f % 256, r]) for r in range(rows)], pa.binary()),
                                 "label_index": pa.array([r % 3 for r in range(rows)], pa.int32()),
                                 "row_id": pa.array(ids, pa.int64())}), uri, row_group_size=GROUP_ROWS)
        urls.append(f"file://{uri}")
        row_groups += [(f, g, GROUP_ROWS) for g in range(groups_per_file)]
    return ConvertedSplit("train", f"file://{folder}", urls, row_groups)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc/self/fd")
def test_the_converted_reader_keeps_a_few_files_open_per_thread_and_reads_every_row(tmp_path, monkeypatch):
    from pipeline.data import readers

    monkeypatch.setattr(readers, "OPEN_FILES_PER_THREAD", (4, 4))  # here the limit would allow all 80 open

    split = _converted_split(tmp_path, 80)
    before = _open_fds()
    reader = ArrowShardReader(split, 0, 1, workers=2)
    assert _open_fds() == before
    got, most = [], 0
    for _, group in reader.iter_groups(pass_order(len(reader), 7, 0, True)):  # files in a random order
        got += group.row_id.to_pylist()
        most = max(most, _open_fds() - before)
    assert reader.open_files == 4 and most <= (reader.workers + 1) * 4, f"{most} files open at once"
    assert sorted(got) == [f * 1000 + r for f in range(80) for r in range(2 * GROUP_ROWS)]


def test_a_shard_reads_its_row_groups_as_before(tmp_path):
    split = _converted_split(tmp_path, 7, groups_per_file=3)
    for rank in range(3):
        want = [f * 1000 + g * GROUP_ROWS + r for i, (f, g, _) in enumerate(split.row_groups) if i % 3 == rank
                for r in range(GROUP_ROWS)]
        assert shard_row_ids(split, rank, 3) == want


def test_a_file_gone_or_changed_after_its_footer_was_read_is_named(tmp_path, monkeypatch):
    from pipeline.data import readers

    monkeypatch.setattr(readers, "OPEN_FILES_PER_THREAD", (4, 4))  # a thread's fifth file closes its first
    split = _converted_split(tmp_path, 6)
    reader = ArrowShardReader(split, 0, 1, workers=1)
    reader.read(0)  # file 0's footer read, file 0 open on this thread
    path = split.file_urls[5][len("file://"):]
    os.remove(path)
    with pytest.raises(ConversionError, match=f"converted Parquet file {split.file_urls[5]} row group 0 .*cache clear"):
        reader.read(10)
    reader = ArrowShardReader(split, 0, 1, workers=1)
    reader.read(8)  # file 4's footer read
    for i in range(4):  # file 4 closed on this thread: the least recently read of five
        reader.read(2 * i)
    pq.write_table(pa.table({"pixels": [b"xyz"] * 3, "label_index": pa.array([0] * 3, pa.int32()),
                             "row_id": pa.array([1, 2, 3], pa.int64())}), split.file_urls[4][len("file://"):])
    with pytest.raises(ConversionError, match=f"{split.file_urls[4]} row group 0 .*the file changed"):
        reader.read(8)
