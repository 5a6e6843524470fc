"""Job phases: where the wall time of a 2-rank `lakehouse train` goes, phase by phase, for each backend, as a user
runs it (a new process: interpreter, Spark, data, run set-up, rank start, epochs, model logging, registration and
gate, exit). `run_jobs` starts those jobs; bench.epoch_parity uses it on longer epochs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from bench.core import Result, Sizes, discarded, median, ratio
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

BACKENDS = ("horovod", "ddp")
EPOCHS = 3  # the first epoch carries the ranks' warm-up; the step-time comparison uses the later ones
TIMEOUT_S = 900
# The phases in the order they happen; they add up to the process's wall time.
PHASES = ("process_and_spark_s", "prepare_data_s", "run_setup_s", "rank_start_s", "epochs_s", "model_logging_s",
          "register_and_gate_s", "exit_s")


def timeline(summary: Dict[str, Any], started: float, ended: float, epochs: List[Any]) -> Dict[str, float]:
    """The phases of one job from the driver's timeline (`summary["phases"]["at"]`, wall clock), the process's start
    and end, and rank 0's `epoch_time_s` metric history (each value logged at its epoch's end with its duration):

    process_and_spark_s: interpreter, imports, config and Spark session until `workflow.train` is called;
    prepare_data_s: MLflow reached, the table pinned, converted (or a cache hit) and planned;
    run_setup_s: the MLflow run opened, config, lineage and shard plan logged, until the launch;
    rank_start_s: the launch until the first epoch's first step (rank processes, imports, rendezvous, data module,
    Lightning set-up); epochs_s: first step to last epoch's end; model_logging_s: the last epoch's end until the
    ranks returned (rank 0 logs the model); register_and_gate_s; exit_s: the summary until the process ended.
    """
    at = summary["phases"]["at"]
    history = sorted(epochs, key=lambda m: m.step)
    if not history:
        raise ValueError(f"run {summary.get('run_id')}: no epoch_time_s metric; the phases cannot be placed")
    first_start = history[0].timestamp / 1000.0 - history[0].value
    last_end = history[-1].timestamp / 1000.0
    return {"process_and_spark_s": at["train_called"] - started,
            "prepare_data_s": at["data_ready"] - at["train_called"],
            "run_setup_s": at["launch"] - at["data_ready"],
            "rank_start_s": first_start - at["launch"],
            "epochs_s": last_end - first_start,
            "model_logging_s": at["ranks_returned"] - last_end,
            "register_and_gate_s": at["gated"] - at["ranks_returned"],
            "exit_s": ended - at["gated"],
            "steady_epoch_s": median([m.value for m in history[1:]] or [history[0].value])}


def _last_json(text: str) -> Dict[str, Any]:
    lines = [line for line in text.strip().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"lakehouse train printed no summary line:\n{text[-3000:]}")
    return json.loads(lines[-1])


def run_train(conf_path: str, overrides: List[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """`lakehouse train --conf conf_path overrides...` in a new process; its summary with the process's wall-clock
    start and end."""
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--conf", conf_path, *overrides]
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    return {"summary": _last_json(done.stdout), "started": started, "ended": ended}


def run_jobs(cfg: Config, prep, work_dir: str, name: str, epochs: int, rounds: int, warm_up: bool,
             extra: Optional[List[str]] = None) -> Dict[str, List[Dict[str, float]]]:
    """`rounds` rounds of one 2-rank `lakehouse train` of `prep`'s table per backend, as a user runs it (a new process,
    `epochs` epochs, early stopping off, the bench's converted-data cache), the backends alternating their order; a
    warm-up job per backend first with `warm_up` (the cache entry, the experiment, the registered model). Each job's
    phases (`timeline`) and wall time, by backend. Everything it writes is under `<work_dir>/<name>`, removed after."""
    import yaml
    from mlflow import MlflowClient

    from bench.conversion import bench_cache_dir
    from pipeline.tracking.runs import resolve_tracking_uri

    root = os.path.join(work_dir, name)
    os.makedirs(root, exist_ok=True)
    model = f"{cfg.mlflow.registered_model}-bench-{name.replace('_', '-')}"
    conf_path = os.path.join(root, "config.yaml")
    fd = os.open(conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the user's own config, kept private
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
    common = [f"delta.table={prep.table}", f"delta.version={prep.version}",
              f"data.cache_dir={bench_cache_dir(cfg, work_dir)}", "train.np=-2", f"train.max_epochs={epochs}",
              "train.early_stopping.enabled=false", "train.warmup_epochs=0", f"mlflow.registered_model={model}",
              "mlflow.gate_min_lift=null", *(extra or [])]
    env = {**os.environ, "LAKEHOUSE_PROGRESS": "0"}
    runs: Dict[str, List[Dict[str, float]]] = {b: [] for b in BACKENDS}

    def one(backend: str, i: int) -> Dict[str, float]:
        job = run_train(conf_path, [*common, f"train.backend={backend}",
                                    f"train.checkpoint_dir={os.path.join(root, f'{backend}-{i}')}"], env)
        s = job["summary"]
        client = MlflowClient(resolve_tracking_uri(cfg.mlflow.tracking_uri))  # the summary's is redacted
        phases = timeline(s, job["started"], job["ended"], client.get_metric_history(s["run_id"], "epoch_time_s"))
        phases["wall_s"] = job["ended"] - job["started"]
        log.info("%s (%s, %d): %s", name, backend, i, {k: round(v, 2) for k, v in phases.items()})
        return phases

    with discarded(root, cfg.mlflow, model):
        for backend in BACKENDS if warm_up else ():
            one(backend, 0)
        for i in range(1, rounds + 1):
            for backend in (BACKENDS if i % 2 else BACKENDS[::-1]):
                runs[backend].append(one(backend, i))
    return runs


def measure_early_start(cfg: Config, prep, sizes: Sizes, work_dir: str, quick: bool = False) -> List[Result]:
    """train.early_start on / off, side by side: per data.source (converted from a warm cache; direct, decode=cpu) and
    round, one 2-rank job of the sample per backend with the ranks started while the driver prepares and one with them
    started after, the two alternating which goes first. Result per backend and source: the median time before the
    first step with / without (`early_start_before_first_step`), the phases of both in the parts. `quick`: one round
    of the direct source, no warm-up."""
    sources = {"converted": [], "direct": ["data.source=direct", "data.decode=cpu", "data.decode_workers=1"]}
    rounds = 1 if quick else max(2, sizes.repeats - 2)
    results = []
    for source, extra in sources.items():
        if quick and source == "converted":  # quick proves it runs: the direct source alone
            continue
        runs: Dict[str, Dict[str, List[Dict[str, float]]]] = {"on": {b: [] for b in BACKENDS},
                                                               "off": {b: [] for b in BACKENDS}}
        for i in range(rounds + (0 if quick else 1)):  # the first round a warm-up (cache entry, experiment, model)
            for flag in (("on", "off") if i % 2 else ("off", "on")):
                got = run_jobs(cfg, prep, work_dir, f"early_{source}_{flag}", EPOCHS, 1, warm_up=False,
                               extra=[*extra, f"train.early_start={'true' if flag == 'on' else 'false'}"])
                if quick or i:
                    for backend in BACKENDS:
                        runs[flag][backend].extend(got[backend])
        for backend in BACKENDS:
            on, off = runs["on"][backend], runs["off"][backend]
            before = {flag: [sum(r[k] for k in PHASES[:4]) for r in rs] for flag, rs in (("on", on), ("off", off))}
            per = [ratio(a, b) for a, b in zip(before["on"], before["off"])]
            parts = {"before_first_step_on_s": median(before["on"]), "before_first_step_off_s": median(before["off"]),
                     "wall_on_s": median([r["wall_s"] for r in on]), "wall_off_s": median([r["wall_s"] for r in off]),
                     "backend": backend, "data_source": source, "world_size": 2, "epochs": EPOCHS,
                     "phases_on": {k: median([r[k] for r in on]) for k in PHASES},
                     "phases_off": {k: median([r[k] for r in off]) for k in PHASES}}
            results.append(Result("early_start_before_first_step", prep.name,
                                  ratio(parts["before_first_step_on_s"], parts["before_first_step_off_s"]), parts,
                                  len(per), per, variant=f"{backend}/{source}"))
    return results


def measure_job_phases(cfg: Config, prep, sizes: Sizes, work_dir: str, quick: bool = False) -> List[Result]:
    """`repeats` rounds of one 2-rank `lakehouse train` of the sample per backend (`run_jobs`, `EPOCHS` epochs, warm
    converted-data cache; `quick`: one round, no warm-up: it proves the measurement runs). Result per backend:
    `job_fixed_cost` (the seconds outside the epochs / the job's wall time, every phase in the parts). The epoch
    time of the two backends is compared on longer epochs (bench.epoch_parity)."""
    runs = run_jobs(cfg, prep, work_dir, "job_phases", EPOCHS, 1 if quick else sizes.repeats, warm_up=not quick)
    results = measure_early_start(cfg, prep, sizes, work_dir, quick)
    for backend in BACKENDS:
        rs = runs[backend]
        fixed = [ratio(r["wall_s"] - r["epochs_s"], r["wall_s"]) for r in rs]
        parts = {k: median([r[k] for r in rs]) for k in (*PHASES, "steady_epoch_s", "wall_s")}
        parts.update({"before_first_step_s": median([sum(r[k] for k in PHASES[:4]) for r in rs]),
                      "after_last_step_s": median([sum(r[k] for k in PHASES[5:]) for r in rs]),
                      "backend": backend, "world_size": 2, "epochs": EPOCHS, "per_run": rs})
        results.append(Result("job_fixed_cost", prep.name, median(fixed), parts, len(rs), fixed, variant=backend))
    return results
