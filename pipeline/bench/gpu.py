"""GPU throughput per precision: images/s per GPU of the product's train() against a plain PyTorch loop on
GPU-resident batches, and the input-bound fraction with the real loader (only where torch sees CUDA)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from pipeline.bench.core import Result, Sizes, input_bound_fraction, median, ratio
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

PRECISIONS = ("32-true", "bf16-mixed")
MIN_BATCH = 256  # the target (Lightning / plain >= 0.8) holds at batch >= 256


def autocast_dtype(precision: Optional[str]):
    """The autocast dtype of a Lightning precision for the plain loop: None (no autocast) for 32-bit."""
    import torch

    if precision in (None, "32-true", "32"):
        return None
    if precision == "bf16-mixed":
        return torch.bfloat16
    if precision == "16-mixed":
        return torch.float16
    raise ValueError(f"bench: precision {precision!r} is not 32-true, bf16-mixed or 16-mixed")


def gpu_batch_size(cfg: Config) -> int:
    from pipeline.distributed.backoff import start_batch_size

    return max(MIN_BATCH, start_batch_size(cfg.data))  # data.batch_size may be `auto`


def gpu_results(dataset: str, figures: Dict[str, Dict[str, List[float]]]) -> Tuple[List[Result], Dict[str, Any]]:
    """Results from images/s per window: figures[precision] = {"plain": [...], "memory": [...], "loader": [...]}
    (plain loop on GPU-resident batches; train() on GPU-resident batches; train() with the real ShardLoader)."""
    results, per_dev = [], {}
    for precision, f in figures.items():
        lightning = [ratio(m, p) for m, p in zip(f["memory"], f["plain"])]
        bound = [input_bound_fraction(1 / m, 1 / r) for m, r in zip(f["memory"], f["loader"])]
        per_dev[precision] = {"images_per_s_per_gpu_plain_loop": median(f["plain"]),
                              "images_per_s_per_gpu_lightning_in_memory": median(f["memory"]),
                              "images_per_s_per_gpu_lightning_real_loader": median(f["loader"]),
                              "lightning_over_plain": median(lightning), "input_bound_fraction": median(bound)}
        results.append(Result("gpu_lightning_over_plain", dataset, median(lightning),
                              {"images_per_s_lightning": median(f["memory"]),
                               "images_per_s_plain_loop": median(f["plain"]), "precision": precision},
                              len(lightning), lightning, variant=precision))
        results.append(Result("gpu_input_bound_fraction", dataset, median(bound),
                              {"images_per_s_in_memory": median(f["memory"]),
                               "images_per_s_real_loader": median(f["loader"]), "precision": precision},
                              len(bound), bound, variant=precision))
    return results, per_dev


def measure_gpu(cfg: Config, prep, sizes: Sizes) -> Tuple[List[Result], Dict[str, Any]]:
    """On one GPU (1 Horovod rank), per precision: plain loop, train() in memory, train() with the real loader."""
    import torch

    if not torch.cuda.is_available():
        return [], {}
    from pipeline.bench.conversion import replan
    from pipeline.bench.input_bound import later_warmup
    from pipeline.bench.jobs import launch, per_run, run_spec

    bs = gpu_batch_size(cfg)
    data = replan(prep.data1, 1, bs)
    specs, labels = [], []
    for p in PRECISIONS:
        first = not specs
        specs += [run_spec("plain", sizes.warmup_steps if first else later_warmup(sizes), "memory", p, bs),
                  run_spec("train", later_warmup(sizes), "memory", p, bs),
                  run_spec("train", later_warmup(sizes), "loader", p, bs)]
        labels.append(p)
    job = launch(cfg, data, 1, specs, sizes.train_steps, sizes.repeats)
    figures = {}
    for i, label in enumerate(labels):
        plain, memory, loader = (per_run(job, 3 * i + k)[0] for k in range(3))
        figures[label] = {k: [r["batch_size"] * r["steps"] / w for w in r["window_s"]]
                          for k, r in (("plain", plain), ("memory", memory), ("loader", loader))}
    results, per_dev = gpu_results(prep.name, figures)
    per_dev.update(batch_size=bs, gpu=torch.cuda.get_device_name(0))
    return results, per_dev
