"""Ingest against hostile sources and concurrent writers (real Spark local[2], real delta-rs tables): it reads only
the files it listed, commits against the version it read, and reports its own commit."""
import json
import os
import threading
import time
from collections import Counter

import pytest

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.datapath, pytest.mark.timeout(300)]


def _image(path, shade):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), shade).save(path)


def _ingest(spark, cfg, source, mode="append"):
    from pipeline.lakehouse.ingest import ingest_folder

    return ingest_folder(spark, cfg, str(source), mode=mode)


def _table_rows(cfg):
    from deltalake import DeltaTable

    return DeltaTable(cfg.delta.table).to_pyarrow_table(columns=["path", "label", "label_index"]).to_pylist()


def test_loop_links_and_links_out_are_never_read(spark, tmp_path):
    """Two loop links, a link to /, a link to an outside folder holding a FIFO (reading it would block forever,
    so the ingest finishing proves nothing followed that link) and a file link outside."""
    src, outside = tmp_path / "src", tmp_path / "outside"
    _image(src / "cat" / "a.png", 10)
    _image(src / "dog" / "b.png", 20)
    _image(outside / "o.png", 30)
    os.mkfifo(outside / "trap.png")
    os.symlink(src, src / "loop")
    os.symlink(src / "cat", src / "dog" / "loop2")
    os.symlink("/", src / "root")
    os.symlink(outside, src / "cat" / "out_folder")
    os.symlink(outside / "o.png", src / "dog" / "out.png")
    cfg = make_config(tmp_path)
    started = time.monotonic()
    res = _ingest(spark, cfg, src)
    assert time.monotonic() - started < 120
    assert {(os.path.relpath(r["path"], src), r["label"]) for r in _table_rows(cfg)} == {("cat/a.png", "cat"),
                                                                                         ("dog/b.png", "dog")}
    assert {os.path.relpath(s.path, src): s.reason for s in res.skipped} == {
        "loop": "symlinked_folder", "dog/loop2": "symlinked_folder", "root": "symlink_outside",
        "cat/out_folder": "symlink_outside", "dog/out.png": "symlink_outside"}
    detail = {os.path.relpath(s.path, src): s.detail for s in res.skipped}
    assert str(outside / "o.png") in detail["dog/out.png"] and "outside" in detail["dog/out.png"]


def test_file_swapped_for_a_link_after_the_walk_is_not_read(spark, tmp_path, monkeypatch):
    """Executors re-check each listed file when they read it: one replaced by a link to a file outside the
    source between the walk and the read is reported (not_read, naming where it leads), not ingested."""
    import pipeline.lakehouse.ingest as ingest

    src, outside = tmp_path / "src", tmp_path / "outside"
    _image(src / "cat" / "a.png", 10)
    _image(src / "cat" / "b.png", 20)
    _image(outside / "secret.png", 30)
    real_list = ingest.list_source

    def list_then_swap(*args, **kwargs):
        listing = real_list(*args, **kwargs)
        os.remove(src / "cat" / "a.png")
        os.symlink(outside / "secret.png", src / "cat" / "a.png")
        return listing

    monkeypatch.setattr(ingest, "list_source", list_then_swap)
    cfg = make_config(tmp_path)
    res = _ingest(spark, cfg, src)
    assert [os.path.relpath(r["path"], src) for r in _table_rows(cfg)] == ["cat/b.png"]
    assert [(os.path.relpath(s.path, src), s.reason) for s in res.skipped] == [("cat/a.png", "not_read")]
    assert f"now resolves to {outside / 'secret.png'}, outside {src}" == res.skipped[0].detail


def _race(spark, tmp_path, monkeypatch, sources):
    """Ingest `sources` from one thread each into one table, all past their table read before any commits."""
    from pipeline.lakehouse.delta import DeltaRsEngine

    real_write = DeltaRsEngine.write
    barrier = threading.Barrier(len(sources), timeout=240)
    calls = Counter()

    def write(self, df, table, mode, **kwargs):
        calls[threading.current_thread().name] += 1
        if calls[threading.current_thread().name] == 1:
            barrier.wait()  # every ingest has read the table and assigned its labels
        return real_write(self, df, table, mode, **kwargs)

    monkeypatch.setattr(DeltaRsEngine, "write", write)
    cfg = make_config(tmp_path)
    results, errors = {}, {}

    def run(name, src):
        try:
            results[name] = _ingest(spark, cfg, src)
        except Exception as exc:  # reported by the test
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(name, src), name=name) for name, src in sources.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=280)
    return cfg, results, errors, calls


@pytest.fixture
def base_table(spark, tmp_path):
    base = tmp_path / "base"
    _image(base / "ant" / "1.png", 1)
    _image(base / "bee" / "2.png", 2)
    cfg = make_config(tmp_path)
    assert _ingest(spark, cfg, base).version == 0
    sources = {}
    for i, cls in enumerate(("cow", "dog")):
        _image(tmp_path / cls / cls / "x.png", 100 + i)
        sources[cls] = tmp_path / cls
    return sources


def test_two_ingests_of_new_classes_at_once_get_distinct_label_indices(spark, tmp_path, monkeypatch, base_table):
    from pipeline.lakehouse.ingest import ingest_report

    cfg, results, errors, calls = _race(spark, tmp_path, monkeypatch, base_table)
    assert errors == {}
    assert sorted(calls.values()) == [1, 2]  # the loser of the race re-read the table and committed again
    rows = _table_rows(cfg)
    by_label = {r["label"]: r["label_index"] for r in rows}
    assert len(rows) == 4 and sorted(by_label.values()) == [0, 1, 2, 3]  # one index per class, none shared
    assert {results[c].classes[c] for c in ("cow", "dog")} == {2, 3}
    assert all(results[c].classes[c] == by_label[c] for c in ("cow", "dog"))
    # each reports its own commit: the version whose recorded source is its own
    assert sorted(r.version for r in results.values()) == [1, 2]
    for cls, res in results.items():
        assert ingest_report(None, cfg, res.version)["source"] == str(base_table[cls])


def test_ingest_that_keeps_losing_fails_naming_the_winner(spark, tmp_path, monkeypatch, base_table):
    import pipeline.lakehouse.ingest as ingest
    from deltalake import DeltaTable

    monkeypatch.setattr(ingest, "COMMIT_ATTEMPTS", 1)
    cfg, results, errors, _ = _race(spark, tmp_path, monkeypatch, base_table)
    assert len(results) == 1 and len(errors) == 1
    (winner,) = results.values()
    msg = str(next(iter(errors.values())))
    assert winner.version == 1 and "lost the race to version 1" in msg and "derived from version 0" in msg
    assert "nothing was committed" in msg and "lakehouse.ingest.labels" in msg
    assert DeltaTable(cfg.delta.table).version() == 1 and len(_table_rows(cfg)) == 3
    # the loser's Parquet folder was removed: every folder left holds files of the table
    in_table = {os.path.relpath(u.replace("file://", ""), cfg.delta.table).split(os.sep)[0]
                for u in DeltaTable(cfg.delta.table).file_uris()}
    assert {d for d in os.listdir(cfg.delta.table) if d.startswith("ingest-")} == in_table and len(in_table) == 2


def test_conditional_write_conflicts_with_a_claimant_not_a_blind_append(spark, tmp_path):
    from deltalake import DeltaTable

    from pipeline.lakehouse.delta import ConcurrentWriteError, get_engine

    engine = get_engine("delta-rs")
    table = str(tmp_path / "t")
    df = spark.createDataFrame([(1, "a")], "n int, s string")
    assert engine.write(df, table, "append", read_version=None, claim="k") == 0
    assert engine.write(df, table, "append", read_version=0, claim="k") == 1
    assert engine.write(df, table, "append") == 2  # a blind append, no claim
    folders = sorted(os.listdir(table))
    with pytest.raises(ConcurrentWriteError) as err:
        engine.write(df, table, "append", read_version=0, claim="k")  # derived from 0; 1 claimed "k" since
    assert err.value.winners == [1] and err.value.committed is None
    assert "lost the race to version 1" in str(err.value)
    assert DeltaTable(table).version() == 2 and sorted(os.listdir(table)) == folders  # nothing left behind
    assert engine.write(df, table, "append", read_version=2, claim="k") == 3
    assert engine.write(df, table, "append", read_version=2, claim="other") == 4  # another key: no race
    with pytest.raises(ConcurrentWriteError, match="the table's absence"):
        engine.write(df, table, "append", read_version=None, claim="k")  # it was created meanwhile
    meta = json.loads(DeltaTable(table).history(1)[0]["userMetadata"])
    assert meta["lakehouse.commit"]["claim"] == "other" and meta["lakehouse.commit"]["read_version"] == 2


def test_append_to_a_table_with_one_index_for_two_labels_is_refused(spark, tmp_path):
    """A table already broken by an older race is named, not extended."""
    from pipeline.lakehouse.delta import get_engine
    from pipeline.lakehouse.ingest import IngestError

    cfg = make_config(tmp_path)
    rows = [(f"/x/{label}.png", label, 0, 8, 8, "L", bytes([i])) for i, label in enumerate(("ant", "bee"))]
    df = spark.createDataFrame(rows, "path string, label string, label_index int, width int, height int, "
                                     "mode string, content binary")  # a table of before the digests
    get_engine("delta-rs").write(df, cfg.delta.table, "overwrite")
    _image(tmp_path / "src" / "cow" / "c.png", 5)
    with pytest.raises(IngestError, match=r"version 0: label_index 0 has two labels, 'ant' and 'bee'|"
                                          r"version 0: label_index 0 has two labels, 'bee' and 'ant'"):
        _ingest(spark, cfg, tmp_path / "src")
