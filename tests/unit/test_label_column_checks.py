"""The label column is checked before any rank starts: the direct path refuses a table whose content, label_index or
path column has a type the ranks cannot read, naming the file, column and type; both paths' class names refuse a null,
non-integer, negative or too large label_index and one index with two labels, naming the file (or table) and a row's
path. Correct tables keep their class names."""
from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.data.convert import class_names_of
from pipeline.data.shards import ConversionError

MAX_CLASSES = 1_000_000  # convert.MAX_CLASSES: label_index 0 .. 999,999


def _table(where, labels, names=None, **types):
    """A Delta table written by delta-rs: one row per label_index value, path /img/<row>.png."""
    from deltalake import write_deltalake

    from pipeline.lakehouse.delta_files import pin_files

    n = len(labels)
    names = names if names is not None else [f"n{v}" if isinstance(v, int) else "x" for v in labels]
    write_deltalake(str(where), pa.table({
        "content": pa.array([f"img-{i}".encode() for i in range(n)], types.get("content", pa.binary())),
        "label": names,
        "label_index": pa.array(labels, types.get("label_index", pa.int32())),
        "path": pa.array([f"/img/{i}.png" for i in range(n)], types.get("path", pa.string())),
    }))
    return pin_files(str(where))


# ---- the direct path: column types at planning time ----

@pytest.mark.parametrize("column, kind, values", [
    ("label_index", pa.string(), ["0", "1", "0", "1"]),
    ("label_index", pa.float64(), [0.0, 1.0, 0.0, 1.0]),
    ("content", pa.string(), None),
    ("path", pa.binary(), None),
])
def test_a_column_of_a_type_the_ranks_cannot_read_is_refused_when_planning(tmp_path, column, kind, values):
    from pipeline.data.direct import split_index
    from pipeline.data.source import direct_readable

    pinned = _table(tmp_path / "t", values or [0, 1, 0, 1], **{column: kind})
    with pytest.raises(ConversionError) as err:
        split_index(pinned, 0.5, "path")
    message = str(err.value)
    assert f"column {column} has type {kind}" in message and pinned.files[0].uri in message, message
    ok, why = direct_readable(str(tmp_path / "t"))
    assert not ok and f"column {column} has type {kind}" in why, why


def test_a_text_label_index_is_refused_in_the_file_that_holds_it(tmp_path):
    """The first file is right, a later one (another writer's) holds label_index as text: split_index names it."""
    import os

    import pyarrow.parquet as pq

    from pipeline.data.direct import split_index
    from pipeline.lakehouse.delta_files import DataFile, DeltaFiles

    files = []
    for i, labels in enumerate([pa.array([0, 1], pa.int32()), pa.array(["0", "1"])]):
        uri = str(tmp_path / f"part-{i}.parquet")
        pq.write_table(pa.table({"content": [b"a", b"b"], "label": ["n0", "n1"], "label_index": labels,
                                 "path": [f"/img/{i}-0.png", f"/img/{i}-1.png"]}), uri)
        files.append(DataFile(uri, os.path.getsize(uri), 2))
    pinned = DeltaFiles(table=str(tmp_path), version=0, files=tuple(files), digest="d", min_reader_version=1,
                        columns=("content", "label", "label_index", "path"))
    with pytest.raises(ConversionError, match=f"{files[1].uri}: column label_index has type string"):
        split_index(pinned, 0.5, "path")


@pytest.mark.parametrize("kind", [pa.int8(), pa.int32(), pa.int64(), pa.uint16()])
def test_integer_labels_binary_content_and_text_paths_are_planned_as_before(tmp_path, kind):
    from pipeline.data.direct import plan_direct, split_index
    from pipeline.data.source import class_names_direct, direct_readable

    pinned = _table(tmp_path / "t", [0, 1, 2, 1] * 5, label_index=kind)
    index = split_index(pinned, 0.5, "path")
    assert sum(index.counts("train")) + sum(index.counts("val")) == 20
    plan_direct(pinned, index, 1, 2)
    assert direct_readable(str(tmp_path / "t"))[0]
    assert class_names_direct(pinned) == ["n0", "n1", "n2"]


def test_large_types_are_read_as_before(tmp_path):
    from pipeline.data.direct import split_index

    pinned = _table(tmp_path / "t", [0, 1] * 4, content=pa.large_binary(), path=pa.large_string())
    split_index(pinned, 0.5, "path")


# ---- class names: the direct path ----

@pytest.mark.parametrize("labels, bad, what", [
    ([0, None, 1, 0], 1, "is null"),
    ([0, 1, -1, 0], 2, "is -1, outside 0..999999"),
    ([0, 1, 0, 3_000_000], 3, "is 3000000, outside 0..999999"),
    ([0, 1, 0, MAX_CLASSES], 3, f"is {MAX_CLASSES}, outside"),
])
def test_a_label_index_no_class_can_have_is_refused_naming_the_file_and_row(tmp_path, labels, bad, what):
    from pipeline.data.source import class_names_direct

    pinned = _table(tmp_path / "t", labels, names=["n"] * len(labels), label_index=pa.int64())
    with pytest.raises(ConversionError) as err:
        class_names_direct(pinned)
    message = str(err.value)
    assert pinned.files[0].uri in message and f"row {bad} (path '/img/{bad}.png')" in message, message
    assert f"column label_index {what}" in message, message


def test_one_label_index_with_two_labels_is_refused_naming_both_rows(tmp_path):
    from pipeline.data.source import class_names_direct

    pinned = _table(tmp_path / "t", [0, 1, 0, 1], names=["cat", "dog", "cat", "bird"])
    with pytest.raises(ConversionError) as err:
        class_names_direct(pinned)
    message = str(err.value)
    assert "label_index 1 has two labels, 'dog'" in message and "'bird'" in message, message
    assert "(path '/img/1.png')" in message and "(path '/img/3.png')" in message, message


def test_the_largest_index_allowed_and_a_gap_keep_their_names(tmp_path):
    from pipeline.data.source import class_names_direct

    pinned = _table(tmp_path / "t", [0, 3, 0, 3], names=["a", "d", "a", "d"])
    assert class_names_direct(pinned) == ["a", "class_1", "class_2", "d"]


# ---- class names: the converted path (class_names_of over a DataFrame) ----

class _Row(tuple):
    """A Spark Row's two ways in: by position and by column name."""

    def __new__(cls, names, values):
        row = super().__new__(cls, values)
        row.names = list(names)
        return row

    def __getitem__(self, key):
        return tuple.__getitem__(self, self.names.index(key) if isinstance(key, str) else key)


class _Frame:
    """The few DataFrame calls class names make, with Spark's meaning (min skips nulls; null keys group together)."""

    def __init__(self, rows, columns):
        self.rows, self.columns = rows, list(columns)

    def select(self, *cols):
        return _Frame([{c: r[c] for c in cols} for r in self.rows], cols)

    def distinct(self):
        seen = {tuple(r[c] for c in self.columns): r for r in self.rows}
        return _Frame(list(seen.values()), self.columns)

    def groupBy(self, *cols):  # noqa: N802 - Spark's name
        frame = self

        class Grouped:
            def agg(self, how):
                (col, fn), = how.items()
                assert fn == "min"
                groups = {}
                for r in frame.rows:
                    groups.setdefault(tuple(r[c] for c in cols), []).append(r[col])
                name = f"min({col})"
                return _Frame([{**dict(zip(cols, k)), name: min((v for v in vs if v is not None), default=None)}
                               for k, vs in groups.items()], [*cols, name])
        return Grouped()

    def collect(self):
        return [_Row(self.columns, [r[c] for c in self.columns]) for r in self.rows]


def _frame(labels, names, with_path=True):
    rows = [{"label": n, "label_index": i, "path": f"/img/{r}.png", "content": b""}
            for r, (n, i) in enumerate(zip(names, labels))]
    columns = ["path", "label", "label_index", "content"] if with_path else ["label", "label_index", "content"]
    return _Frame([{c: r[c] for c in columns} for r in rows], columns)


@pytest.mark.parametrize("labels, bad, what", [
    ([0, None, 1], 1, "is null"),
    ([0, -1, 1], 1, "is -1, outside"),
    ([0, 3_000_000, 1], 1, "is 3000000, outside"),
    ([0, "x", 1], 1, "is 'x', not an integer"),
])
def test_the_converted_paths_class_names_refuse_the_same_indices_naming_the_table_and_row(labels, bad, what):
    with pytest.raises(ConversionError) as err:
        class_names_of(_frame(labels, ["a", "b", "c"]))
    message = str(err.value)
    assert f"the row with path '/img/{bad}.png': column label_index {what}" in message, message


def test_the_converted_paths_class_names_refuse_an_index_with_two_labels():
    with pytest.raises(ConversionError, match=r"label_index 0 has two labels, 'a' .*'/img/0.png'.* and 'b' .*"
                                              r"'/img/2.png'"):
        class_names_of(_frame([0, 1, 0], ["a", "c", "b"]))


def test_the_converted_path_names_the_table_and_version():
    from types import SimpleNamespace

    from pipeline.data.convert import _class_names_to_train

    with pytest.raises(ConversionError, match=r"^Delta table /t version 4, the row with path '/img/1.png': column "
                                              r"label_index is -1"):
        _class_names_to_train(_frame([0, -1], ["a", "b"]), SimpleNamespace(table="/t", version=4))


def test_the_converted_paths_class_names_of_a_correct_table_are_as_before():
    assert class_names_of(_frame([2, 0, 2, 0], ["c", "a", "c", "a"])) == ["a", "class_1", "c"]
    assert class_names_of(_frame([1, 0], ["b", "a"], with_path=False)) == ["a", "b"]
    assert class_names_of(_frame(["1", "0"], ["b", "a"])) == ["a", "b"]  # a text index Spark casts, as before
    assert class_names_of(_Frame([], ["path", "label", "label_index"])) == []


def test_the_bound_on_classes_is_a_million():
    from pipeline.data import convert

    assert convert.MAX_CLASSES == MAX_CLASSES
