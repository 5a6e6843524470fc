"""The pure parts of pipeline.explore (frames, grids, notebook set-up) and the notebooks' shape: parameters first, no logic."""
from __future__ import annotations

import ast
import io
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from pipeline import explore

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["01_explore_table.ipynb", "02_train.ipynb", "03_review_registry.ipynb"]


def test_history_frame_orders_versions_and_reads_both_engines_timestamps():
    entries = [
        {"version": 1, "timestamp": datetime(2026, 1, 2, 3, 4, 5), "operation": "WRITE"},  # delta-spark
        {"version": 0, "timestamp": 1_700_000_000_000, "operation": "CREATE TABLE"},  # delta-rs (ms)
        {"timestamp": 1, "operation": "no version"},
    ]
    frame = explore.history_frame(entries, {0: 600, 1: None})
    assert list(frame.columns) == explore.HISTORY_COLUMNS
    assert list(frame["version"]) == [0, 1]
    assert frame.loc[0, "timestamp"] == pd.Timestamp(1_700_000_000_000, unit="ms")
    assert frame.loc[1, "timestamp"] == pd.Timestamp("2026-01-02 03:04:05")
    assert frame.loc[0, "rows"] == 600 and pd.isna(frame.loc[1, "rows"])
    assert str(frame["rows"].dtype) == "Int64"


def test_history_frame_of_nothing_is_empty_with_the_columns():
    frame = explore.history_frame([])
    assert frame.empty and list(frame.columns) == explore.HISTORY_COLUMNS


def test_balance_frame_fractions_sum_to_one_in_label_index_order():
    frame = explore.balance_frame([{"label": "b", "label_index": 1, "rows": 30},
                                   {"label": "a", "label_index": 0, "rows": 10}])
    assert list(frame.columns) == explore.BALANCE_COLUMNS
    assert list(frame["label"]) == ["a", "b"]
    assert frame["fraction"].tolist() == pytest.approx([0.25, 0.75])


def test_balance_frame_of_an_empty_table():
    frame = explore.balance_frame([])
    assert frame.empty and list(frame.columns) == explore.BALANCE_COLUMNS


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 8, 8), (8, 8)])
def test_grid_figure_has_one_titled_cell_per_image(shape):
    images = [np.full(shape, i * 20, dtype=np.uint8) for i in range(5)]
    fig = explore.grid_figure(images, [f"c{i}" for i in range(5)], cols=4)
    axes = fig.get_axes()
    assert len(axes) == 8  # 2 rows of 4
    assert [ax.get_title() for ax in axes[:5]] == [f"c{i}" for i in range(5)]
    assert all(not ax.images for ax in axes[5:])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")  # renders without a display
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_grid_figure_refuses_mismatched_titles():
    with pytest.raises(ValueError, match="2 image"):
        explore.grid_figure([np.zeros((8, 8), np.uint8)] * 2, ["one"])


def _mv(version, tags, run_id="r", status="READY", created=1_700_000_000_000):
    return SimpleNamespace(version=str(version), tags=tags, run_id=run_id, status=status,
                           creation_timestamp=created)


def test_versions_frame_newest_first_with_aliases_lineage_and_metric():
    versions = [_mv(1, {"delta_table": "/t", "delta_version": "0", "val_acc": "0.5"}),
                _mv(2, {"delta_table": "/t", "delta_version": "3", "val_acc": "0.9", "gate_decision": "promoted"}),
                _mv(3, {"val_acc": "not a number"})]
    frame = explore.versions_frame(versions, {"2": ["champion", "best"]}, "val_acc")
    assert list(frame["version"]) == [3, 2, 1]
    row = frame[frame["version"] == 2].iloc[0]
    assert row["aliases"] == "best,champion"
    assert row["delta_version"] == 3 and row["val_acc"] == pytest.approx(0.9)
    assert row["gate_decision"] == "promoted"
    assert pd.isna(frame[frame["version"] == 3].iloc[0]["val_acc"])
    assert pd.isna(frame[frame["version"] == 3].iloc[0]["delta_version"])
    assert "val_acc" in frame.columns and "delta_table" in frame.columns


def test_predictions_frame_marks_correct_rows():
    rows = pd.DataFrame({"path": ["a.png", "b.png"], "label": ["one", "two"], "content": [b"", b""]})
    predicted = pd.DataFrame({"label": ["one", "six"], "probability": [0.9, 0.4]})
    frame = explore.predictions_frame(rows, predicted)
    assert list(frame.columns) == ["path", "label", "predicted", "probability", "correct"]
    assert frame["correct"].tolist() == [True, False]


def test_project_root_is_found_from_a_subfolder(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "base.yaml").write_text("{}\n")
    (tmp_path / "notebooks").mkdir()
    assert explore.project_root(str(tmp_path / "notebooks")) == tmp_path.resolve()
    assert explore.project_root(str(ROOT / "notebooks")) == ROOT


def test_notebook_config_reads_the_profile_from_the_project_root(monkeypatch):
    monkeypatch.chdir(ROOT / "notebooks")
    cfg = explore.notebook_config("conf/local.yaml", ["train.np=-2", "", "train.max_epochs=1"])
    assert cfg.train.max_epochs == 1 and cfg.train.np == -2
    assert Path.cwd() == ROOT  # relative paths in the profile mean what they mean for `lakehouse`


def _code_cells(name):
    import nbformat

    nb = nbformat.read(str(ROOT / "notebooks" / name), as_version=4)
    nbformat.validate(nb)
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_parameters_come_first_and_read_the_environment(name):
    cells = _code_cells(name)
    assert "parameters" in cells[0].metadata.get("tags", [])
    assert "LAKEHOUSE_CONF" in cells[0].source and "LAKEHOUSE_OVERRIDES" in cells[0].source
    assert all(not c.get("outputs") for c in cells), "notebooks are committed without outputs"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_cells_hold_no_logic(name):
    for cell in _code_cells(name)[1:]:
        tree = ast.parse(cell.source)
        for node in ast.walk(tree):
            assert not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.For, ast.While, ast.If, ast.With,
                                         ast.ListComp, ast.Lambda)), f"{name}: logic in cell {cell.source!r}"
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        assert len(calls) <= 1, f"{name}: more than one call in cell {cell.source!r}"


def test_the_train_notebook_trains_with_two_local_processes_by_default():
    cells = _code_cells("02_train.ipynb")
    assert "train.np=-2" in cells[0].source
    assert any("workflow.train(spark, cfg)" in c.source for c in cells)


def test_run_history_has_one_row_per_epoch_without_system_or_event_series(monkeypatch):
    """MLflow's system metrics are stepped by sample (0..5 in a 3-epoch run) and restarts/oom_backoffs by their count:
    none of them is an epoch, so none makes a row."""
    def m(key, step, value):
        return SimpleNamespace(key=key, step=step, value=value)

    history = {
        "val_loss": [m("val_loss", e, 1.0 - e / 10) for e in range(3)],
        "train_loss": [m("train_loss", e, 2.0 - e / 10) for e in range(3)],
        "system/cpu_utilization_percentage": [m("system/cpu_utilization_percentage", s, 50.0) for s in range(6)],
        "system/system_memory_usage_megabytes": [m("system/system_memory_usage_megabytes", s, 9.0) for s in range(6)],
        "restarts": [m("restarts", 1, 1.0)],
        "oom_backoffs": [m("oom_backoffs", 1, 1.0), m("oom_backoffs", 2, 2.0)],
        "world_size": [m("world_size", 0, 1.0)],
    }

    class Client:
        def get_run(self, run_id):
            return SimpleNamespace(data=SimpleNamespace(metrics={k: v[-1].value for k, v in history.items()}))

        def get_metric_history(self, run_id, key):
            return history[key]

    monkeypatch.setattr(explore, "_client", lambda cfg: Client())
    frame = explore.run_history(None, "run-1")
    assert list(frame.index) == [0, 1, 2] and frame.index.name == "epoch"
    assert sorted(frame.columns) == ["train_loss", "val_loss"]
    assert frame["val_loss"].tolist() == pytest.approx([1.0, 0.9, 0.8])


def test_the_notebooks_stop_only_a_session_the_pipeline_started(monkeypatch):
    """A notebook on Databricks (or beside any session already there) adopts that session and must leave it running;
    one the pipeline started is stopped at the end. Each notebook's own cells run here, with stand-in sessions."""
    import re

    import pipeline.lakehouse.spark as spark_mod
    from pipeline.lakehouse.spark import session_of

    class Session:
        def __init__(self):
            self.stopped = False
            self.conf = SimpleNamespace(get=lambda key, default=None: default)

        def stop(self):
            self.stopped = True

    cfg = explore.notebook_config("conf/local.yaml", chdir=False)
    for name in [*NOTEBOOKS, "04_tune.ipynb"]:
        cells = _code_cells(name)
        setup = [c.source for c in cells if "from pipeline.lakehouse.spark import" in c.source]
        made = [c.source for c in cells if re.search(r"^spark = ", c.source, re.M)]
        assert setup and made and "spark" in cells[-1].source, name
        for adopted in (True, False):
            there, ours = Session(), Session()
            monkeypatch.setattr(spark_mod, "active_session", lambda: there if adopted else None)
            monkeypatch.setattr(spark_mod, "_create", lambda cfg: ours)
            scope = {"cfg": cfg}
            for source in setup + made:
                exec(compile(source, name, "exec"), scope)
            session = session_of(scope["spark"])  # a step that needs the session
            assert session is (there if adopted else ours)
            exec(compile(cells[-1].source, name, "exec"), scope)
            assert there.stopped is False, f"{name} stopped a session it did not start"
            assert ours.stopped is (not adopted), f"{name} left its own session running"
