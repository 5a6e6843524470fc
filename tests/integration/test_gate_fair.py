"""A fair gate on a real MLflow SQLite store and real Delta tables: the challenger and the champion are scored only on
rows BOTH held out (each version's own data.val_fraction and data.split_key, read from its run), and a champion
trained on another table is not compared (refused, with the reason in the version's tags).

The models are real networks logged as pyfuncs that always answer one class, so a model's accuracy is exactly that
class's share of the rows it was scored on: the scores say which rows the gate used."""
from __future__ import annotations

import mlflow
import pytest

from pipeline.lakehouse.split import HoldOut, in_split
from pipeline.tracking.gate import promote
from pipeline.tracking.pyfunc import log_model
from pipeline.tracking.registry import register_model
from pipeline.tracking.runs import configure, experiment_id_of
from test_tracking import CLASS_NAMES, META, _always, _cfg, _png, sqlite_store  # noqa: F401

pytestmark = pytest.mark.integration

N_ROWS = 300


def _label(i: int) -> str:
    return CLASS_NAMES[(i * 7 + i // 5) % 3]


def _write_table(root, mount: str) -> str:
    import pyarrow as pa
    from deltalake import write_deltalake

    write_deltalake(str(root), pa.table({"path": [f"{mount}/shapes/{_label(i)}/{i:03d}.png" for i in range(N_ROWS)],
                                         "label": [_label(i) for i in range(N_ROWS)],
                                         "content": [_png(i) for i in range(N_ROWS)]}))
    return str(root)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Two real Delta tables (delta-rs, version 0): the same rows ingested from two mounts, two tables."""
    root = tmp_path_factory.mktemp("fair")
    return _write_table(root / "shapes", "/mnt/a"), _write_table(root / "shapes_elsewhere", "/mnt/b")


@pytest.fixture(scope="module")
def rows(tables):
    from deltalake import DeltaTable

    return DeltaTable(tables[0]).to_pyarrow_table(columns=["path", "label", "content"]).to_pylist()


@pytest.fixture(scope="module")
def registry(sqlite_store):
    uri, artifacts = sqlite_store
    cfg = _cfg(uri, artifacts, "gate-fair")
    client = configure(cfg.mlflow)
    old = mlflow.get_tracking_uri()
    experiment = experiment_id_of(client, cfg.mlflow.experiment)

    def register(name: str, label: str, table: str, params: dict) -> str:
        """A run that trained with `params` (as `lakehouse train` logs its config), its constant model, a version."""
        run_id = client.create_run(experiment).info.run_id
        for key, value in params.items():
            client.log_param(run_id, key, value)
        model_uri = log_model(_always(CLASS_NAMES.index(label)), META, input_example_content=_png(0), run_id=run_id)
        client.set_terminated(run_id)
        return register_model(client, model_uri, name, run_id, {"delta_table": table, "delta_version": "0"})
    try:
        yield client, register
    finally:
        mlflow.set_tracking_uri(old)


def _share(rows, label: str, *rules: HoldOut) -> tuple:
    """(share of `label`, row count) among the rows held out under every one of `rules`."""
    held = [r for r in rows if all(in_split("val", (h,), r["path"], r["content"]) for h in rules)]
    return sum(r["label"] == label for r in held) / len(held), len(held)


def _alias(client, name):
    return str(client.get_model_version_by_alias(name, "champion").version)


@pytest.mark.timeout(600)
def test_champion_at_0_1_and_challenger_at_0_3_are_scored_only_on_rows_neither_trained_on(registry, tables, rows):
    client, register = registry
    name = "fair_fraction"
    champion = register(name, "circle", tables[0], {"data.val_fraction": "0.1", "data.split_key": "content"})
    assert promote(client, name, champion, min_lift=None).promoted  # first version: crowned on its own rows
    challenger = register(name, "square", tables[0], {"data.val_fraction": "0.3", "data.split_key": "content"})

    narrow, wide = HoldOut(0.1, "content"), HoldOut(0.3, "content")
    both_square, n_both = _share(rows, "square", narrow, wide)
    both_circle, _ = _share(rows, "circle", narrow, wide)
    own_square, n_own = _share(rows, "square", wide)
    assert n_own > n_both > 10 and abs(both_square - own_square) > 0.01  # the rows used are visible in the score

    d = promote(client, name, challenger, min_lift=None)
    assert d.value == pytest.approx(both_square) and d.champion_value == pytest.approx(both_circle), d
    assert d.promoted == (both_square > both_circle) and _alias(client, name) == (challenger if d.promoted else
                                                                                   champion)
    tags = client.get_model_version(name, challenger).tags
    assert tags["gate_rows"] == d.rows and f"({n_both} rows; held out by val_fraction 0.1 by content)" in d.rows
    assert float(tags["gate_val_acc"]) == pytest.approx(both_square, abs=1e-5)
    assert float(tags["gate_champion_val_acc"]) == pytest.approx(both_circle, abs=1e-5)


@pytest.mark.timeout(600)
def test_a_champion_split_by_path_before_the_key_existed_is_compared_on_rows_both_rules_hold_out(registry, tables,
                                                                                               rows):
    client, register = registry
    name = "fair_legacy"
    champion = register(name, "triangle", tables[0], {"data.val_fraction": "0.2"})  # no data.split_key: by path
    assert promote(client, name, champion, min_lift=None).promoted
    challenger = register(name, "circle", tables[0], {"data.val_fraction": "0.3", "data.split_key": "content"})

    rules = (HoldOut(0.2, "path"), HoldOut(0.3, "content"))
    share, n = _share(rows, "circle", *rules)
    assert n > 5
    d = promote(client, name, challenger, min_lift=None)
    assert d.value == pytest.approx(share) and d.champion_value == pytest.approx(_share(rows, "triangle", *rules)[0])
    assert f"({n} rows; held out by val_fraction 0.3 by content and val_fraction 0.2 by path)" in d.rows


@pytest.mark.timeout(600)
def test_a_champion_trained_on_another_table_is_not_compared_and_the_reason_is_recorded(registry, tables):
    client, register = registry
    name = "fair_tables"
    params = {"data.val_fraction": "0.2", "data.split_key": "content"}
    champion = register(name, "circle", tables[0], params)
    assert promote(client, name, champion, min_lift=None).promoted
    challenger = register(name, "square", tables[1], params)

    d = promote(client, name, challenger, min_lift=None)
    assert not d.promoted and _alias(client, name) == champion
    assert d.error and "refused" in d.reason and tables[0] in d.reason and tables[1] in d.reason, d.reason
    assert "not comparable" in d.reason and "champion kept" in d.reason
    tags = client.get_model_version(name, challenger).tags
    assert tags["gate_decision"] == d.reason and tags["gate_champion_version"] == champion
    assert tags["gate_champion_val_acc"] == "error"

    same = register(name, "square", tables[0] + "/", params)  # the champion's table, spelled with a trailing slash
    assert promote(client, name, same, min_lift=None).error is None


@pytest.mark.timeout(600)
def test_training_split_in_spark_is_the_gate_s_and_does_not_move_with_the_mount(spark, tables, rows):
    """The split training applies in Spark (pipeline.data.convert.split_frame) holds out the rows the gate scores; by
    content the same images are held out when the table is re-ingested from another mount, by path they are not."""
    import pandas as pd
    from deltalake import DeltaTable

    from pipeline.data.convert import split_frame

    def val_contents(table: str, key: str) -> set:
        df = spark.createDataFrame(pd.DataFrame(DeltaTable(table).to_pyarrow_table().to_pylist()))
        _, val = split_frame(df, 0.3, key)
        return {bytes(r["content"]) for r in val.select("content").collect()}

    by_content = val_contents(tables[0], "content")
    assert by_content == {r["content"] for r in rows if in_split("val", (HoldOut(0.3, "content"),), r["path"],
                                                                 r["content"])}
    assert val_contents(tables[1], "content") == by_content  # re-ingested from /mnt/b: the same rows held out
    assert val_contents(tables[0], "path") != val_contents(tables[1], "path")  # the old rule moved them
