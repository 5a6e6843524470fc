"""`lakehouse bench`: the pipeline's performance as ratios of two quantities measured in the same run, with targets.

One module per measurement (conversion, loader, input_bound, shard_balance, scaling, overheads, gpu, tune_overhead,
restart_cost, job_phases, epoch_parity, cross_host, step_overhead, photo_decode, split_digest), the references they
are compared with (reference), the product's train() timed step by step (lightning_path) and in Horovod ranks (jobs);
this runner assembles them into one report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from bench.core import FULL, QUICK, TARGETS, VERDICT_RULE, Result, Sizes, load, machine, verdict
from pipeline.config import Config, ConfigError
from pipeline.log import get_logger, quiet_third_party_warnings

quiet_third_party_warnings()
log = get_logger(__name__)

__all__ = ["run_bench", "TARGETS", "Result", "Sizes", "FULL", "QUICK"]


def loaders_side_by_side(results: List[Result]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """{data set: {reader: {"cached" | "uncached": loader efficiency}}} from the loader results."""
    table: Dict[str, Dict[str, Dict[str, float]]] = {}
    for r in results:
        if r.name.startswith("loader_efficiency"):
            kind = "uncached" if r.name.endswith("_uncached") else "cached"
            table.setdefault(r.dataset, {}).setdefault(r.parts["reader"], {})[kind] = r.ratio
    return table


MEASUREMENTS = ("loader", "input_bound", "shard_balance", "predict_throughput", "overheads", "tune_overhead",
                "restart_cost", "scaling", "gpu", "job_phases", "epoch_parity", "cross_host", "step_overhead", "direct_source",
                "photo_decode", "split_digest")
# what `--only` picks from; the conversion always runs (it prepares), unless only STANDALONE ones are asked for:
# cross_host trains on the multi-host cluster's own table, step_overhead on batches it makes, photo_decode decodes
# photos it renders, split_digest plans the split of tables it writes with delta-rs (no Spark)
STANDALONE = ("cross_host", "step_overhead", "photo_decode", "split_digest")


def run_bench(cfg: Config, quick: bool = False, out: str = "work/bench/bench.json",
              only: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run every measurement on the ingested sample and a synthetic table; write `out` (JSON) and return it.

    The MLflow run (experiment `<mlflow.experiment>-bench`) receives the per-epoch metrics of the tracking
    measurement and, unless `quick`, the report as `bench.json` and the ratios as metrics. `only`: run just these of
    MEASUREMENTS (the conversion, which prepares both data sets, always runs).
    """
    unknown = sorted(set(only or ()) - set(MEASUREMENTS))
    if unknown:
        raise ConfigError(f"bench --only: unknown measurement(s) {', '.join(unknown)}; choose from "
                          f"{', '.join(MEASUREMENTS)}")

    def want(name: str) -> bool:
        return not only or name in only

    local = [m for m in MEASUREMENTS if want(m) and m not in STANDALONE]  # the ones on this machine's sample

    from bench import (conversion, cross_host, direct_source, epoch_parity, gpu, input_bound, job_phases, loader,
                       overheads, photo_decode, predict_throughput, restart_cost, scaling, shard_balance, split_digest,
                       step_overhead, tune_overhead)
    from bench.datasets import ensure_sample, ensure_synthetic
    from bench.report import log_table, log_to_mlflow
    from pipeline.data.cache import remove_entry
    from pipeline.lakehouse.spark import spark_session
    from pipeline.tracking.runs import tracked_run

    sizes = QUICK if quick else FULL
    if cfg.train.threads_per_rank is None:  # every figure is per rank x 1 thread unless the config says otherwise
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads_per_rank=1))
    t_start = time.perf_counter()
    out = os.path.abspath(out)
    work_dir = os.path.dirname(out)
    os.makedirs(work_dir, exist_ok=True)
    readers = loader.available_readers(cfg)
    report: Dict[str, Any] = {
        "bench": "lakehouse", "quick": quick, "repeats": sizes.repeats,
        "repeats_note": ("--quick: 2 repeats after a warm-up (one timed pair of whole trainings for the restart "
                           "cost and the tune overhead); it proves the bench runs, the figures are indicative"
                         if quick else f"median of {sizes.repeats} repeats after a warm-up"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "load": {"before": load()},
        "sizes": dataclasses.asdict(sizes), "config": {k: v for k, v in cfg.flat().items() if k.startswith("data.")},
        "readers": {"configured": loader.configured_reader(cfg), "measured": readers},
        "only": sorted(only) if only else None, "verdict_rule": VERDICT_RULE,
    }
    results: List[Result] = []
    seconds: Dict[str, float] = {}  # measurement -> its wall time in this run (the conversion's: "conversion")

    @contextlib.contextmanager
    def timed(name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0

    datasets: Dict[str, Any] = {}
    per_device: Dict[str, Any] = {}
    bench_cfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, experiment=f"{cfg.mlflow.experiment}-bench"))
    log.info("bench%s: %d repeat(s), synthetic table of %d images, readers %s", " --quick" if quick else "",
             sizes.repeats, sizes.synthetic_rows, readers)
    skipped: Dict[str, str] = {}  # part -> why this machine cannot run it
    failed: Dict[str, str] = {}  # part -> why it gave no figure
    cluster = None
    if want("cross_host"):
        try:
            cluster = cross_host.cluster_state()
        except ConfigError as exc:
            if only:  # asked for by name: it must run
                raise
            skipped["cross_host"] = str(exc)
            log.warning("bench: cross_host skipped: %s", exc)
    report["skipped"] = skipped

    def part(name: str, measure: Callable[[], List[Result]]) -> None:
        """Run one part; one that gives no figure is listed in `failed` (one that raises ends the bench)."""
        found = measure()
        results.extend(found)
        if not found:
            failed[name] = "yielded no figure"
            log.error("bench: %s yielded no figure", name)

    with spark_session(cfg) if local else contextlib.nullcontext() as spark:  # no Spark where nothing needs it
        synth = {}
        if local:
            ensure_sample(spark, cfg, work_dir)
            synth = ensure_synthetic(spark, cfg, sizes.synthetic_rows)
        preps: List[Any] = []
        try:
            for name, table in ((("sample", cfg.delta.table), ("synthetic", synth["table"])) if local else ()):
                with timed("conversion"):
                    prep, conv_results = conversion.measure_conversion(spark, cfg, name, table, sizes, work_dir)
                preps.append(prep)
                results.extend(conv_results)
                datasets[name] = prep.info()
            if local:
                datasets["synthetic"].update(synth)
            with tracked_run(bench_cfg, run_name="bench-quick" if quick else "bench",
                             tags={"bench": "true", "quick": quick}) as run:
                one_rank = {}
                for prep in preps:
                    log.info("measuring on %s (%d rows)", prep.name, prep.rows)
                    if want("loader"):
                        with timed("loader"):
                            for reader in readers:
                                results.append(loader.measure_loader(cfg, prep, sizes, reader))
                                if results[-1].parts["kept_in_memory"]:
                                    results.append(loader.measure_loader(cfg, prep, sizes, reader, uncached=True))
                    if want("input_bound") or (want("scaling") and prep is preps[-1]):
                        with timed("input_bound"):
                            one_rank[prep.name] = input_bound.one_rank_job(cfg, prep, sizes)
                    if want("input_bound"):
                        with timed("input_bound"):
                            res, dev = input_bound.measure_input_bound(cfg, prep, sizes, one_rank[prep.name])
                        results.append(res)
                        per_device[prep.name] = dev
                    if want("scaling") and prep is preps[-1]:
                        # right after the 1-rank job it divides by (the 2-rank job, then a 1-rank job again: the
                        # bracket), not at the end of the bench tens of minutes later
                        with timed("scaling"):
                            part("scaling", lambda: scaling.measure_horovod_scaling(cfg, prep, sizes,
                                                                                    one_rank[prep.name]))
                    if want("shard_balance"):
                        with timed("shard_balance"):
                            results.append(shard_balance.measure_shard_balance(cfg, prep))
                    if want("predict_throughput"):
                        with timed("predict_throughput"):
                            results.append(predict_throughput.measure_predict_throughput(
                                spark, bench_cfg, prep.name, prep.table, sizes, work_dir))
                # Checkpoint and tracking cost a fixed time per epoch, so the sample's short epochs are the worst
                # case; the synthetic table's epochs are ~30x longer.
                measures = {
                    "overheads": lambda: overheads.measure_train_overheads(cfg, preps[0], sizes, run),
                    "tune_overhead": lambda: tune_overhead.measure_tune_overhead(spark, bench_cfg, preps[0], sizes,
                                                                                 work_dir),
                    "restart_cost": lambda: restart_cost.measure_restart_cost(spark, bench_cfg, preps[0], sizes,
                                                                              work_dir),
                    "job_phases": lambda: job_phases.measure_job_phases(bench_cfg, preps[0], sizes, work_dir,
                                                                        quick=quick),
                    "direct_source": lambda: direct_source.measure_direct_source(bench_cfg, preps[0], sizes, work_dir,
                                                                                 quick=quick, spark=spark),
                    "epoch_parity": lambda: epoch_parity.measure_epoch_parity(bench_cfg, preps[-1], sizes, work_dir,
                                                                              quick=quick),
                    "cross_host": lambda: cross_host.measure_cross_host(sizes, quick=quick),
                    "step_overhead": lambda: step_overhead.measure_step_overhead(cfg, sizes, work_dir, quick=quick),
                    "split_digest": lambda: split_digest.measure_split_digest(sizes, quick=quick),
                    "photo_decode": lambda: (photo_decode.measure_photo_decode(sizes, quick=quick)
                                             + photo_decode.measure_decode_per_core(sizes, quick=quick)),
                }
                for name, measure in measures.items():
                    if want(name) and (name != "cross_host" or cluster is not None):
                        with timed(name):
                            part(name, measure)
                if want("gpu"):
                    with timed("gpu"):
                        no_cuda = gpu.cuda_problem()
                        if no_cuda:  # counts against the verdict only when asked for by name (--only gpu)
                            skipped["gpu"] = no_cuda
                            log.warning("bench: gpu skipped: %s", no_cuda)
                        else:
                            gpu_results, gpu_dev = gpu.measure_gpu(cfg, preps[-1], sizes)
                            part("gpu", lambda: gpu_results)
                            if gpu_dev:
                                per_device["gpu_per_precision"] = gpu_dev
                report["load"]["after"] = load()
                report["datasets"] = datasets
                report["throughput"] = per_device
                report["loaders"] = loaders_side_by_side(results)
                report["results"] = [dataclasses.asdict(r) for r in results]
                report["ratios"] = {r.key: r.ratio for r in results}
                report["passed"] = {r.key: r.passed for r in results}
                judged = verdict(results, skipped, failed, explicit=only or ())
                report["skipped"], report["failed"] = skipped, judged["failed"]
                report["all_passed"], report["complete"] = judged["all_passed"], judged["complete"]
                report["duration_s"] = time.perf_counter() - t_start
                report["measurement_s"] = {k: round(v, 1) for k, v in seconds.items()}  # where the run's time went
                report["mlflow_run_id"] = run.run_id
                if not quick:
                    log_to_mlflow(run, report)
        finally:
            for prep in preps:
                remove_entry(prep.data.entry_url)
            conversion.remove_bench_cache(cfg, work_dir)
    report["out"] = out
    with open(out, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    log_table(report)
    log.info("bench report written to %s (%.0f s; per measurement: %s)", out, report["duration_s"],
             ", ".join(f"{k} {v:.0f} s" for k, v in report.get("measurement_s", {}).items()))
    return report
