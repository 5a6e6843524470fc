"""Many jobs at once on one Delta table, one converted-data cache and one registry: two `train`s, two `predict`s to one
output table, two `ingest --mode append`s each adding a new class, a 2-trial `tune` and a `cache clear`, all real
`lakehouse` processes (Spark local, delta-rs, an `mlflow server` on 127.0.0.1). Afterwards every job finished (or
failed naming what it lost its race to), each writer reported its own commit, label indices are one per class, the
champion is the best candidate on the same rows, and no entry a running job read was deleted."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Dict

import numpy as np
import pytest

from conftest import ROOT, available_readers, cli, make_config, start_mlflow_server, stop_mlflow_server
from test_cache_leases import _convert

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = "concurrent_clf"
BASE = {"dark": 30, "mid": 128, "light": 225}  # each class one grey level (+ noise): a small CNN learns it in an epoch
NEW = {"dim": 80, "bright": 180}  # the classes the two ingests add, one each
PER_CLASS = 40
JOB_TIMEOUT_S = 900
# A job that fails must say what it lost its race to (nothing here is expected to fail).
LOST_RACE = re.compile(r"lost the race to|lost its race|held by|in use by|moved")


def _shade_pngs(folder: Path, label: str, shade: int, n: int, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / label).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels = np.clip(shade + rng.integers(-12, 13, (16, 16)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / label / f"{label}_{i:03d}.png")


def _overrides(tmp: Path, uri: str, table: Path) -> list:
    """The settings every job shares: one table, one cache, one registry (tiny images, one process per job)."""
    reader = ["data.reader=arrow"] if available_readers() == ["arrow"] else []
    return [f"delta.table={table}", f"data.cache_dir={tmp}/cache", f"train.checkpoint_dir={tmp}/checkpoints",
            f"mlflow.tracking_uri={uri}", f"mlflow.registered_model={MODEL}", "mlflow.experiment=concurrency",
            "data.image_size=16", "data.batch_size=8", "model.width=8", "train.backend=single", "train.np=1",
            "train.threads_per_rank=1", "train.warmup_epochs=0", "spark.master=local[1]", *reader]


def _register_first_champion(cfg, table: Path, content: bytes) -> str:
    """Version 1, an untrained network over the base classes, holds the alias when the jobs start (predict scores
    with it). Its run records the jobs' config, as a train's does: the gate reads its held-out rule from there."""
    import torch

    from pipeline.model.module import network_meta
    from pipeline.model.nets import build_network
    from pipeline.tracking.lineage import log_config
    from pipeline.tracking.pyfunc import log_model
    from pipeline.tracking.registry import register_model
    from pipeline.tracking.runs import configure, experiment_id_of

    client = configure(cfg.mlflow)
    run_id = client.create_run(experiment_id_of(client, cfg.mlflow.experiment)).info.run_id
    log_config(client, run_id, cfg)
    torch.manual_seed(0)
    net = build_network("cnn", 1, len(BASE), width=8).eval()
    uri = log_model(net, network_meta(cfg.model, 1, 16, sorted(BASE)), input_example_content=content, run_id=run_id)
    version = register_model(client, uri, MODEL, run_id, {"delta_table": str(table), "delta_version": "0"})
    client.set_registered_model_alias(MODEL, "champion", version)
    client.set_terminated(run_id)
    return version


class Job:
    """One `lakehouse` process: output in files, start and end times kept."""

    def __init__(self, name: str, args: list, logs: Path):
        self.name, self.args = name, args
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cli(*args), stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
        self.started, self.ended = time.time(), None

    def poll(self) -> bool:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.time()
        return self.ended is not None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)

    @property
    def result(self) -> dict:
        lines = self.out.read_text().strip().splitlines()
        return json.loads(lines[-1]) if lines else {}

    @property
    def log(self) -> str:
        return self.err.read_text()

    def entries_read(self) -> set:
        """The cache entries this job's log says it read (a hit, or its own conversion)."""
        return set(re.findall(r"(?:cache hit: |rows into )\S*/([0-9a-f]{24})\b", self.log))


def _held_entries(cache_dir: str) -> list:
    from pipeline.data.cache import list_entries

    return [e for e in list_entries(cache_dir) if e["held_by"]]


def _accuracy(uri: str, contents, labels) -> float:
    import mlflow.pyfunc
    import pandas as pd

    out = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame({"content": contents}), params={"on_error": "null"})
    return float(np.mean([p == t for p, t in zip(out["label"], labels)]))


def test_everything_at_once_on_one_table_cache_and_registry(spark, tmp_path):
    server, uri = start_mlflow_server(tmp_path)
    try:
        _everything_at_once(spark, tmp_path, uri)
    finally:
        stop_mlflow_server(server)


def _everything_at_once(spark, tmp_path, uri):
    import pyarrow.parquet as pq
    from deltalake import DeltaTable
    from mlflow import MlflowClient

    from pipeline.data import cache
    from pipeline.lakehouse.delta import commit_files
    from pipeline.lakehouse.ingest import ingest_folder, ingest_report

    src, table, logs = tmp_path / "src", tmp_path / "delta" / "shades", tmp_path / "logs"
    logs.mkdir()
    for i, (label, shade) in enumerate(BASE.items()):
        _shade_pngs(src, label, shade, PER_CLASS, seed=i)
    new_sources = {}
    for i, (label, shade) in enumerate(NEW.items()):
        _shade_pngs(tmp_path / f"new_{label}", label, shade, PER_CLASS // 2, seed=10 + i)
        new_sources[label] = tmp_path / f"new_{label}"
    jobs: Dict[str, Job] = {}
    try:
        common = _overrides(tmp_path, uri, table)
        cfg = make_config(tmp_path, *common)
        assert ingest_folder(spark, cfg, str(src)).version == 0
        base_classes = {label: i for i, label in enumerate(sorted(BASE))}
        first = _register_first_champion(cfg, table, next(src.glob("*/*.png")).read_bytes())
        # an entry no job uses (another image size): the clear may delete it
        idle = _convert(spark, make_config(tmp_path, *common, "data.image_size=12"), table)
        space = tmp_path / "lr.yaml"  # the sweep's trials barely move from their initial weights
        space.write_text("params:\n  model.lr: {type: float, low: 1.0e-9, high: 2.0e-9, log: true}\n")
        conf = ["--conf", str(ROOT / "conf/local.yaml"), *common]
        out_table = tmp_path / "delta" / "predictions"

        starts = {
            "train_good": ["train", "--run-name", "good", *conf, "model.lr=0.02", "train.max_epochs=3"],
            "train_weak": ["train", "--run-name", "weak", *conf, "model.lr=1.0e-9", "train.max_epochs=1"],
            "predict_a": ["predict", "--model", f"models:/{MODEL}@champion", "--table", str(table), "--out",
                          str(out_table), "--run-key", "a", *conf],
            "predict_b": ["predict", "--model", f"models:/{MODEL}@champion", "--table", str(table), "--out",
                          str(out_table), "--run-key", "b", *conf],
            **{f"ingest_{label}": ["ingest", "--source", str(path), "--mode", "append", *conf]
               for label, path in new_sources.items()},
            "tune": ["tune", "--space", str(space), "--trials", "2", *conf, "train.max_epochs=1",
                     "tune.study=concurrent", f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.sampler=random",
                     "tune.pruner=none"],
        }
        for name, args in starts.items():
            jobs[name] = Job(name, args, logs)
        # `cache clear` once a running job holds an entry (or at the latest after 4 minutes)
        deadline = time.monotonic() + 240
        while not _held_entries(cfg.data.cache_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        held_at_clear = {e["key"]: [h["pid"] for h in e["held_by"]] for e in _held_entries(cfg.data.cache_dir)}
        jobs["cache_clear"] = Job("cache_clear", ["cache", "clear", *conf], logs)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not all([j.poll() for j in jobs.values()]) and time.monotonic() < deadline:  # each polled: end times
            time.sleep(1)
        stuck = [n for n, j in jobs.items() if not j.poll()]
        assert not stuck, f"jobs still running after {JOB_TIMEOUT_S} s: {stuck}"
    finally:
        for job in jobs.values():
            job.kill()

    # every job finished, or failed saying what it lost its race to
    failed = {n: j.log[-3000:] for n, j in jobs.items() if j.proc.returncode != 0}
    assert all(LOST_RACE.search(text) for text in failed.values()), failed
    assert not failed, {n: t[-800:] for n, t in failed.items()}  # here every race has a way to finish
    r = {n: j.result for n, j in jobs.items()}
    durations = {n: round(j.ended - j.started) for n, j in jobs.items()}
    print(f"\njob durations (s): {durations}")

    # ingest: each reports its own commit; one label index per class, every class keeps its name
    dt = DeltaTable(str(table))
    rows = dt.to_pyarrow_table(columns=["path", "label", "label_index"]).to_pylist()
    mapping = {(row["label"], row["label_index"]) for row in rows}
    by_label = dict(mapping)
    assert len(mapping) == len(by_label) == len({i for _, i in mapping}) == 5, sorted(mapping)
    assert {k: by_label[k] for k in BASE} == base_classes and {by_label[k] for k in NEW} == {3, 4}
    assert sorted(r[f"ingest_{k}"]["delta_version"] for k in NEW) == [1, 2]
    for label, path in new_sources.items():
        version = r[f"ingest_{label}"]["delta_version"]
        assert r[f"ingest_{label}"]["classes"][label] == by_label[label]
        assert ingest_report(None, cfg, version)["source"] == str(path)
        assert r[f"ingest_{label}"]["rows_written"] == PER_CLASS // 2
    rows_at = {v: DeltaTable(str(table), version=v).to_pyarrow_table(columns=["path"]).num_rows for v in (0, 1, 2)}

    # predict: both appended, each its own commit with its own rows (those of the input version it pinned)
    preds = [r["predict_a"], r["predict_b"]]
    assert sorted(p["out_version"] for p in preds) == [0, 1] and not any(p["already_in_table"] for p in preds)
    for key, p in zip("ab", preds):
        assert p["rows"] == rows_at[p["input_version"]] and p["errors"] == 0, p
        files = commit_files(str(out_table), p["out_version"])
        own = [pq.read_table(f, columns=["input_version", "path"]) for f in files]
        assert sum(t.num_rows for t in own) == p["rows"]
        assert {v for t in own for v in t.column("input_version").to_pylist()} == {p["input_version"]}
        meta = json.loads(DeltaTable(str(out_table)).history()[-1 - p["out_version"]]["userMetadata"])
        assert meta["lakehouse.predict"]["run_key"] == key

    # train and tune: the version each pinned is the one its registered model records, and it read that version
    client = MlflowClient(uri)
    trained = {n: r[n] for n in ("train_good", "train_weak")}
    for name, summary in trained.items():
        assert summary["rows_train"] + summary["rows_val"] == rows_at[summary["delta_version"]], summary
        tags = client.get_model_version(MODEL, str(summary["model_version"])).tags
        assert tags["delta_version"] == str(summary["delta_version"]) and tags["run_id"] == summary["run_id"]
    assert r["tune"]["complete"] == 2 and r["tune"]["model_version"] is not None, r["tune"]

    # the champion is the best of every candidate, all scored on the same rows (every row of version 0)
    import mlflow

    mlflow.set_tracking_uri(uri)
    base_rows = DeltaTable(str(table), version=0).to_pyarrow_table(columns=["content", "label"]).to_pylist()
    contents, labels = [x["content"] for x in base_rows], [x["label"] for x in base_rows]
    candidates = [first] + [str(s["model_version"]) for s in trained.values()] + [str(r["tune"]["model_version"])]
    scores = {v: _accuracy(f"models:/{MODEL}/{v}", contents, labels) for v in candidates}
    champion = str(client.get_model_version_by_alias(MODEL, "champion").version)
    best = max(scores.values())
    print(f"same-rows accuracy by version: {scores}; champion {champion}")
    gates = [line for j in jobs.values() for line in j.log.splitlines() if "promotion:" in line]
    assert scores[champion] == best and best > 0.9, (champion, scores, gates)
    assert champion == str(r["train_good"]["model_version"]) and r["train_good"]["champion"]
    # a weaker job held the alias at most for a while, and only by beating, on the same rows, the holder it was scored
    # against (which job gates first is a race: the weak run's untrained network can beat the first one's)
    for name in ("train_weak", "tune"):
        if r[name]["champion"]:
            tags = client.get_model_version(MODEL, str(r[name]["model_version"])).tags
            assert float(tags["gate_val_acc"]) > float(tags["gate_champion_val_acc"]), (name, tags, gates)
            assert tags["gate_champion_version"] != champion, (name, tags, gates)  # never over the best one

    # the cache: the clear ran while jobs held entries and kept every one a live job held (naming our jobs); what it
    # deleted was the idle entry, or one whose job had ended; no job read an entry after the clear deleted it
    clear = jobs["cache_clear"]
    cleared = set(r["cache_clear"]["cleared"])
    kept = {k["key"]: {h["pid"] for h in k["held_by"]} for k in r["cache_clear"]["kept"]}
    pids = {j.proc.pid: n for n, j in jobs.items()}
    assert held_at_clear and kept, ("no job held a cache entry when the clear ran", held_at_clear, kept)
    assert idle.key in cleared and idle.key not in kept
    assert all(holders <= set(pids) for holders in kept.values()), (kept, pids)
    for key, holders in kept.items():  # each kept entry is one its holder read
        assert all(key in jobs[pids[pid]].entries_read() for pid in holders), (key, holders)
    for key in set(held_at_clear) - set(kept):  # held when the clear was started, deleted: its jobs had ended
        assert key in cleared and all(jobs[pids[p]].ended <= clear.ended for p in held_at_clear[key]), key
    for name, job in jobs.items():
        for key in job.entries_read() & cleared:
            assert job.ended <= clear.ended, f"{name} was still running when the clear deleted entry {key} it read"
    assert {e["key"] for e in cache.list_entries(cfg.data.cache_dir)} >= set(kept)
