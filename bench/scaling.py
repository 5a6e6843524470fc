"""Horovod scaling of the product's train() (Lightning, HorovodStrategy, real ShardLoader), 2 ranks / 1, beside its
controls measured in the same run: independent plain processes, and Horovod alone on batches held in memory. The
1-rank figure brackets the 2-rank job: the 1-rank job right before it and another right after it."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from bench.core import Result, Sizes, median, ratio, windows_rate
from bench.input_bound import LOADER_RUN, later_warmup, runs, warmup_run
from bench.jobs import launch, per_run, run_spec
from bench.reference import solo_run
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)


def _rates(ranks: List[Dict[str, Any]]) -> List[float]:
    return [windows_rate(ranks, w) for w in range(len(ranks[0]["window_s"]))]


def _cores(ranks: List[Dict[str, Any]], key: str) -> float:
    """CPU cores used over the windows, summed over ranks (all threads, or the training thread alone)."""
    return sum(sum(r[key]) / sum(r["window_s"]) for r in ranks)


def measure_horovod_scaling(cfg: Config, prep, sizes: Sizes, one_rank_job: List[Dict[str, Any]]) -> List[Result]:
    """The pipeline's 2-rank / 1-rank scaling, and its 2-rank throughput / Horovod alone's, with the controls.

    `one_rank_job`: input_bound.one_rank_job on the same data set, run just before (its run LOADER_RUN is the
    pipeline on 1 rank). Right after the 2-rank job, a 1-rank job again (the same runs up to LOADER_RUN): the 1-rank
    rate of window k is the mean of the two jobs' window k, so that drifting load falls on both sides. The 2-rank job
    runs, in the same two rank processes after an untimed warm-up train(): Horovod alone, the pipeline, the pipeline
    on in-memory batches, Horovod alone again. machine: two independent plain processes at once / one (what this
    machine gives a second process); horovod_alone: Horovod with 2 ranks on in-memory batches / one plain process (a
    size-1 Horovod optimizer does no allreduce, so the plain process is its 1-rank run). The pipeline can only
    approach horovod_alone, which can only approach machine.
    """
    steps, windows = sizes.train_steps, sizes.repeats
    one = per_run(one_rank_job, LOADER_RUN)
    two_job = launch(cfg, prep.data, 2, [warmup_run(sizes), run_spec("horovod_alone", later_warmup(sizes)),
                                         run_spec("train", later_warmup(sizes), "loader"),
                                         run_spec("train", later_warmup(sizes), "memory"),
                                         run_spec("horovod_alone", later_warmup(sizes))], steps, windows)
    alone_a, two, two_mem, alone_b = (per_run(two_job, i) for i in range(1, 5))  # run 0: the warm-up
    one_after = per_run(launch(cfg, prep.data1, 1, runs(sizes)[:LOADER_RUN + 1], steps, windows), LOADER_RUN)
    one_before_rates, one_after_rates = _rates(one), _rates(one_after)
    one_rates = [(a + b) / 2 for a, b in zip(one_before_rates, one_after_rates)]
    two_rates, two_mem_rates = _rates(two), _rates(two_mem)
    alone_rates = [(a + b) / 2 for a, b in zip(_rates(alone_a), _rates(alone_b))]
    log.info("pipeline (train() + HorovodStrategy + ShardLoader): 1 rank %.0f, 2 ranks %.0f samples/s; Horovod alone "
             "2 ranks %.0f", median(one_rates), median(two_rates), median(alone_rates))
    # The single plain process is measured before and after the others, so that drifting load on a shared machine
    # does not sit only in the denominator.
    solo1_windows = solo_run(cfg, prep.data1, 1, sizes)["samples_per_s"]
    solo2 = median(solo_run(cfg, prep.data1, 2, sizes)["samples_per_s"])
    solo1 = median(solo1_windows + solo_run(cfg, prep.data1, 1, sizes)["samples_per_s"])
    mem2 = median(alone_rates)
    log.info("controls, in-memory batches: 1 plain process %.0f, 2 plain processes %.0f, Horovod alone 2 ranks %.0f "
             "samples/s", solo1, solo2, mem2)
    scaling = ratio(median(two_rates), median(one_rates))
    machine, alone = ratio(solo2, solo1), ratio(mem2, solo1)
    over_alone = ratio(median(two_rates), mem2)
    parts = {"samples_per_s_2_ranks": median(two_rates), "samples_per_s_1_rank": median(one_rates),
             "samples_per_s_1_rank_before": median(one_before_rates),
             "samples_per_s_1_rank_after": median(one_after_rates),
             "compared": "the 2-rank job's windows / the mean of the same windows of the 1-rank job run just before "
                         "it (input_bound's) and of a 1-rank job run just after it",
             "path": "pipeline.distributed.loop.train() + HorovodStrategy + ShardLoader, horovod.run (gloo)",
             "control_machine_2_procs_over_1": machine, "control_horovod_alone_2_ranks_over_1": alone,
             "control_samples_per_s": {"plain_1_proc": solo1, "plain_2_procs": solo2,
                                       "horovod_2_ranks_in_memory": mem2,
                                       "pipeline_2_ranks_in_memory": median(two_mem_rates)},
             "pipeline_over_horovod_alone": ratio(scaling, alone),
             "pipeline_2_ranks_over_horovod_alone_2_ranks": over_alone,
             "loader_wait_fraction_per_epoch_2_ranks": median(two[0]["data_wait_fraction_per_epoch"]),
             "loader_wait_fraction_per_epoch_1_rank": median(one[0]["data_wait_fraction_per_epoch"]),
             "cpu_cores_used_1_rank": _cores(one, "cpu_s"), "cpu_cores_used_2_ranks": _cores(two, "cpu_s"),
             "main_thread_cores_1_rank": _cores(one, "main_thread_cpu_s"),
             "main_thread_cores_2_ranks": _cores(two, "main_thread_cpu_s"),
             "cpu_cores_used_horovod_alone_2_ranks": _cores(alone_a, "cpu_s"),
             "cpus": os.cpu_count(), "horovod_env": two_job[0]["horovod_env"],
             "threads_per_rank": max(1, cfg.train.threads_per_rank), "warmup_steps": sizes.warmup_steps,
             "steps_per_window": steps}
    note = (f"controls in the same run: two independent processes scale {machine:.2f}x on this machine, Horovod "
            f"alone (2 ranks, in-memory batches, no loader) {alone:.2f}x, the pipeline {scaling:.2f}x. 1 rank used "
            f"{parts['cpu_cores_used_1_rank']:.2f} cores (training thread {parts['main_thread_cores_1_rank']:.2f}); "
            f"2 ranks {parts['cpu_cores_used_2_ranks']:.2f} of {os.cpu_count()} (training threads "
            f"{parts['main_thread_cores_2_ranks']:.2f}): each rank's Horovod background and Gloo threads and its "
            f"spin-wait for the allreduce take CPU from the other rank's training thread when ranks have no spare core")
    note_alone = (f"2 ranks: the pipeline {median(two_rates):.0f} samples/s, the pipeline on in-memory batches "
                  f"{median(two_mem_rates):.0f}, Horovod alone {mem2:.0f}: the loader costs "
                  f"{1 - ratio(median(two_rates), median(two_mem_rates)):.2f} of the pipeline's in-memory rate, "
                  f"Lightning with the strategy and callbacks {1 - ratio(median(two_mem_rates), mem2):.2f} of "
                  f"Horovod alone's")
    return [
        Result("horovod_cpu_scaling", prep.name, scaling, parts, windows,
               [ratio(b, a) for a, b in zip(one_rates, two_rates)], note=note),
        Result("horovod_pipeline_over_alone", prep.name, over_alone,
               {"pipeline_samples_per_s_2_ranks": median(two_rates), "horovod_alone_samples_per_s_2_ranks": mem2,
                "pipeline_in_memory_samples_per_s_2_ranks": median(two_mem_rates)},
               windows, [ratio(p, a) for p, a in zip(two_rates, alone_rates)], note=note_alone),
    ]
