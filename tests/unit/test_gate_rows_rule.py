"""The fair gate's pure selection rule: rows held out by every compared version (per split key the smaller fraction,
under different keys each key's rule), the split keys, and each version's own recorded rule with its fallbacks."""
from __future__ import annotations

import hashlib
import zlib
from types import SimpleNamespace

import pytest

from pipeline.lakehouse.split import (LEGACY_SPLIT_KEY, SPLIT_BUCKETS, HoldOut, held_out_by_all, in_split,
                                      is_validation, row_key, split_bucket, split_rule)
from pipeline.tracking.heldout import _same_table, comparable, holdout_of
from pipeline.tracking.registry import RegistryError

ROWS = [(f"/mnt/a/img/{i}.png", f"image-{i}".encode()) for i in range(2000)]


def _held(rules, split="val"):
    return {p for p, c in ROWS if in_split(split, held_out_by_all(rules, split), p, c)}


def test_same_key_takes_the_smaller_fraction_which_is_the_intersection():
    assert held_out_by_all([HoldOut(0.3, "content"), HoldOut(0.1, "content")]) == (HoldOut(0.1, "content"),)
    narrow, wide = _held([HoldOut(0.1, "content")]), _held([HoldOut(0.3, "content")])
    assert narrow < wide and _held([HoldOut(0.3, "content"), HoldOut(0.1, "content")]) == narrow
    assert 0.07 < len(narrow) / len(ROWS) < 0.13 and 0.26 < len(wide) / len(ROWS) < 0.34


def test_different_keys_hold_a_row_out_only_when_both_rules_do():
    rules = held_out_by_all([HoldOut(0.2, "path"), HoldOut(0.3, "content")])
    assert rules == (HoldOut(0.3, "content"), HoldOut(0.2, "path"))  # sorted by key: any order gives the same
    assert rules == held_out_by_all([HoldOut(0.3, "content"), HoldOut(0.2, "path")])
    both = _held([HoldOut(0.2, "path"), HoldOut(0.3, "content")])
    assert both == _held([HoldOut(0.2, "path")]) & _held([HoldOut(0.3, "content")]) and both


def test_train_rows_are_those_no_version_held_out():
    rules = [HoldOut(0.1, "content"), HoldOut(0.2, "path")]
    train = _held(rules, "train")
    assert train == {p for p, _ in ROWS} - _held([rules[0]]) - _held([rules[1]])


def test_train_rows_under_one_key_are_those_the_largest_fraction_trained_on():
    """Two versions split by content at 0.1 and 0.5: the rows both trained on are outside the 0.5 version's
    validation (the smaller fraction would take in rows the 0.5 version held out)."""
    rules = [HoldOut(0.1, "content"), HoldOut(0.5, "content")]
    assert held_out_by_all(rules, "train") == (HoldOut(0.5, "content"),)
    train = _held(rules, "train")
    assert train == {p for p, _ in ROWS} - _held([rules[1]]) and not train & _held([rules[1]])
    assert 0.45 < len(train) / len(ROWS) < 0.55


def test_a_stored_digest_is_the_content_key_where_it_has_the_form_of_one():
    path, content = "/mnt/a/cat/1.png", b"\x89PNG bytes"
    real, other = hashlib.sha256(content).hexdigest(), hashlib.sha256(b"other").hexdigest()
    assert row_key("content", path, content, real) == real
    assert row_key("content", path, None, other) == other  # read instead of the bytes: they need not be there
    for bad in (None, real.upper(), real[:-1], real + "0", b"\x00" * 32, 7):
        assert row_key("content", path, content, bad) == real  # not a digest's form: the bytes are hashed
    assert row_key("path", path, content, other) == path
    assert in_split("val", (HoldOut(1.0, "content"),), path, None, other) is True


def test_split_keys():
    path, content = "/mnt/a/cat/1.png", b"\x89PNG bytes"
    assert row_key("content", path, content) == hashlib.sha256(content).hexdigest()
    assert row_key("content", "/elsewhere/cat/1.png", content) == row_key("content", path, content)  # mount-free
    assert row_key("path", path, content) == path
    assert split_bucket(row_key("content", path, content)) == \
        zlib.crc32(hashlib.sha256(content).hexdigest().encode()) % SPLIT_BUCKETS
    assert in_split("val", (HoldOut(1.0, "content"),), path, None) is False  # no key value: in no split
    assert in_split("train", (HoldOut(0.0, "content"),), path, None) is False
    assert is_validation(path, 0.2) == in_split("val", (HoldOut(0.2, "path"),), path, None)
    assert LEGACY_SPLIT_KEY == "path" and split_rule("path") == f"crc32(path) % {SPLIT_BUCKETS}"  # old cache keys
    for bad in (lambda: held_out_by_all([HoldOut(0.2, "md5")]), lambda: row_key("md5", path, content),
                lambda: split_rule("md5"), lambda: held_out_by_all([])):
        with pytest.raises(ValueError):
            bad()


class _Client:
    """Answers get_run with the params of one run."""

    def __init__(self, params):
        self.params = params

    def get_run(self, run_id):
        return SimpleNamespace(data=SimpleNamespace(params=self.params))


def _mv(version="2", run_id="r", **tags):
    return SimpleNamespace(version=version, run_id=run_id, tags=tags)


def test_each_version_s_own_rule_with_clear_fallbacks():
    assert holdout_of(_Client({"data.val_fraction": "0.1", "data.split_key": "content"}), _mv(), 0.2) == \
        HoldOut(0.1, "content")
    # a run before data.split_key existed: split by path; no recorded fraction: the gate's configured one
    assert holdout_of(_Client({}), _mv(), 0.25) == HoldOut(0.25, "path")
    assert holdout_of(_Client({"data.val_fraction": "x"}), _mv(), 0.25) == HoldOut(0.25, "path")
    # the version's own tags win over its run's params
    tagged = _mv(**{"data.val_fraction": "0.3"})
    assert holdout_of(_Client({"data.val_fraction": "0.1"}), tagged, 0.2).val_fraction == 0.3
    with pytest.raises(RegistryError, match="data.split_key='md5'"):
        holdout_of(_Client({"data.split_key": "md5"}), _mv(), 0.2)


def test_tables_compared_by_what_they_are_not_how_they_are_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _same_table("work/delta/t", str(tmp_path / "work/delta/t"))
    assert _same_table(f"file://{tmp_path}/work/delta/t/", "work/delta/t")
    assert _same_table("Main.ML.Images", "main.ml.images")
    assert not _same_table("work/delta/t", "work/delta/u")
    assert not _same_table("s3://bucket/a", "s3://bucket/b") and _same_table("s3://bucket/a/", "s3://bucket/a")
    a = _mv("1", delta_table="work/delta/t", delta_version="3")
    assert comparable("m", a, _mv("2", delta_table=str(tmp_path / "work/delta/t"), delta_version="5")) is None
    why = comparable("m", a, _mv("2", delta_table="/mnt/b/delta/t", delta_version="3"))
    assert why.startswith("refused") and "/mnt/b/delta/t" in why and "work/delta/t" in why


@pytest.mark.parametrize("by", ["label", "camera"])
def test_the_gate_reads_a_partitioned_tables_rows_and_their_partition_values(tmp_path, by):
    """A table partitioned by its label (a class per folder) or by another column (values needing URL-encoding):
    the gate's rows are the version's every row under the rule, with the label a partition column gives, read in
    bounded chunks. delta-rs's own dataset could not be opened on such a table with the classic profile's pyarrow."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from pipeline.tracking.heldout import held_out_rows

    n = 300
    rows = [(f"/mnt/a/img/{i}.png", f"image-{i}".encode(), f"class {i % 3}", ["cam 1", "50%", "a#b"][i % 3 > 0])
            for i in range(n)]
    write_deltalake(str(tmp_path / "t"), pa.table({
        "path": [r[0] for r in rows], "content": [r[1] for r in rows], "label": [r[2] for r in rows],
        "camera": [r[3] for r in rows]}), partition_by=[by])
    rule = HoldOut(0.3, "path")
    got = held_out_rows(str(tmp_path / "t"), 0, rule)
    want = {(p, lab) for p, c, lab, _ in rows if in_split("val", (rule,), p, c)}
    assert 0 < len(want) < n and sorted(got.labels) == sorted(lab for _, lab in want)
    chunks = list(got.chunks(32))
    assert all(0 < len(contents) <= 32 for contents, _ in chunks)
    by_content = {c: lab for contents, labels in chunks for c, lab in zip(contents, labels)}
    assert by_content == {c: lab for p, c, lab, _ in rows if (p, lab) in want}
