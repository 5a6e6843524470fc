"""Direct source: data.source=direct (the ranks read the pinned table's own Parquet files) side by side with the
converted path (Spark converts into the cache) in one run, on the same table and epochs: each job's wall time and time
before the first step, direct over converted with no cache entry (first run) and with a warm one; rows/s of the
direct reader over a plain pyarrow loop over the same files; the extra disk bytes each path writes."""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict, List

from bench.core import Result, Sizes, discarded, median, ratio
from bench.job_phases import PHASES, run_train, timeline
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

EPOCHS = 2


def folder_bytes(path: str) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def reader_rows_per_s(cfg: Config, table: str, version: int, repeats: int) -> Dict[str, Any]:
    """Rows/s of one DirectShardReader reading the whole train split (1 rank) / a plain pyarrow loop reading the same
    columns of the same files; interleaved, `repeats` times each."""
    import pyarrow.parquet as pq

    from pipeline.data.direct import READ_COLUMNS, DirectShardReader, plan_direct, split_index
    from pipeline.lakehouse.delta_files import pin_files

    pinned = pin_files(table, version)
    data = plan_direct(pinned, split_index(pinned, cfg.data.val_fraction, cfg.data.split_key), 1, 32)
    direct, plain = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reader = DirectShardReader(data.train, 0, 1, workers=cfg.data.reader_workers)
        rows = sum(len(g.label_index) for _, g in reader.iter_groups(range(len(reader))))
        direct.append(rows / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        rows_all = 0
        for f in pinned.files:
            pf = pq.ParquetFile(f.uri.replace("file://", ""))
            for g in range(pf.num_row_groups):
                rows_all += pf.read_row_group(g, columns=list(READ_COLUMNS), use_threads=False).num_rows
        plain.append(rows_all / (time.perf_counter() - t0))
    return {"direct_rows_per_s": median(direct), "pyarrow_rows_per_s": median(plain), "train_rows": data.train.rows,
            "file_rows": pinned.num_rows, "per_repeat": [ratio(d, p) for d, p in zip(direct, plain)]}


def measure_direct_source(cfg: Config, prep, sizes: Sizes, work_dir: str, quick: bool = False) -> List[Result]:
    """Per round: a converted job with an empty cache (first run), the same again (warm cache), a direct job; 2
    Horovod ranks, data.decode=cpu on both paths, `EPOCHS` epochs each, each a new process as a user runs it."""
    import yaml
    from mlflow import MlflowClient

    from pipeline.tracking.runs import resolve_tracking_uri

    root = os.path.join(work_dir, "direct_source")
    os.makedirs(root, exist_ok=True)
    model = f"{cfg.mlflow.registered_model}-bench-direct-source"
    conf_path = os.path.join(root, "config.yaml")
    fd = os.open(conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
    cache = os.path.join(root, "cache")
    common = [f"delta.table={prep.table}", f"delta.version={prep.version}", f"data.cache_dir={cache}",
              "train.np=-2", "train.backend=horovod", f"train.max_epochs={EPOCHS}", "train.early_stopping.enabled=false",
              "train.warmup_epochs=0", f"mlflow.registered_model={model}", "mlflow.gate_min_lift=null",
              "data.decode=cpu", "data.decode_workers=1"]
    env = {**os.environ, "LAKEHOUSE_PROGRESS": "0"}
    client = MlflowClient(resolve_tracking_uri(cfg.mlflow.tracking_uri))
    runs: Dict[str, List[Dict[str, float]]] = {"converted_first": [], "converted_warm": [], "direct": []}

    def one(kind: str, i: int) -> Dict[str, float]:
        extra = ["data.source=direct"] if kind == "direct" else ["data.source=converted"]
        before = folder_bytes(cache)
        job = run_train(conf_path, [*common, *extra, f"train.checkpoint_dir={os.path.join(root, f'{kind}-{i}')}"], env)
        s = job["summary"]
        phases = timeline(s, job["started"], job["ended"], client.get_metric_history(s["run_id"], "epoch_time_s"))
        phases["wall_s"] = job["ended"] - job["started"]
        phases["before_first_step_s"] = sum(phases[k] for k in PHASES[:4])
        phases["extra_disk_bytes"] = float(folder_bytes(cache) - before)
        log.info("direct_source (%s, %d): %s", kind, i, {k: round(v, 2) for k, v in phases.items()})
        return phases

    rounds = 1 if quick else sizes.repeats
    with discarded(root, cfg.mlflow, model):
        for i in range(rounds):
            shutil.rmtree(cache, ignore_errors=True)  # no cache entry: the converted path's first run
            runs["converted_first"].append(one("converted_first", i))
            runs["converted_warm"].append(one("converted_warm", i))
            runs["direct"].append(one("direct", i))
        read = reader_rows_per_s(cfg, prep.table, prep.version, 2 if quick else sizes.repeats)
    results = []
    for against in ("converted_first", "converted_warm"):
        for key, name in (("wall_s", "direct_wall"), ("before_first_step_s", "direct_before_first_step")):
            per = [ratio(d[key], c[key]) for d, c in zip(runs["direct"], runs[against])]
            parts = {"direct_" + key: median([r[key] for r in runs["direct"]]),
                     against + "_" + key: median([r[key] for r in runs[against]]),
                     "direct_extra_disk_bytes": median([r["extra_disk_bytes"] for r in runs["direct"]]),
                     against + "_extra_disk_bytes": median([r["extra_disk_bytes"] for r in runs[against]]),
                     "epochs": EPOCHS, "world_size": 2, "per_run": {k: runs[k] for k in (against, "direct")}}
            results.append(Result(name, prep.name, median(per), parts, len(per), per,
                                  variant=against.replace("converted_", "vs_")))
    results.append(Result("direct_reader_over_pyarrow", prep.name, ratio(read["direct_rows_per_s"],
                                                                         read["pyarrow_rows_per_s"]),
                          read, len(read["per_repeat"]), read["per_repeat"]))
    return results
