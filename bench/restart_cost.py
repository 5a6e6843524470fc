"""Restart cost: the wall time one injected rank failure adds to a run (train.max_restarts=1) over one epoch plus a
process start, i.e. the issue's target `wall(with the failure) / wall(uninterrupted) <= 1 + (epoch + process start)
/ total` written as `(wall with the failure - wall uninterrupted) / (epoch + process start) <= 1`: only the
interrupted epoch and the relaunch are lost."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

from bench.core import Result, Sizes, discarded, median, patched, ratio
from pipeline.config import Config, apply_overrides, world_size_of
from pipeline.log import get_logger

log = get_logger(__name__)

EPOCHS = 4
FAIL_EPOCH = 1  # 0-based; its last step fails: with per-epoch checkpoints almost the whole epoch is lost (worst case)
FAIL_RANK = 1


def epoch_timing(client, run_id: str, launch_start: float) -> Tuple[float, float, List[float]]:
    """(median epoch seconds, process start seconds, every epoch's seconds) of a run from its `epoch_time_s`
    metric (one epoch's steps and validation, logged by rank 0 at the epoch's end). Process start: from the
    launcher's call (`launch_start`, wall clock) to the first epoch's start (its metric's time less its duration):
    rank processes, imports, hvd.init, data module and Lightning setup."""
    history = sorted(client.get_metric_history(run_id, "epoch_time_s"), key=lambda m: m.step)
    if not history:
        return float("nan"), float("nan"), []
    values = [m.value for m in history]
    first = history[0]
    return median(values), first.timestamp / 1000.0 - first.value - launch_start, values


def attempts(client, run_id: str, launches: List[List[float]]) -> Dict[str, float]:
    """Where a run with a failure spent its time, from its launches ([start, end] wall clock each) and its epoch
    metrics: the failed attempt, the driver between the attempts, the relaunch's process start (its call to its
    first epoch's start) and the rest of the second attempt."""
    if len(launches) < 2:
        return {}
    (s0, e0), (s1, e1) = launches[0], launches[1]
    after = [m for m in client.get_metric_history(run_id, "epoch_time_s") if m.timestamp / 1000.0 > s1]
    first = min(after, key=lambda m: m.timestamp) if after else None
    start = first.timestamp / 1000.0 - first.value - s1 if first else float("nan")
    return {"failed_attempt_s": e0 - s0, "between_attempts_s": s1 - e0, "relaunch_start_s": start,
            "second_attempt_s": e1 - s1}


def restart_problem(run: Dict[str, Any]) -> Optional[str]:
    """Why a run with the injected failure does not measure one restart (None when it does): its `restarts` metric
    is not [1] or its ranks were not launched exactly twice (the failure never fired, or it restarted again)."""
    if run["restarts"] == [1] and run["launches"] == 2:
        return None
    return (f"restarts metric {run['restarts']}, {run['launches']} launch(es): the injected failure did not restart "
            f"the run exactly once")


def cost_result(whole: List[float], cut: List[float], epoch_s: List[float], start_s: List[float], dataset: str,
                context: Dict[str, Any], dropped: Optional[Dict[str, str]] = None) -> Result:
    """The restart_cost figure: median over the valid pairs of (cut - whole) / (epoch + start), with the issue's form
    of the same comparison (wall ratio and its bound) in the parts. `dropped`: {pair: why} of the pairs left out
    (their run with the failure did not restart once: `restart_problem`); with no pair left the figure is NaN (not a
    pass). A negative figure (the run with the failure was the faster: the noise between runs exceeds the cost) is
    not a pass either."""
    dropped = dropped or {}
    per = [ratio(c - w, e + s) for w, c, e, s in zip(whole, cut, epoch_s, start_s)]
    w, c, e, s = median(whole), median(cut), median(epoch_s), median(start_s)
    parts = {"uninterrupted_s": w, "with_failure_s": c, "extra_s": c - w, "epoch_s": e, "process_start_s": s,
             "wall_ratio": ratio(c, w), "wall_ratio_bound": 1 + ratio(e + s, w),
             "uninterrupted_s_per_pair": whole, "with_failure_s_per_pair": cut, "dropped_pairs": dropped, **context}
    note = ("the run with the failure lost more than the interrupted epoch and a relaunch: see extra_s against "
            "epoch_s + process_start_s")
    if not per:
        note = (f"not measured: no valid pair ({len(dropped)} dropped: "
                f"{'; '.join(f'{k}: {v}' for k, v in dropped.items()) or 'none timed'})")
    result = Result("restart_cost", dataset, median(per), parts, len(per), per, note=note)
    if result.ratio < 0:
        result.passed = False
        result.note = ("negative: the run with the failure took less wall time than the uninterrupted one; the "
                       "run-to-run noise is larger than the cost, so the figure says nothing (rerun on a quieter "
                       "machine, or with more pairs)")
    return result


def measure_restart_cost(spark, cfg: Config, prep, sizes: Sizes, work_dir: str) -> List[Result]:
    """`sizes.pairs` pairs of the same `workflow.train` (2 Horovod ranks on this machine, `EPOCHS` epochs, a checkpoint
    per epoch, early stopping off) on `prep` (the sample) with a warm converted-data cache: uninterrupted, and with
    rank 1 failing at the last step of epoch `FAIL_EPOCH` (`debug.fail_at_step`: the rank raises and exits, Horovod's
    launcher stops the other; the injected failure hits the first attempt only) and `train.max_restarts=1`, which
    relaunches both ranks from the last checkpoint. Pairs alternate their order; an uninterrupted warm-up run
    comes first. Registration goes to `<mlflow.registered_model>-bench-restarts` (never promoted; deleted after).
    """
    from mlflow.tracking import MlflowClient

    from pipeline import workflow
    from bench.conversion import bench_cache_dir
    from pipeline.distributed import restart
    from pipeline.tracking.runs import temporary_env

    root = os.path.join(work_dir, "restart_cost")
    shutil.rmtree(root, ignore_errors=True)
    model = f"{cfg.mlflow.registered_model}-bench-restarts"
    np_ = -2 if cfg.train.backend == "horovod" else cfg.train.np
    base = apply_overrides(cfg, {
        "delta.table": prep.table, "delta.version": prep.version, "data.cache_dir": bench_cache_dir(cfg, work_dir),
        "train.np": np_, "train.max_epochs": EPOCHS, "train.early_stopping.enabled": False,
        "train.checkpoint_every_n_steps": None, "train.warmup_epochs": 0, "mlflow.registered_model": model,
        "mlflow.promote": False})
    launches: List[List[float]] = []  # [start, end] of each launch of the run being timed (wall clock)

    def launch_timer(original):
        def wrapper(*a, **kw):
            launches.append([time.time(), float("nan")])
            try:
                return original(*a, **kw)
            finally:
                launches[-1][1] = time.time()
        return wrapper

    def one(name: str, i: int, fail_step: int = None) -> Dict[str, Any]:
        extra = {"train.checkpoint_dir": os.path.join(root, f"{name}-{i}")}
        if fail_step is not None:
            extra.update({"train.max_restarts": 1, "debug.fail_at_step": fail_step, "debug.fail_rank": FAIL_RANK})
        del launches[:]
        t0 = time.perf_counter()
        out = workflow.train(spark, apply_overrides(base, extra), run_name=f"bench-restart-{name}-{i}")
        wall = time.perf_counter() - t0
        client = MlflowClient(out["tracking_uri"])
        epoch_s, start_s, epochs = epoch_timing(client, out["run_id"], launches[0][0])
        restarts = [m.value for m in client.get_metric_history(out["run_id"], "restarts")]
        return {"wall": wall, "epoch_s": epoch_s, "start_s": start_s, "epochs": epochs, "restarts": restarts,
                "launches": len(launches), "launch_s": [e - s for s, e in launches],
                "attempts": attempts(client, out["run_id"], launches), "run_id": out["run_id"],
                "tracking_uri": out["tracking_uri"]}

    whole: List[Dict[str, Any]] = []
    cut: List[Dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_env({"LAKEHOUSE_PROGRESS": "0"}))
        stack.enter_context(patched(restart, "launch", launch_timer))
        stack.enter_context(discarded(root, base.mlflow, model))
        warm = one("warmup", 0)  # the driver's imports, the experiment, the registered model, the cache entry
        client = MlflowClient(warm["tracking_uri"])
        with open(client.download_artifacts(warm["run_id"], "shard_plan.json", root)) as fh:
            steps = json.load(fh)["train"]["steps_per_epoch"]
        fail_step = (FAIL_EPOCH + 1) * steps - 1
        for i in range(1, sizes.pairs + 1):
            for name in (("cut", "whole") if i % 2 else ("whole", "cut")):
                (cut if name == "cut" else whole).append(one(name, i, fail_step if name == "cut" else None))
    problems = [restart_problem(c) for c in cut]  # pair i: whole[i] and cut[i]
    kept = [i for i, p in enumerate(problems) if p is None]
    dropped = {f"pair {i + 1}": p for i, p in enumerate(problems) if p is not None}
    if dropped:
        log.warning("restart cost: %d pair(s) left out: %s", len(dropped), dropped)
    context = {"epochs": EPOCHS, "fail_at_step": fail_step, "fail_epoch": FAIL_EPOCH, "steps_per_epoch": steps,
               "fail_rank": FAIL_RANK, "world_size": world_size_of(base), "backend": base.train.backend,
               "batch_size": base.data.batch_size, "restarts_per_run_with_failure": [c["restarts"] for c in cut],
               "epoch_s_per_run": [w["epochs"] for w in whole], "warmup_s": round(warm["wall"], 3),
               "process_start_s_per_run": [w["start_s"] for w in whole],
               "uninterrupted_launch_s": [w["launch_s"] for w in whole],
               "with_failure_attempts_s": [c["attempts"] for c in cut],
               "path": "pipeline.workflow.train with train.max_restarts=1 vs without a failure"}
    result = cost_result([whole[i]["wall"] for i in kept], [cut[i]["wall"] for i in kept],
                         [whole[i]["epoch_s"] for i in kept], [whole[i]["start_s"] for i in kept], prep.name, context,
                         dropped)
    log.info("restart cost on %s: uninterrupted %.2f s, with one failure %.2f s, epoch %.2f s, start %.2f s: "
             "ratio %.3f (wall ratio %.3f <= bound %.3f)", prep.name, result.parts["uninterrupted_s"],
             result.parts["with_failure_s"], result.parts["epoch_s"], result.parts["process_start_s"], result.ratio,
             result.parts["wall_ratio"], result.parts["wall_ratio_bound"])
    return [result]
