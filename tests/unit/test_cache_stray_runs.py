"""Unit tests of an entry's size (pipeline.data.cache.entry_bytes): the `run-*` folders its manifest does not name (a
conversion that failed midway and was retried, the loser of two concurrent conversions, one still writing) count in
`lakehouse cache ls` and against `data.cache_max_gb`, and are never deleted but with their entry. Real files in a
temporary folder, no Spark."""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.data import cache
from pipeline.data.leases import JobLeases
from pipeline.data.shards import FORMAT_VERSION

KB = 2 ** 10


def _write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)


def _entry(cache_dir: str, key: str, run: str, part_bytes: int, last_used: float) -> Path:
    """A complete entry as the converter leaves it: marked, one part file per split in `run`, the manifest last."""
    url = cache.entry_url(cache_dir, key)
    cache.mark_entry(url)
    folder = Path(url[len("file://"):])
    splits = {}
    for name in ("train", "val"):
        _write(folder / run / name / "part-00000.parquet", part_bytes)
        splits[name] = {"folder": f"{run}/{name}", "rows": 1,
                        "files": [{"name": "part-00000.parquet", "bytes": part_bytes, "row_groups": [1]}]}
    cache.write_manifest(url, {"format": FORMAT_VERSION, "created": last_used, "last_used": last_used,
                               "inputs": {"table": "t", "version": 0}, "splits": splits})
    return folder


def _on_disk(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _bytes(cache_dir: str, key: str) -> int:
    [entry] = [e for e in cache.list_entries(cache_dir) if e["key"] == key]
    return entry["bytes"]


def test_a_stray_run_folder_counts_in_the_entrys_size(tmp_path):
    """A first conversion failed midway (a finished part file and a temporary stay in its run folder), the retry
    wrote the manifest: the entry's size is its whole folder, not only the files the manifest lists."""
    cache_dir = str(tmp_path / "cache")
    folder = _entry(cache_dir, "k", "run-2-retry", 100 * KB, 1.0)
    _write(folder / "run-1-failed" / "train" / "part-00000.parquet", 700 * KB)
    _write(folder / "run-1-failed" / "train" / ".part-00001.parquet.0-abcdef.tmp", 300 * KB)
    assert _bytes(cache_dir, "k") == _on_disk(folder) > 1200 * KB
    assert (folder / "run-1-failed").is_dir()  # counted, not deleted: listing changes nothing


def test_the_size_bound_evicts_by_what_entries_hold_on_disk(tmp_path):
    """Two entries of 200 KB by their manifests, one with a 2 MB leftover run: over a 1.5 MB bound, the leftover's
    entry (least recently used, not in use) is evicted whole, its stray run with it."""
    cache_dir = str(tmp_path / "cache")
    old = _entry(cache_dir, "old", "run-b", 100 * KB, 1000.0)
    _write(old / "run-a" / "train" / "part-00000.parquet", 2048 * KB)
    _entry(cache_dir, "new", "run-c", 100 * KB, 2000.0)
    assert cache.enforce_bound(cache_dir, 1.5 / 1024, keep="new") == ["old"]
    assert not old.exists()
    assert [e["key"] for e in cache.list_entries(cache_dir)] == ["new"]


def test_a_run_being_written_is_never_removed(tmp_path):
    """Job A converts entry `busy` into run-a (its lease held, part files still being written) while job B converted
    the same entry into run-b and wrote the manifest: run-a is counted, and neither the manifest's write, the size
    bound nor `cache clear` deletes it while A holds the entry."""
    cache_dir = str(tmp_path / "cache")
    with JobLeases("train job-a") as job_a:
        cache.take_lease(job_a, cache_dir, "busy")  # as convert_for_training does, before it marks and converts
        url = cache.entry_url(cache_dir, "busy")
        cache.mark_entry(url)
        folder = Path(url[len("file://"):])
        _write(folder / "run-a" / "train" / "part-00000.parquet", 512 * KB)
        _write(folder / "run-a" / "train" / ".part-00001.parquet.0-123456.tmp", 512 * KB)
        _entry(cache_dir, "busy", "run-b", 64 * KB, 3000.0)  # job B: files, then the manifest (the last one wins)
        _entry(cache_dir, "idle", "run-i", 64 * KB, 1.0)
        before = _on_disk(folder / "run-a")
        assert _bytes(cache_dir, "busy") == _on_disk(folder) > 1024 * KB
        assert cache.enforce_bound(cache_dir, 1e-9, keep="idle") == []  # busy is held
        assert cache.clear(cache_dir, ["busy"])["kept"][0]["key"] == "busy"
        cache.touch(url, cache.read_manifest(url))  # a third job's cache hit rewrites the manifest
        assert _on_disk(folder / "run-a") == before
        _write(folder / "run-a" / "val" / "part-00000.parquet", 256 * KB)  # A goes on writing
        assert _bytes(cache_dir, "busy") == _on_disk(folder)
    assert cache.clear(cache_dir, ["busy"])["cleared"] == ["busy"]  # released: it goes, all its runs with it
    assert not folder.exists()


def _incomplete(cache_dir: str, key: str, part_bytes: int) -> Path:
    """An entry whose conversion died (or still writes): marked, a finished part file and a temporary, no manifest."""
    url = cache.entry_url(cache_dir, key)
    cache.mark_entry(url)
    folder = Path(url[len("file://"):])
    _write(folder / "run-x" / "train" / "part-00000.parquet", part_bytes)
    _write(folder / "run-x" / "train" / ".part-00001.parquet.0-abcdef.tmp", part_bytes)
    return folder


def test_an_incomplete_entry_is_listed_with_its_folders_size(tmp_path):
    cache_dir = str(tmp_path / "cache")
    folder = _incomplete(cache_dir, "died", 300 * KB)
    [entry] = cache.list_entries(cache_dir)
    assert (entry["key"], entry["complete"]) == ("died", False)
    assert entry["bytes"] == _on_disk(folder) > 600 * KB
    _write(folder / "run-x" / "val" / "part-00000.parquet", 100 * KB)  # still writing: the size follows
    assert _bytes(cache_dir, "died") == _on_disk(folder)


def test_the_size_bound_counts_an_incomplete_entry_and_never_evicts_it(tmp_path, caplog):
    """Two complete entries of 200 KB and an incomplete one of 2 MB, under a 1.5 MB bound: the complete ones alone fit,
    but with the incomplete one counted the least recently used complete entry (not `keep`) is evicted; the
    incomplete one stays (another job may be writing it), named in a warning as what keeps the cache above."""
    cache_dir = str(tmp_path / "cache")
    old = _entry(cache_dir, "old", "run-a", 100 * KB, 1000.0)
    new = _entry(cache_dir, "new", "run-b", 100 * KB, 2000.0)
    writing = _incomplete(cache_dir, "writing", 1024 * KB)
    assert cache.enforce_bound(cache_dir, 1.5 / 1024, keep="new") == ["old"]
    assert not old.exists() and new.exists() and writing.exists()
    assert {(e["key"], e["complete"]) for e in cache.list_entries(cache_dir)} == {("new", True), ("writing", False)}
    assert "writing (2.0 MB)" in caplog.text and "1 incomplete entry" in caplog.text
    assert cache.enforce_bound(cache_dir, 1e-9, keep="new") == []  # nothing left it may evict
    assert writing.exists()
