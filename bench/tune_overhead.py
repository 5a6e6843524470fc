"""Tune overhead: the wall time of one `lakehouse tune` trial ÷ the same `train` with the same overrides run alone,
both through the product's paths on the sample, with a warm converted-data cache; the study's one-off work apart."""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from bench.core import Result, Sizes, discarded, median, patched, ratio
from pipeline.config import Config, apply_overrides, world_size_of
from pipeline.log import get_logger

log = get_logger(__name__)

EPOCHS = 2  # per trial and per train alone: a short trial is the worst case for a fixed per-trial cost
LRS = (0.01, 0.03, 0.003)
OPTIMIZERS = ("sgd", "adam")


def sweep_space(n: int) -> Tuple[str, Dict[str, Any], List[Dict[str, Any]]]:
    """The bench's small sweep: (its YAML text, the fixed overrides, the `n` enqueued trials in the order the study
    runs them). Enqueued, so each trial's overrides are known before it starts and its train alone can run first."""
    fixed = {"train.max_epochs": EPOCHS, "train.early_stopping.enabled": False}  # every run does every epoch
    trials = [{"model.lr": LRS[i % len(LRS)], "model.optimizer": OPTIMIZERS[i % len(OPTIMIZERS)]} for i in range(n)]
    space = {"params": {"model.lr": {"type": "float", "low": min(LRS), "high": max(LRS), "log": True},
                        "model.optimizer": {"type": "categorical", "choices": list(OPTIMIZERS)}},
             "fixed": fixed, "enqueue": trials}
    return yaml.safe_dump(space, sort_keys=False), fixed, trials


class Spans:
    """(name, start, end) of every timed call, so that each is charged to the trial or train run that contains it."""

    def __init__(self) -> None:
        self.items: List[Tuple[str, float, float]] = []

    def timer(self, name: str) -> Callable[[Callable], Callable]:
        """A `patched` maker: the original, timed under `name`."""
        def make(original: Callable) -> Callable:
            @functools.wraps(original)
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return original(*a, **kw)
                finally:
                    self.items.append((name, t0, time.perf_counter()))
            return wrapper
        return make

    def within(self, name: str, start: float, end: float) -> float:
        """Seconds spent in `name` calls that ran inside [start, end]."""
        return sum(e - s for n, s, e in self.items if n == name and s >= start and e <= end)


@dataclass
class Pair:
    """One timed trial and its train alone (same overrides), each with the parts the spans attribute to it."""

    trial: Dict[str, float]  # wall, run_trial, train_in_run, ranks, ask, tell, log_best, gate_wait
    alone: Dict[str, float]  # wall, prepare, train_in_run, ranks, register
    order: str = ""  # "trial first" | "alone first"

    @property
    def alone_s(self) -> float:
        """The train alone without its model registration (a trial registers nothing; the study registers once)."""
        return self.alone["wall"] - self.alone["register"]

    @property
    def overhead(self) -> float:
        return ratio(self.trial["wall"], self.alone_s)

    @property
    def extra_s(self) -> float:
        """The trial's own work, measured directly: its time outside the ranks plus rank 0's waits for the pruning
        verdicts, less the train alone's time outside the ranks (registration left out)."""
        trial = self.trial["wall"] - self.trial["ranks"] + self.trial["gate_wait"]
        return trial - (self.alone_s - self.alone["ranks"])

    @property
    def overhead_from_parts(self) -> float:
        """1 + extra_s / the train alone: the same ratio without the run-to-run noise of the training itself (both
        runs train the same epochs on the same data; on a loaded machine their ranks' times differ by far more)."""
        return 1.0 + ratio(self.extra_s, self.alone_s)

    @property
    def overhead_vs_training_only(self) -> float:
        """The same without the train alone's cache-hit data preparation (the sweep prepares once per study)."""
        return ratio(self.trial["wall"], self.alone_s - self.alone["prepare"])


@dataclass
class Breakdown:
    """Where a trial's and a train alone's wall time went (medians over the pairs, seconds)."""

    trial: Dict[str, float] = field(default_factory=dict)
    alone: Dict[str, float] = field(default_factory=dict)


def breakdown(pairs: List[Pair]) -> Breakdown:
    """Each run's wall time split into nested parts: the ranks (launch, training, validation, the model logged by
    rank 0; a trial's pruning gate too), the rest of train_in_run (config, lineage, shard plan logged), the rest of
    the MLflow run, and around it (a trial: Optuna ask / tell, the progress line and best-so-far tags; a train: its
    cache-hit data preparation and the model registration)."""
    def med(values: List[float]) -> float:
        return round(median(values), 4)

    t = [p.trial for p in pairs]
    a = [p.alone for p in pairs]
    return Breakdown(
        trial={"wall": med([x["wall"] for x in t]),
               "ranks": med([x["ranks"] for x in t]),
               "train_in_run_outside_ranks": med([x["train_in_run"] - x["ranks"] for x in t]),
               "child_run_outside_train_in_run": med([x["run_trial"] - x["train_in_run"] for x in t]),
               "optuna_ask": med([x["ask"] for x in t]),
               "optuna_tell": med([x["tell"] for x in t]),
               "log_best": med([x["log_best"] for x in t]),
               "pruning_gate_wait_in_ranks": med([x["gate_wait"] for x in t]),
               "sweep_rest": med([x["wall"] - x["run_trial"] - x["ask"] - x["tell"] - x["log_best"] for x in t])},
        alone={"wall": med([x["wall"] for x in a]),
               "ranks": med([x["ranks"] for x in a]),
               "train_in_run_outside_ranks": med([x["train_in_run"] - x["ranks"] for x in a]),
               "prepare_data_cache_hit": med([x["prepare"] for x in a]),
               "registration": med([x["register"] for x in a]),
               "run_rest": med([x["wall"] - x["train_in_run"] - x["prepare"] - x["register"] for x in a])})


def valid_pairs(pairs: Dict[int, Pair], states: Dict[int, str], n: int) -> Tuple[List[Pair], Dict[str, str]]:
    """The timed pairs (1..n) that measure a trial: both runs timed and the trial COMPLETE (a PRUNED or FAILED one
    did less work than its train alone); and {pair: why} of those left out."""
    kept, dropped = [], {}
    for i in range(1, n + 1):
        if i not in pairs:
            dropped[f"pair {i}"] = "not timed (the trial or its train alone did not run)"
        elif states.get(i) != "COMPLETE":
            dropped[f"pair {i}"] = f"trial state {states.get(i)}, not COMPLETE"
        else:
            kept.append(pairs[i])
    return kept, dropped


def no_pair_note(dropped: Dict[str, str]) -> str:
    return (f"not measured: no valid pair ({len(dropped)} left out: "
            f"{'; '.join(f'{k}: {v}' for k, v in dropped.items()) or 'none timed'})")


def overhead_result(pairs: List[Pair], dataset: str, study: Dict[str, Any], context: Dict[str, Any],
                    dropped: Optional[Dict[str, str]] = None) -> Result:
    """The tune_overhead figure: median over the pairs of trial wall ÷ train alone wall (less its registration),
    with the spread, the parts, the stricter ratio without the train's data preparation and the study's one-off
    work (not in the per-trial figure). `dropped`: {pair: why} of the pairs left out (`valid_pairs`); with no pair
    the figure is NaN (not a pass)."""
    dropped = dropped or {}
    per = [p.overhead for p in pairs]
    parts: Dict[str, Any] = {
        "trial_s": median([p.trial["wall"] for p in pairs]),
        "train_alone_s": median([p.alone_s for p in pairs]),
        "train_alone_with_registration_s": median([p.alone["wall"] for p in pairs]),
        "per_trial_extra_s": median([p.trial["wall"] - p.alone_s for p in pairs]),
        "overhead_from_parts": median([p.overhead_from_parts for p in pairs]),
        "overhead_from_parts_per_pair": [p.overhead_from_parts for p in pairs],
        "per_trial_extra_from_parts_s": median([p.extra_s for p in pairs]),
        "ranks_trial_over_alone": median([ratio(p.trial["ranks"], p.alone["ranks"]) for p in pairs]),
        "overhead_vs_training_only": median([p.overhead_vs_training_only for p in pairs]),
        "overhead_vs_training_only_per_pair": [p.overhead_vs_training_only for p in pairs],
        "order": [p.order for p in pairs],
        "breakdown_s": breakdown(pairs).__dict__,
        "study_one_off_s": study,
        "dropped_pairs": dropped,
        **context,
    }
    b = breakdown(pairs)
    own = b.trial["wall"] - b.trial["ranks"] + b.trial["pruning_gate_wait_in_ranks"]
    note = (f"the trial's own work, measured directly (outside its ranks, plus rank 0's waits for the pruning "
            f"verdicts), is {own:.2f} s against the train alone's {b.alone['wall'] - b.alone['ranks']:.2f} s outside "
            f"its ranks (registration {b.alone['registration']:.2f} s of it): overhead from parts "
            f"{parts['overhead_from_parts']:.3f}; the rest of the gap is the ranks' training time (same epochs, same "
            f"data in both), trial / alone {parts['ranks_trial_over_alone']:.3f} in the median pair: run-to-run "
            f"noise where its spread straddles 1")
    if not per:
        note = no_pair_note(dropped)
    return Result("tune_overhead", dataset, median(per), parts, len(per), per, note=note)


def from_parts_result(pairs: List[Pair], dataset: str, dropped: Optional[Dict[str, str]] = None) -> Result:
    """The same ratio from the directly measured parts (variant `from_parts`): 1 + (the trial's own work - the train
    alone's own work) / the train alone, per pair; blind to the ranks' run-to-run noise, and to any slowdown of the
    training itself other than the verdict waits (the wall ratio, the headline, sees that)."""
    per = [p.overhead_from_parts for p in pairs]
    method = ("1 + (a trial's time outside its ranks + rank 0's waits for the pruning verdicts - the same train "
              "alone's time outside its ranks, registration excluded) / the train alone's wall time")
    return Result("tune_overhead", dataset, median(per), {"per_trial_extra_s": median([p.extra_s for p in pairs]),
                                                          "train_alone_s": median([p.alone_s for p in pairs])},
                  len(per), per, method=method, variant="from_parts", note="" if per else no_pair_note(dropped or {}))


def _alone_config(tcfg: Config, fixed: Dict[str, Any], trial: Dict[str, Any], root: str, i: int) -> Config:
    return apply_overrides(tcfg, {**fixed, **trial, "train.checkpoint_dir": os.path.join(root, "alone", str(i))})


def measure_tune_overhead(spark, cfg: Config, prep, sizes: Sizes, work_dir: str) -> List[Result]:
    """One study of `sizes.pairs` + 1 trials of a small sweep on `prep` (the sample) through `run_tune`, and for each
    trial the same overrides through `workflow.train` alone; the first trial and a first train alone are warm-ups.

    Trials and trains alternate (train alone first on odd pairs, after on even ones), on the same pinned version,
    world size and converted-data cache (the bench's own, warm: the warm-up train hits it, the study's one
    conversion too), in the bench's MLflow experiment, registering into `<mlflow.registered_model>-bench`
    (never promoted; deleted afterwards), with the study in its own SQLite storage under `work_dir`. The median
    pruner is on (each epoch is reported to Optuna and rank 0 waits for its verdict) but cannot prune: its
    startup trials outnumber the study's. A trial's wall is one turn of the sweep (`sweep._next_trial`: ask,
    suggest, the child run, tell, progress line, best-so-far tags); the study's parent run, its one conversion,
    the best model's registration and the plots are the study's one-off work, reported apart.
    """
    import optuna

    from pipeline import workflow
    from bench.conversion import bench_cache_dir
    from pipeline.distributed import restart
    from pipeline.tracking.runs import temporary_env
    from pipeline.tune import sweep
    from pipeline.tune import trial as tune_trial

    n = sizes.pairs
    root = os.path.join(work_dir, "tune")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    text, fixed, trials = sweep_space(n + 1)
    space_path = os.path.join(root, "space.yaml")
    with open(space_path, "w") as fh:
        fh.write(text)
    model = f"{cfg.mlflow.registered_model}-bench"
    tcfg = apply_overrides(cfg, {
        "delta.table": prep.table, "delta.version": prep.version, "data.cache_dir": bench_cache_dir(cfg, work_dir),
        "train.checkpoint_dir": os.path.join(root, "checkpoints"), "mlflow.registered_model": model,
        "mlflow.promote": False, "tune.storage": f"sqlite:///{root}/optuna.db",
        "tune.study": f"bench-{time.strftime('%Y%m%d-%H%M%S')}", "tune.pruner": "median",
        "tune.startup_trials": n + 2, "tune.timeout_s": None})
    spans = Spans()
    trial_spans: Dict[int, Tuple[float, float, str]] = {}
    alone_spans: Dict[int, Tuple[float, float]] = {}

    def alone(i: int) -> None:
        t0 = time.perf_counter()
        workflow.train(spark, _alone_config(tcfg, fixed, trials[i], root, i), run_name=f"bench-tune-alone-{i}")
        alone_spans[i] = (t0, time.perf_counter())

    gate_waits: List[Tuple[float, float]] = []  # (when the verdict was written, how long rank 0 had waited for it)

    def answer(original: Callable) -> Callable:
        def wrapper(gate, epoch, path):
            try:
                written = os.path.getmtime(path)  # rank 0 wrote the epoch's metrics, then waits for the verdict
            except OSError:
                written = None
            try:
                return original(gate, epoch, path)
            finally:
                if written is not None:
                    gate_waits.append((time.perf_counter(), max(0.0, time.time() - written)))
        return wrapper

    calls = {"n": 0}

    def next_trial(original: Callable) -> Callable:
        def wrapper(*a, **kw):
            i = calls["n"]
            calls["n"] += 1
            timed = 1 <= i <= n
            if timed and i % 2:
                alone(i)
            t0 = time.perf_counter()
            out = original(*a, **kw)
            if out is not None:
                trial_spans[i] = (t0, time.perf_counter(), out.state)
                if timed and not i % 2:
                    alone(i)
            return out
        return wrapper

    summary: Dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_env({"LAKEHOUSE_PROGRESS": "0"}))
        for owner, attr, name in ((sweep, "run_trial", "run_trial"), (sweep, "log_best", "log_best"),
                                  (sweep, "_register_best", "register_best"),
                                  (sweep, "log_study_artifacts", "study_artifacts"),
                                  (workflow, "prepare_data", "prepare"), (workflow, "train_in_run", "train_in_run"),
                                  (workflow, "register_and_promote", "register"),
                                  (restart, "launch_with_restarts", "ranks"),
                                  (optuna.study.Study, "ask", "ask"), (optuna.study.Study, "tell", "tell")):
            stack.enter_context(patched(owner, attr, spans.timer(name)))
        stack.enter_context(patched(sweep, "_next_trial", next_trial))
        stack.enter_context(patched(tune_trial.PruningGate, "_answer", answer))
        stack.enter_context(discarded(root, tcfg.mlflow, model))
        alone(0)  # warm-up: the driver's imports, the experiment, the registered model, the cache entry
        t_start = time.perf_counter()
        summary = sweep.run_tune(spark, tcfg, space_path, n_trials=n + 1)
        t_end = time.perf_counter()

    def trial_parts(s: float, e: float) -> Dict[str, float]:
        parts = {k: spans.within(k, s, e) for k in ("run_trial", "train_in_run", "ranks", "ask", "tell", "log_best")}
        return {"wall": e - s, "gate_wait": sum(w for t, w in gate_waits if s <= t <= e), **parts}

    def alone_parts(s: float, e: float) -> Dict[str, float]:
        return {"wall": e - s, **{k: spans.within(k, s, e) for k in ("prepare", "train_in_run", "ranks", "register")}}

    measured = {i: Pair(trial_parts(*trial_spans[i][:2]), alone_parts(*alone_spans[i]),
                        "alone first" if i % 2 else "trial first")
                for i in range(1, n + 1) if i in trial_spans and i in alone_spans}
    pairs, dropped = valid_pairs(measured, {i: s[2] for i, s in trial_spans.items()}, n)
    states = {str(i): s[2] for i, s in sorted(trial_spans.items())}
    if dropped:
        log.warning("tune overhead: %d of %d pair(s) left out: %s (trial states %s)", len(dropped), n, dropped,
                    states)
    runs = list(trial_spans.values()) + list(alone_spans.values())
    in_study = [r for r in runs if r[0] >= t_start]
    first = trial_spans[0] if 0 in trial_spans else (t_end, t_end, "")
    study = {
        "total": round((t_end - t_start) - sum(r[1] - r[0] for r in in_study), 3),
        "before_first_trial": round(first[0] - t_start, 3),
        "conversion_cache_hit": round(spans.within("prepare", t_start, first[0]), 3),
        "after_last_trial": round(t_end - max(r[1] for r in in_study), 3) if in_study else None,
        "register_best": round(spans.within("register_best", t_start, t_end), 3),
        "artifacts_and_plots": round(spans.within("study_artifacts", t_start, t_end), 3),
    }
    context = {"trials": n + 1, "first_trial_s": round(first[1] - first[0], 3), "timed_pairs": len(pairs),
               "epochs": EPOCHS, "trial_states": states,
               "conversions": summary.get("conversions"), "world_size": world_size_of(tcfg),
               "backend": tcfg.train.backend, "batch_size": tcfg.data.batch_size, "pruner": "median (cannot prune)",
               "storage": "sqlite (bench's own)", "path": "pipeline.tune.sweep.run_tune vs pipeline.workflow.train"}
    result = overhead_result(pairs, prep.name, study, context, dropped)
    log.info("tune overhead on %s: trial %.2f s, train alone %.2f s, ratio %.3f (%s)", prep.name,
             result.parts["trial_s"], result.parts["train_alone_s"], result.ratio,
             ", ".join(f"{p.overhead:.3f}" for p in pairs))
    return [result, from_parts_result(pairs, prep.name, dropped)]

