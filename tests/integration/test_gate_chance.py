"""The gate's chance floor on a real MLflow SQLite store and a real Delta table: real networks logged as pyfuncs,
registered, and scored by the gate on the table's val rows. A network no better than a constant guess is registered
but not crowned, even as the first version, and says why in its tags; a network that learned is crowned. A catalog
table is split in Spark before anything is collected, to the same rows as delta-rs reads."""
from __future__ import annotations

import dataclasses
import io
import math

import mlflow
import numpy as np
import pytest

from pipeline.tracking.pyfunc import log_model
from pipeline.lakehouse.split import LEGACY_SPLIT_KEY, HoldOut
from pipeline.tracking.heldout import chance_level, held_out_rows
from pipeline.tracking.registry import register_model
from pipeline.tracking.runs import configure, tracked_run
from test_tracking import CLASS_NAMES, META, _always, _cfg, sqlite_store  # noqa: F401

pytestmark = pytest.mark.integration

SHADES = {"circle": 20, "square": 128, "triangle": 235}  # each class a grey level: a net learns it in seconds


def _shade_png(label: str, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = np.clip(SHADES[label] + rng.integers(-15, 16, (20, 20)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def _label(i: int) -> str:  # unbalanced: 1/2, 1/3, 1/6, so the majority share is well above 1/3
    return CLASS_NAMES[0] if i % 6 < 3 else CLASS_NAMES[1] if i % 6 < 5 else CLASS_NAMES[2]


@pytest.fixture(scope="module")
def shades_table(tmp_path_factory) -> str:
    """A real Delta table (delta-rs, version 0) of 120 labelled PNGs (path, label, content) a tiny CNN can learn."""
    import pyarrow as pa
    from deltalake import write_deltalake

    root = tmp_path_factory.mktemp("chance") / "shades"
    labels = [_label(i) for i in range(120)]
    write_deltalake(str(root), pa.table({"path": [f"/data/shades/{lab}/{i:03d}.png" for i, lab in enumerate(labels)],
                                         "label": labels,
                                         "content": [_shade_png(lab, i) for i, lab in enumerate(labels)]}))
    return str(root)


def _learned(table: str):
    """A real network of the META shape fitted to every row of `table` (Adam, then BatchNorm population statistics)."""
    import torch
    from deltalake import DeltaTable

    from pipeline.data.transforms import decode_batch
    from pipeline.model.nets import build_network

    rows = DeltaTable(table).to_pyarrow_table(columns=["content", "label"]).to_pylist()
    x = torch.from_numpy(decode_batch([r["content"] for r in rows], META["image_size"], 1))
    y = torch.tensor([CLASS_NAMES.index(r["label"]) for r in rows])
    torch.manual_seed(0)
    net = build_network("cnn", 1, len(CLASS_NAMES), width=META["width"])
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    net.train()
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None
    with torch.no_grad():
        net(x)
    return net.eval()


@pytest.fixture(scope="module")
def gate(sqlite_store, shades_table):
    """(cfg, client, register(net) -> version) for one registered model per test on the SQLite store."""
    uri, artifacts = sqlite_store
    cfg = _cfg(uri, artifacts, "gate-chance")
    client = configure(cfg.mlflow)
    old = mlflow.get_tracking_uri()

    def register(name: str, net, role: str) -> str:
        with tracked_run(cfg, run_name=role) as run:
            model_uri = log_model(net, META, input_example_content=_shade_png("circle", 0), run_id=run.run_id)
            return register_model(run.client, model_uri, name, run.run_id,
                                  {"delta_table": shades_table, "delta_version": "0"})
    try:
        yield cfg, client, register
    finally:
        mlflow.set_tracking_uri(old)


def _holder(client, name):
    try:
        return str(client.get_model_version_by_alias(name, "champion").version)
    except mlflow.exceptions.MlflowException:
        return None


@pytest.mark.timeout(600)
def test_first_version_at_chance_is_registered_not_crowned_and_a_learned_one_is(gate, shades_table):
    """`lakehouse promote` (pipeline.workflow.promote_version) with the config's gate keys, `mlflow.gate_min_lift`
    at its default: the first version, a constant guess of the majority class, scores exactly chance and is left
    registered without the alias, tagged with the chance level; then a network that learned is crowned."""
    from pipeline.workflow import promote_version

    cfg, client, register = gate
    name = "chance_acc"
    gcfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, registered_model=name))
    assert gcfg.mlflow.gate_min_lift == 0.05 and gcfg.mlflow.gate_metric == "val_acc"
    val = held_out_rows(shades_table, 0, HoldOut(gcfg.data.val_fraction, LEGACY_SPLIT_KEY))  # runs with no params
    chance = chance_level("val_acc", "max", val.labels)
    majority = max(CLASS_NAMES, key=val.labels.count)
    assert 0.34 < chance < 0.9, (chance, val.labels)

    v1 = register(name, _always(CLASS_NAMES.index(majority)), "constant")
    d1 = promote_version(gcfg, v1)
    assert not d1["promoted"] and d1["value"] == pytest.approx(chance) and d1["chance"] == pytest.approx(chance), d1
    assert d1["champion_version"] is None and _holder(client, name) is None
    assert {str(v.version) for v in client.search_model_versions(f"name='{name}'")} == {v1}  # still registered
    tags = client.get_model_version(name, v1).tags
    assert float(tags["gate_chance_val_acc"]) == pytest.approx(chance, abs=1e-5) and tags["gate_min_lift"] == "0.05"
    assert tags["gate_decision"] == d1["reason"]
    for needle in (f"val_acc={chance:g} does not beat chance val_acc={chance:g}", "majority class",
                   "mlflow.gate_min_lift 0.05", "not promoted"):
        assert needle in d1["reason"], (needle, d1["reason"])

    v2 = register(name, _learned(shades_table), "learned")
    d2 = promote_version(gcfg, v2)
    assert d2["promoted"] and d2["value"] > chance + 0.05 and _holder(client, name) == v2, d2
    assert f"beats chance {chance:g}" in d2["reason"]
    assert float(client.get_model_version(name, v2).tags["gate_chance_val_acc"]) == pytest.approx(chance, abs=1e-5)

    v3 = register(name, _always(CLASS_NAMES.index(majority)), "constant-again")  # under the floor, champion kept
    d3 = promote_version(gcfg, v3)
    assert not d3["promoted"] and d3["champion_version"] == v2 and _holder(client, name) == v2
    assert f"champion version {v2} kept" in d3["reason"]


@pytest.mark.timeout(600)
def test_loss_gate_floor_is_the_label_entropy(gate, shades_table):
    """val_loss in min mode: a constant, confident guess scores far above the labels' entropy and is not crowned; the
    learned network's cross-entropy is well under it and is."""
    from pipeline.workflow import promote_version

    cfg, client, register = gate
    name = "chance_loss"
    gcfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, registered_model=name,
                                                               gate_metric="val_loss", gate_mode="min"))
    val = held_out_rows(shades_table, 0, HoldOut(gcfg.data.val_fraction, LEGACY_SPLIT_KEY))  # runs with no params
    entropy = chance_level("val_loss", "min", val.labels)
    shares = [val.labels.count(c) / len(val.labels) for c in CLASS_NAMES]
    assert entropy == pytest.approx(-sum(p * math.log(p) for p in shares if p))

    v1 = register(name, _always(0), "constant")
    d1 = promote_version(gcfg, v1)
    assert not d1["promoted"] and d1["value"] > entropy and _holder(client, name) is None, d1
    assert "entropy" in d1["reason"] and "lower is better" in d1["reason"]
    assert float(client.get_model_version(name, v1).tags["gate_chance_val_loss"]) == pytest.approx(entropy, abs=1e-5)

    v2 = register(name, _learned(shades_table), "learned")
    d2 = promote_version(gcfg, v2)
    assert d2["promoted"] and d2["value"] < entropy - 0.05 and _holder(client, name) == v2, d2


@pytest.mark.timeout(600)
def test_catalog_table_is_split_in_spark_and_streamed_in_chunks(spark, shades_table, monkeypatch):
    """A three-part catalog name goes through the Spark session: the split (pipeline.data.convert.held_out_frame, the
    rule training uses) and the column selection run in Spark, so the driver receives only the split's rows, streamed
    (toLocalIterator) in chunks, never collected whole; they are exactly the rows delta-rs gives for the path. This
    machine has no Delta jars (Maven is unreachable), so the catalog's read of the table is a real Spark DataFrame of
    the same rows, with one extra column."""
    from deltalake import DeltaTable

    from pipeline.lakehouse.delta import PinnedTable, SparkDeltaEngine

    name = "main.ml.shades"
    whole = DeltaTable(shades_table).to_pyarrow_table().to_pandas()
    whole["label_index"] = [CLASS_NAMES.index(v) for v in whole["label"]]
    frame = spark.createDataFrame(whole)
    reads, streamed = [], []
    DataFrame = type(frame)  # pyspark's classic DataFrame (pyspark.sql.DataFrame is its interface in Spark 4)

    def read(self, session, table, version=None):
        reads.append((table, version))
        return frame, PinnedTable(table=table, version=version, num_files=-1, num_rows=None)

    local_iterator = DataFrame.toLocalIterator

    def counted(self, *args, **kwargs):
        rows = list(local_iterator(self, *args, **kwargs))
        streamed.append((len(rows), list(self.columns)))
        return iter(rows)

    def whole_collect(self, *args, **kwargs):
        raise AssertionError("the gate collected a whole DataFrame")

    monkeypatch.setattr(SparkDeltaEngine, "read", read)
    monkeypatch.setattr(DataFrame, "toLocalIterator", counted)
    monkeypatch.setattr(DataFrame, "toPandas", whole_collect)
    sizes = {}
    for split, rule in (("val", 0.2), ("train", 0.2), ("val", (HoldOut(0.3, "content"), HoldOut(0.2, "path")))):
        by_path = held_out_rows(shades_table, 0, rule, split)
        by_name = held_out_rows(name, 0, rule, split)
        chunks = list(by_name.chunks(7))
        assert all(len(c) <= 7 and len(c) == len(lab) for c, lab in chunks)
        assert (sorted(zip(by_name.labels, [c for cs, _ in chunks for c in cs])) ==
                sorted(zip(by_path.labels, [c for cs, _ in by_path.chunks(7) for c in cs]))), split
        assert by_name.table == name and by_name.split == split and by_name.rule == by_path.rule
        sizes[(split, str(rule))] = len(by_name.labels)
    assert reads == [(name, 0)] * 3
    assert sizes[("val", "0.2")] + sizes[("train", "0.2")] == 120 and 0 < sizes[("val", "0.2")] < 60
    # what reached the driver: the split's labels, then its rows for one pass, only the gate's columns
    assert streamed[:2] == [(sizes[("val", "0.2")], ["label"]), (sizes[("val", "0.2")], ["content", "label"])]
