"""What an append reads of the table before assigning label indices: another writer's rows with a null label or
label_index are refused naming the table, version and column (no Spark: a stand-in table)."""
from __future__ import annotations

import pytest

from pipeline.lakehouse.delta import PinnedTable
from pipeline.lakehouse.ingest import _table_state
from pipeline.lakehouse.source import IngestError


class _Rows:
    def __init__(self, rows):
        self.rows = rows

    def distinct(self):
        return self

    def collect(self):
        return self.rows


class _Frame:
    columns = ["path", "label", "label_index"]  # no content column: nothing to hash

    def __init__(self, rows):
        self.rows = rows

    def select(self, *cols):
        assert cols == ("label", "label_index")
        return _Rows(self.rows)


class _Engine:
    def __init__(self, rows):
        self.rows = rows

    def exists(self, spark, table):
        return True

    def read(self, spark, table):
        return _Frame(self.rows), PinnedTable(table=table, version=7, num_files=1, num_rows=len(self.rows))


def test_the_classes_of_a_table_are_read_with_their_indices():
    state = _table_state(_Engine([{"label": "cat", "label_index": 0}, {"label": "dog", "label_index": 1}]), None,
                         "/t/digits", "append")
    assert (state.version, state.classes, state.known) == (7, {"cat": 0, "dog": 1}, None)


@pytest.mark.parametrize("row, column", [({"label": "cat", "label_index": None}, "label_index"),
                                         ({"label": None, "label_index": 2}, "label")])
def test_a_null_label_or_label_index_of_another_writer_is_refused_naming_table_and_column(row, column):
    rows = [{"label": "dog", "label_index": 1}, row]
    with pytest.raises(IngestError) as err:
        _table_state(_Engine(rows), None, "/t/digits", "append")
    assert f"Delta table /t/digits version 7: column '{column}' is null" in str(err.value)
