"""What every measurement shares: the targets, the work sizes, the Result record and the timing helpers."""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from pipeline.log import get_logger

log = get_logger(__name__)

# name -> (comparison, target, what the ratio is)
TARGETS: Dict[str, Tuple[str, float, str]] = {
    "loader_efficiency": (">=", 0.9, "rows/s of the train ShardLoader as configured (a shard that fits "
                                     "data.memory_cache_mb is served from memory after its first pass) / rows/s of a "
                                     "hand-written pyarrow loop over the same Parquet files with the same PixelsToTensor"),
    "loader_efficiency_uncached": (">=", 0.9, "the same with data.memory_cache_mb=0: the ShardLoader reads every "
                                              "epoch through its reader / the same pyarrow loop"),
    "input_bound_fraction": ("<=", 0.10, "1 - step time of the product's train() (Lightning, HorovodStrategy, 1 rank) "
                                         "on real batches held in memory / the same with the real ShardLoader"),
    "conversion_vs_plain_write": ("<=", 1.2, "first convert_for_training (train and val into the converted-data "
                                             "cache) / plain df.write.parquet of the same prepared DataFrames"),
    "conversion_cache_hit": ("<=", 0.05, "second convert_for_training of the same pinned table (a cache hit) / "
                                           "the first"),
    "horovod_cpu_scaling": (">=", 1.8, "samples/s of the product's train() (Lightning, HorovodStrategy, real "
                                       "ShardLoader) with 2 ranks x 1 thread / with 1 rank x 1 thread"),
    "horovod_pipeline_over_alone": (">=", 0.9, "samples/s of the product's train() with 2 ranks / Horovod alone "
                                               "(hand-written loop, hvd.DistributedOptimizer, real rows held in "
                                               "memory) with 2 ranks, in the same rank processes"),
    "shard_balance": ("<=", 1.05, "most / fewest rows read per rank in one epoch of a 2-shard plan"),
    "checkpoint_overhead": ("<=", 0.05, "time saving checkpoints / epoch time (the project's train loop)"),
    "tracking_overhead": ("<=", 1.03, "epoch (step) time with RankZeroTracker.log_epoch into a SQLite-store run / "
                                      "the same without the time spent in it"),
    "tune_overhead": ("<=", 1.10, "wall time of one `lakehouse tune` trial (Optuna ask/tell, MLflow child run, pruning "
                                  "gate, the ranks) / the same `train` with the same overrides run alone (its cache-hit "
                                  "data preparation included, its model registration not: a trial registers nothing)"),
    "restart_cost": ("<=", 1.0, "(wall time of a `train` whose rank 1 fails once at an epoch's last step, with "
                                "train.max_restarts=1 - the same run uninterrupted) / (one epoch + process start): the "
                                "issue's wall(failure) / wall(uninterrupted) <= 1 + (epoch + process start) / total"),
    "predict_throughput": (">=", 0.8, "rows/s of `lakehouse predict` (predict_table in a warm local[2] session: pinned "
                                      "Delta read, mlflow.pyfunc.spark_udf, Delta write and commit) / rows/s of the "
                                      "same registered pyfunc called directly in one process on the same rows (in calls "
                                      "within its per-call row limit, MAX_ROWS_PER_CALL)"),
    "cross_host_epoch": ("<=", 1.15, "epoch time of `lakehouse train` with 2 Horovod ranks as Spark tasks, one on each "
                                     "of two worker hosts (network namespaces on a veth bridge, scripts/multihost.sh) / "
                                     "the same with both ranks' executors on one host's 127.0.0.1; first epoch left "
                                     "out, runs alternated"),
    "job_fixed_cost": ("<=", 0.5, "seconds of a 2-rank `lakehouse train` of the sample (3 epochs, a new process as a "
                                  "user runs it) outside its epochs (interpreter and Spark start, data, run set-up, "
                                  "rank start, model logging, registration and gate, exit) / the job's wall time"),
    "early_start_before_first_step": ("<=", 0.9, "time before the first step (process, data, run set-up, rank start) "
                                                 "of a 2-rank `lakehouse train` of the sample with train.early_start="
                                                 "true (the ranks start while the driver prepares) / the same with "
                                                 "false; per backend and data.source, jobs alternated "
                                                 "(bench/job_phases.py)"),
    "direct_wall": ("<=", 1.0, "wall time of a 2-rank `lakehouse train` with data.source=direct (the ranks read the "
                               "table's own files) / the same with data.source=converted, no cache entry (vs_first) "
                               "or a warm one (vs_warm); data.decode=cpu on both (bench/direct_source.py)"),
    "direct_before_first_step": ("<=", 1.0, "the same jobs' time before the first step (process, data, run set-up, "
                                            "rank start), direct / converted"),
    "direct_reader_over_pyarrow": (">=", 0.9, "rows/s of the direct reader (DirectShardReader, one rank reading every "
                                              "row of the synthetic table's files) / a plain pyarrow loop reading the "
                                              "same columns of the same files' row groups"),
    "direct_rank_memory": ("<=", 1.1, "peak RSS of the larger of the 2 ranks (ru_maxrss, logged per epoch as "
                                      "peak_rss_mb_rank_<r>) of a data.source=direct job of the synthetic table / the "
                                      "same of a converted job with no cache entry"),
    "horovod_epoch_over_ddp": ("<=", 1.05, "steady epoch time (epochs after the first) of a 2-rank `lakehouse train` "
                                           "of the synthetic table (batch 32 per rank, 3 epochs) with "
                                           "train.backend=horovod / with ddp, same plan, batch and rows; jobs "
                                           "alternated"),
    "step_overhead_ms": ("<=", 0.5, "milliseconds per step of the product's train() (Lightning, the backend's "
                                    "strategy, every callback) minus a plain PyTorch loop (same network, optimizer, "
                                    "precision and gradient averaging) on the same batches held on the device, tiny "
                                    "cnn, batch 16 per rank, on a CPU; per backend and world size "
                                    "(bench/step_overhead.py)"),
    "gpu_step_overhead_ms": ("<=", 0.25, "the same on a GPU: milliseconds per step of train() minus the plain loop on "
                                         "the same GPU-resident batches"),
    "gpu_lightning_over_plain": (">=", 0.8, "images/s of the product's train() (Lightning, HorovodStrategy) on "
                                            "GPU-resident batches / a plain PyTorch loop on the same batches, same "
                                            "model, batch and precision, one GPU"),
    "gpu_input_bound_fraction": ("<=", 0.05, "1 - step time of the product's train() on GPU-resident batches / the "
                                             "same with the real ShardLoader, one GPU"),
    # ImageNet-shaped photos (~400x350 JPEG rows) at 224 px, bf16-mixed, one GPU (bench/photos_gpu.py)
    "cpu_decode_large_photo_speedup": (">=", 1.3, "images/s of the CPU decode of a crop to 224 px (crops.crop_hwc: "
                                                  "decode, random resized crop and flip or the center crop) of 4032x3024 "
                                                  "JPEGs with the reduced-scale JPEG decode / the same crops decoded at "
                                                  "full size, one thread (bench/photo_decode.py)"),
    "cpu_photos_decode_per_core": (">=", 0.9, "images/s per decode worker of the rank's CPU decoder (header, random "
                                              "resized crop and flip to 224 px) with one worker per core / a plain "
                                              "Pillow decode loop on one core, ImageNet-shaped JPEGs "
                                              "(bench/photo_decode.py)"),
    "cpu_photos_decode_over_pillow_every_core": (">=", 0.9, "images/s of the rank's CPU decoder with one worker per "
                                                            "core / a plain Pillow decode loop run on every core at "
                                                            "once, same ImageNet-shaped JPEGs (bench/photo_decode.py)"),
    "gpu_photos_loader_images_per_s": (">=", 6000.0, "images/s of the train ShardLoader alone with data.decode=gpu "
                                                     "(nvJPEG, crop, flip), each batch normalised into bf16 on the "
                                                     "GPU"),
    "split_plan_digest_speedup": (">=", 10.0, "seconds of the direct path's plan of the content split "
                                              "(`split_index`) over a table of ImageNet-shaped photos without the "
                                              "sha256 column (every image read and hashed) / over the same rows with "
                                              "it (the stored digests read), both from the page cache"),
    "gpu_photos_cpu_decode_per_core": (">=", 0.9, "images/s per decode worker of the train ShardLoader alone with "
                                                  "data.decode=cpu (all cores) / a plain Pillow decode loop on one "
                                                  "core, same bytes"),
    "gpu_photos_host_memory_gpu_over_cpu": ("<=", 1.0, "host memory (summed PSS) of the process tree running the "
                                                       "loader, its decode workers included, with data.decode=gpu / "
                                                       "the same with data.decode=cpu"),
    "gpu_photos_train_over_plain": (">=", 0.97, "images/s of train() on GPU-resident photo batches / a plain "
                                                "channels_last bf16 PyTorch loop on the same batches, one GPU"),
    "gpu_photos_images_per_s": (">=", 2600.0, "images/s per GPU of train() with the real ShardLoader decoding the "
                                              "photos (timm resnet50's target; resnet18 is judged by it too)"),
    "gpu_photos_loader_over_memory": (">=", 0.95, "images/s of train() with the real ShardLoader / train() on "
                                                  "GPU-resident batches (resnet50: 0.95, resnet18: 0.85)"),
}


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does; --quick only proves the bench runs."""

    synthetic_rows: int
    repeats: int
    loader_min_rows: int  # rows read per loader repeat (whole epochs)
    train_steps: int  # steps per window of a train() run (one window = one repeat)
    warmup_steps: int  # untimed training steps before the first timed one (a process reaches steady speed after ~200)
    hvd_steps: int  # steps per window of the hand-written reference loops
    job_pairs: int = 0  # timed pairs of whole trainings (restart_cost, tune_overhead); 0: `repeats`

    @property
    def pairs(self) -> int:
        return self.job_pairs or self.repeats


FULL = Sizes(synthetic_rows=50_000, repeats=5, loader_min_rows=200_000, train_steps=60, warmup_steps=250,
             hvd_steps=60)
# --quick times one pair of whole trainings where a pair is two ~20 s jobs (restart cost, tune overhead)
QUICK = Sizes(synthetic_rows=2_000, repeats=2, loader_min_rows=10_000, train_steps=16, warmup_steps=8,
              hvd_steps=16, job_pairs=1)


@dataclass
class Result:
    """One ratio on one data set: the two measured parts, every repeat, the spread and the verdict.

    `variant` tells apart figures of the same ratio and data set (another reader, a precision); its key is then
    `<name>/<data set>/<variant>`.
    """

    name: str
    dataset: str
    ratio: float
    parts: Dict[str, Any]
    repeats: int
    per_repeat: List[float]
    method: str = ""
    target: float = 0.0
    op: str = ""
    passed: bool = False
    spread: Dict[str, float] = field(default_factory=dict)
    note: str = ""
    variant: str = ""

    def __post_init__(self) -> None:
        self.op, self.target, desc = TARGETS[self.name]
        self.method = self.method or desc
        self.passed = bool(self.ratio >= self.target if self.op == ">=" else self.ratio <= self.target)
        vals = [v for v in self.per_repeat if v == v]
        if vals:
            mid = statistics.median(vals)
            self.spread = {"min": min(vals), "max": max(vals),
                           "rel": (max(vals) - min(vals)) / abs(mid) if mid else 0.0}

    @property
    def key(self) -> str:
        return f"{self.name}/{self.dataset}" + (f"/{self.variant}" if self.variant else "")


# The report's verdict (`verdict`), written into every report as `verdict_rule`.
VERDICT_RULE = ("all_passed: at least one figure was measured, every one passed, and `complete` holds. complete: no "
                "part asked for failed or yielded no figure (`failed`: a part that raised or gave nothing, a figure "
                "that could not be measured, NaN, with the reason) and none asked for by name (--only, --gpu) was "
                "skipped. A part this machine cannot run (no CUDA for `gpu`, no multi-host cluster for `cross_host`) "
                "is listed in `skipped` with the reason and counts against neither when it was only implied (no "
                "--only); a figure a part leaves out by design or for the machine (`skipped` under the figure's key) "
                "never counts")


def verdict(results: List["Result"], skipped: Dict[str, str], failed: Dict[str, str],
            explicit: Sequence[str]) -> Dict[str, Any]:
    """{"all_passed", "complete", "failed"} of a report (VERDICT_RULE). `skipped` and `failed`: {part or figure key:
    reason}; `explicit`: the parts asked for by name. The figures that are NaN join `failed` under their key, with
    their note as the reason."""
    failed = {**failed, **{r.key: r.note or "not measured (NaN)" for r in results if r.ratio != r.ratio}}
    complete = bool(results) and not failed and not any(k in explicit for k in skipped)
    return {"all_passed": complete and all(r.passed for r in results), "complete": complete, "failed": failed}


def median(values: List[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN where the denominator is 0 or NaN (a figure that could not be measured)."""
    return numerator / denominator if denominator and denominator == denominator else float("nan")


def input_bound_fraction(step_s_in_memory: float, step_s_real_loader: float) -> float:
    """The share of a step the loader adds: 1 - in-memory step time / real-loader step time (<= 0: not input-bound)."""
    return 1.0 - ratio(step_s_in_memory, step_s_real_loader)


def windows_rate(per_rank: List[Dict[str, Any]], window: int) -> float:
    """Samples/s of window `window` over all ranks: every rank's samples / the slowest rank's wall time."""
    slowest = max(r["window_s"][window] for r in per_rank)
    return ratio(sum(r["batch_size"] * r["steps"] for r in per_rank), slowest)


@contextlib.contextmanager
def patched(owner: Any, attr: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace `owner.attr` by `make(original)` for the block (timing wrappers; the bench's only intrusion)."""
    original = owner.__dict__[attr]
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


@contextlib.contextmanager
def discarded(folder: str, mlflow_cfg: Any, registered_model: str) -> Iterator[None]:
    """The block's scratch `folder` and the bench's own registered model are deleted when it ends, however it ends."""
    import shutil

    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        try:
            from pipeline.tracking.runs import configure

            configure(mlflow_cfg).delete_registered_model(registered_model)
        except Exception as exc:
            log.warning("could not delete the bench's registered model %r: %s", registered_model, exc)


@contextlib.contextmanager
def torch_threads(n: Optional[int]) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block (None: left as they are)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, n) if n is not None else old)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sync(dev) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize()


def interleaved(first: Callable[[], float], second: Callable[[], float],
                repeats: int) -> Tuple[List[float], List[float]]:
    """Run each of two measurements once per repeat, `first` first on even repeats and `second` first on odd ones."""
    a, b = [], []
    for r in range(repeats):
        if r % 2:
            b.append(second())
            a.append(first())
        else:
            a.append(first())
            b.append(second())
    return a, b


def machine() -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__, "device": "cpu", "gpus": 0}
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2 ** 30, 1)
    except Exception:
        pass
    if torch.cuda.is_available():
        info.update(device="cuda", gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name(0))
    return info


def load() -> List[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []
