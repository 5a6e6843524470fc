"""Input-bound fraction: how much of a training step of the product's train() the real ShardLoader adds."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from bench.core import Result, Sizes, input_bound_fraction, median
from bench.jobs import launch, per_run, run_spec
from pipeline.config import Config


# A process speeds up over its first ~200 steps; a later run in the same process needs less warm-up.
def later_warmup(sizes: Sizes) -> int:
    return max(5, sizes.warmup_steps // 4)


def warmup_run(sizes: Sizes) -> Dict[str, Any]:
    """An untimed first train() of the job: a process's first one keeps speeding up well past its warm-up steps."""
    return run_spec("train", sizes.warmup_steps, "memory")


def runs(sizes: Sizes) -> List[Dict[str, Any]]:
    """Warm-up (not used), in-memory, real loader, in-memory again (the in-memory figure brackets the real one
    against drifting load). The real-loader run is LOADER_RUN."""
    return [warmup_run(sizes), run_spec("train", later_warmup(sizes), "memory"),
            run_spec("train", later_warmup(sizes), "loader"), run_spec("train", later_warmup(sizes), "memory")]


LOADER_RUN = 2


def one_rank_job(cfg: Config, prep, sizes: Sizes) -> List[Dict[str, Any]]:
    """The job on 1 Horovod rank (train() with the HorovodStrategy), over the 1-rank plan of `prep`."""
    return launch(cfg, prep.data1, 1, runs(sizes), sizes.train_steps, sizes.repeats)


def step_times(run: Dict[str, Any]) -> List[float]:
    return [w / run["steps"] for w in run["window_s"]]


def measure_input_bound(cfg: Config, prep, sizes: Sizes, job: List[Dict[str, Any]]) -> Tuple[Result, Dict[str, Any]]:
    """From `one_rank_job`: 1 - in-memory step time / real-loader step time, window by window."""
    mem_a, real, mem_b = (per_run(job, i)[0] for i in (LOADER_RUN - 1, LOADER_RUN, LOADER_RUN + 1))
    memory = [(a + b) / 2 for a, b in zip(step_times(mem_a), step_times(mem_b))]
    loader = step_times(real)
    ratios = [input_bound_fraction(m, r) for m, r in zip(memory, loader)]
    bs = real["batch_size"]
    per_dev = {"device": "cuda" if _cuda() else "cpu", "images_per_s_real_loader": bs / median(loader),
               "images_per_s_in_memory": bs / median(memory), "path": "train() + HorovodStrategy, 1 rank"}
    if per_dev["device"] == "cuda":
        per_dev["images_per_s_per_gpu"] = per_dev["images_per_s_real_loader"]
    waits = real["data_wait_fraction_per_epoch"]
    result = Result("input_bound_fraction", prep.name, median(ratios),
                    {"step_s_in_memory": median(memory), "step_s_real_loader": median(loader), "batch_size": bs,
                     "step_s_in_memory_before_and_after": [median(step_times(mem_a)), median(step_times(mem_b))],
                     "steps_per_repeat": real["steps"], "device": per_dev["device"],
                     "loader_wait_fraction_per_epoch_median": median(waits),
                     "reader": getattr(cfg.data, "reader", "petastorm"),
                     "torch_threads": max(1, cfg.train.threads_per_rank)},
                    len(ratios), ratios)
    return result, per_dev


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
