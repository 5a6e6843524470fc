"""Direct source: data.source=direct (the ranks read the pinned table's own Parquet files) side by side with the
converted path (Spark converts into the cache) in one run, with the same epochs: on the sample, each job's wall time
and time before the first step, direct over converted with no cache entry (first run) and with a warm one; on a
synthetic table (`SYNTHETIC_ROWS` rows; --quick: the bench's quick synthetic table), the same on a first run and the
ranks' peak memory; rows/s of the direct reader over a plain pyarrow loop over every row of that table's files; the
extra disk bytes each path writes."""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict, List, Optional

from bench.core import Result, Sizes, discarded, median, ratio
from bench.job_phases import PHASES, run_train, timeline
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

EPOCHS = 2
SYNTHETIC_ROWS = 20_000  # the larger table; --quick reads the bench's quick synthetic table under one name
RSS_METRIC = "peak_rss_mb_rank_{}"  # each rank's peak RSS, logged by rank 0 at every epoch end (RankResources)
WORLD = 2
READER_MIN_ROWS = 100_000  # rows per timed repeat of the reader figure, at least (a pass of 2,000 rows takes ~1 ms)


def folder_bytes(path: str) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def every_row_split(pinned):
    """A DirectSplit of every row of `pinned`'s files, one rank: what a plain loop over the same files reads."""
    import numpy as np

    from pipeline.data.direct import DirectSplit, plan_ranges

    counts = [f.rows for f in pinned.files]
    return DirectSplit("train", [f.uri for f in pinned.files], [f.size for f in pinned.files],
                       [np.arange(n, dtype=np.int64) for n in counts], plan_ranges(counts, 1, True),
                       pinned.storage_options)


def reader_rows_per_s(cfg: Config, table: str, repeats: int, min_rows: int) -> Dict[str, Any]:
    """Rows/s of one DirectShardReader reading every row of the table's files (one rank's share of a split of all
    of them) / a plain pyarrow loop reading the same columns of the same files' row groups. A repeat opens the files
    once and reads them in as many passes as give `min_rows` rows (epochs, as a loader reads them, so the footers are
    not the figure); interleaved, `repeats` times each, after one untimed repeat of each (the page cache warm)."""
    import pyarrow.parquet as pq

    from pipeline.data.direct import READ_COLUMNS, DirectShardReader
    from pipeline.lakehouse.delta_files import arrow_filesystem, pin_files

    pinned = pin_files(table)
    split = every_row_split(pinned)
    passes = max(1, -(-max(min_rows, READER_MIN_ROWS) // max(1, pinned.num_rows)))

    def direct() -> int:  # one stream over the passes, read ahead across them, as the loader's train stream reads
        reader = DirectShardReader(split, 0, 1, workers=cfg.data.reader_workers)
        items = ((p, i) for p in range(passes) for i in range(len(reader)))
        return sum(len(g.label_index) for _, _, g in reader.iter_tagged(items))

    def plain() -> int:
        files = []
        for f in pinned.files:
            fs, path = arrow_filesystem(f.uri, pinned.storage_options)
            files.append(pq.ParquetFile(fs.open_input_file(path)))
        return sum(pf.read_row_group(g, columns=list(READ_COLUMNS), use_threads=False).num_rows
                   for _ in range(passes) for pf in files for g in range(pf.num_row_groups))

    rates: Dict[str, List[float]] = {"direct": [], "plain": []}
    for i in range(repeats + 1):
        for name, fn in (("direct", direct), ("plain", plain)):
            t0 = time.perf_counter()
            rows = fn()
            if i:  # the first repeat of each warms the page cache
                rates[name].append(rows / (time.perf_counter() - t0))
            if rows != passes * pinned.num_rows:
                raise RuntimeError(f"{name} read {rows} rows of {table} in {passes} pass(es); its files hold "
                                   f"{pinned.num_rows}")
    return {"direct_rows_per_s": median(rates["direct"]), "pyarrow_rows_per_s": median(rates["plain"]),
            "rows": pinned.num_rows, "passes": passes, "files": len(pinned.files),
            "chunks": len(DirectShardReader(split, 0, 1, workers=1)),
            "workers": cfg.data.reader_workers,
            "per_repeat": [ratio(d, p) for d, p in zip(rates["direct"], rates["plain"])]}


def round_order(kinds: List[str], i: int) -> List[str]:
    """The order of round `i`'s jobs: the converted kinds in their own order (converted_first empties the cache, so
    converted_warm, which needs its entry, comes after it), the direct job moved one place later each round (first in
    round 0, then after converted_first, then after converted_warm, ...), so that it neither always follows a job
    that read the same files nor always runs last, where drifting load falls."""
    converted = [k for k in kinds if k != "direct"]
    at = i % (len(converted) + 1)
    return converted[:at] + ["direct"] + converted[at:]


def rank_peak_rss_mb(client, run_id: str) -> List[float]:
    """Each rank's peak RSS over the job (MB): the highest `peak_rss_mb_rank_<r>` rank 0 logged (ru_maxrss of the
    rank process, sampled at every epoch end; the model logging after the last epoch is not in it, on either path)."""
    out = []
    for r in range(WORLD):
        history = client.get_metric_history(run_id, RSS_METRIC.format(r))
        if not history:
            raise RuntimeError(f"run {run_id}: no {RSS_METRIC.format(r)} metric; the rank's memory is unknown")
        out.append(max(m.value for m in history))
    return out


def measure_direct_source(cfg: Config, prep, sizes: Sizes, work_dir: str, quick: bool = False,
                          spark: Optional[Any] = None) -> List[Result]:
    """Per round, on the sample: a converted job with an empty cache (first run), the same again (warm cache), a
    direct job; on the synthetic table: a converted job with an empty cache and a direct job; the direct job's place
    rotates from round to round (`round_order`). 2 Horovod ranks,
    data.decode=cpu on both paths, `EPOCHS` epochs each, each a new process as a user runs it. `spark`: the bench's
    session, which makes the synthetic table when it is missing (`bench.datasets.ensure_synthetic`)."""
    import yaml
    from mlflow import MlflowClient

    from bench.datasets import ensure_synthetic
    from pipeline.lakehouse.delta_files import pin_files
    from pipeline.tracking.runs import resolve_tracking_uri

    synthetic_rows = sizes.synthetic_rows if quick else SYNTHETIC_ROWS
    synthetic = ensure_synthetic(spark, cfg, synthetic_rows)["table"]
    pinned = pin_files(synthetic)
    tables = {"sample": (prep.table, prep.version), "synthetic": (synthetic, pinned.version)}
    table_rows = {"sample": prep.rows, "synthetic": pinned.num_rows}
    root = os.path.join(work_dir, "direct_source")
    os.makedirs(root, exist_ok=True)
    model = f"{cfg.mlflow.registered_model}-bench-direct-source"
    conf_path = os.path.join(root, "config.yaml")
    fd = os.open(conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
    cache = os.path.join(root, "cache")
    common = [f"data.cache_dir={cache}", f"train.np=-{WORLD}", "train.backend=horovod", f"train.max_epochs={EPOCHS}",
              "train.early_stopping.enabled=false", "train.warmup_epochs=0", f"mlflow.registered_model={model}",
              "mlflow.gate_min_lift=null", "data.decode=cpu", "data.decode_workers=1"]
    env = {**os.environ, "LAKEHOUSE_PROGRESS": "0"}
    client = MlflowClient(resolve_tracking_uri(cfg.mlflow.tracking_uri))
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {
        "sample": {"converted_first": [], "converted_warm": [], "direct": []},
        "synthetic": {"converted_first": [], "direct": []}}

    def one(dataset: str, kind: str, i: int) -> Dict[str, Any]:
        table, version = tables[dataset]
        source = "direct" if kind == "direct" else "converted"
        if kind == "converted_first":
            shutil.rmtree(cache, ignore_errors=True)  # no cache entry: the converted path's first run
        before = folder_bytes(cache)
        job = run_train(conf_path, [*common, f"delta.table={table}", f"delta.version={version}",
                                    f"data.source={source}",
                                    f"train.checkpoint_dir={os.path.join(root, f'{dataset}-{kind}-{i}')}"], env)
        s = job["summary"]
        phases: Dict[str, Any] = timeline(s, job["started"], job["ended"],
                                          client.get_metric_history(s["run_id"], "epoch_time_s"))
        phases["wall_s"] = job["ended"] - job["started"]
        phases["before_first_step_s"] = sum(phases[k] for k in PHASES[:4])
        phases["extra_disk_bytes"] = float(folder_bytes(cache) - before)
        phases["rank_peak_rss_mb"] = rank_peak_rss_mb(client, s["run_id"])
        phases["rows"] = s["rows_train"] + s["rows_val"]  # planned: direct leaves out < world size train rows
        log.info("direct_source (%s, %s, %d): %s", dataset, kind, i,
                 {k: (round(v, 2) if isinstance(v, float) else v) for k, v in phases.items()})
        return phases

    rounds = 1 if quick else sizes.repeats
    orders: Dict[str, List[List[str]]] = {dataset: [] for dataset in runs}
    with discarded(root, cfg.mlflow, model):
        for i in range(rounds):
            for dataset, kinds in runs.items():
                orders[dataset].append(round_order(list(kinds), i))
                for kind in orders[dataset][-1]:
                    kinds[kind].append(one(dataset, kind, i))
        read = reader_rows_per_s(cfg, synthetic, max(3, sizes.repeats), sizes.loader_min_rows)
    results = []
    for dataset, kinds in runs.items():
        direct = kinds["direct"]
        for against in (k for k in kinds if k != "direct"):
            for key, name in (("wall_s", "direct_wall"), ("before_first_step_s", "direct_before_first_step")):
                per = [ratio(d[key], c[key]) for d, c in zip(direct, kinds[against])]
                parts = {"direct_" + key: median([r[key] for r in direct]),
                         against + "_" + key: median([r[key] for r in kinds[against]]),
                         "direct_extra_disk_bytes": median([r["extra_disk_bytes"] for r in direct]),
                         against + "_extra_disk_bytes": median([r["extra_disk_bytes"] for r in kinds[against]]),
                         "rows": table_rows[dataset], "epochs": EPOCHS, "world_size": WORLD,
                         "order_per_round": orders[dataset],
                         "per_run": {k: kinds[k] for k in (against, "direct")}}
                results.append(Result(name, dataset, median(per), parts, len(per), per,
                                      variant=against.replace("converted_", "vs_")))
    synth = runs["synthetic"]
    per = [ratio(max(d["rank_peak_rss_mb"]), max(c["rank_peak_rss_mb"]))
           for d, c in zip(synth["direct"], synth["converted_first"])]
    memory = {"direct_rank_peak_rss_mb": [r["rank_peak_rss_mb"] for r in synth["direct"]],
              "converted_first_rank_peak_rss_mb": [r["rank_peak_rss_mb"] for r in synth["converted_first"]],
              "rows": table_rows["synthetic"], "epochs": EPOCHS, "world_size": WORLD,
              "order_per_round": orders["synthetic"],
              "how": "the highest peak_rss_mb_rank_<r> (the rank process's ru_maxrss at each epoch end, logged to "
                     "MLflow by rank 0) over the job, the larger of the two ranks"}
    results.append(Result("direct_rank_memory", "synthetic", median(per), memory, len(per), per, variant="vs_first"))
    results.append(Result("direct_reader_over_pyarrow", "synthetic", ratio(read["direct_rows_per_s"],
                                                                           read["pyarrow_rows_per_s"]),
                          read, len(read["per_repeat"]), read["per_repeat"]))
    return results
