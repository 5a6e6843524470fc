"""ImageNet-shaped photos on one GPU (`lakehouse bench --gpu`): the loader alone with data.decode=cpu|gpu against a
Pillow loop per core, train() over a plain loop and with the real loader for timm resnet50 and resnet18 at 224 px in
bf16-mixed, and a process's peak host memory with each decode. No Spark: the rows are written with pyarrow.

How it is measured (one run; every ratio's two sides in the same run):
- Data: `photos_data.photos_without_spark`, JPEGs of about 400x350 from `sample-data --kind photos`'s generator.
- Loader alone (`loader_alone`): a fresh spawned process per decode builds the rank's data module as train() does
  (make_datamodule, uint8 batches where CUDA is present) and takes batches from the train ShardLoader, each moved
  to the device and normalised into bf16 there; images/s over `loader_batches` batches after a warm-up, the
  process's peak RSS (ru_maxrss; a fresh process per decode, so neither inherits the other's peak), and the host
  memory of the rank's whole process tree at the end of the timed batches: the sum of the PSS of the process and its
  decode workers (PSS splits the pages they share, so nothing is counted twice). The memory target compares the
  trees: with decode=cpu the decoded pixels live in the worker processes, which the process's own RSS leaves out.
- Training (`photo_rank_job`, one Horovod rank per arch, in this order): a plain PyTorch loop (model and batches
  channels_last, bf16 autocast, the batch normalised on the GPU as train() does), train() on the same GPU-resident
  uint8 batches, train() with the real ShardLoader at decode=gpu, then at decode=cpu. A run that fails is recorded
  with its error and the next one runs.
- A figure that could not be measured is a NaN result whose note is the error; one that cannot run here (no CUDA
  for decode=gpu) is listed under `skipped` with the reason.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench.core import Result, median, ratio
from bench.photos_rank import error_text, photo_rank_job
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

PHOTO_ARCHS = ("timm/resnet50", "timm/resnet18")
PRECISION = "bf16-mixed"
DECODES = ("gpu", "cpu")
# train() with the real loader / train() on GPU-resident batches (issue 36): per arch; another arch gets the first's
LOADER_OVER_MEMORY = {"timm/resnet50": 0.95, "timm/resnet18": 0.85}
# test-only: =1 runs the photo figures where torch has no CUDA, at a toy size (resnet18, 64 px, 64 images)
ON_CPU_ENV = "LAKEHOUSE_BENCH_PHOTOS_ON_CPU"


@dataclass(frozen=True)
class PhotoSizes:
    train_rows: int
    val_rows: int
    image_size: int
    batch_size: int
    warmup: int  # train steps dropped before the first timed one
    steps: int  # train steps per timed window
    windows: int
    loader_batches: int  # batches timed of the loader alone (after 2 untimed)
    reference_images: int  # images of the Pillow and one-thread decoder references
    memory_batches: int  # GPU-resident batches of the plain loop and of train() in memory
    archs: Tuple[str, ...] = PHOTO_ARCHS


FULL = PhotoSizes(4096, 512, 224, 256, 10, 20, 2, 16, 512, 8)
QUICK = PhotoSizes(2048, 512, 224, 256, 8, 16, 1, 8, 256, 4)
ON_CPU = PhotoSizes(64, 32, 64, 16, 2, 2, 1, 3, 32, 2, archs=("timm/resnet18",))


def on_cpu_switch() -> bool:
    return os.environ.get(ON_CPU_ENV) == "1"


def photo_sizes(quick: bool, cuda: bool) -> PhotoSizes:
    return (QUICK if quick else FULL) if cuda else ON_CPU


def photo_config(cfg: Config, sizes: PhotoSizes, arch: str, decode: str = "cpu") -> Config:
    """`cfg` for the photos: `arch` randomly initialised, 3 channels at sizes.image_size decoded by `decode`,
    channels_last, bf16-mixed, the reader every epoch (memory_cache_mb 0)."""
    data = dataclasses.replace(cfg.data, image_size=sizes.image_size, channels=3, decode=decode, channels_last=True,
                               batch_size=sizes.batch_size, memory_cache_mb=0, decode_workers=0)
    model = dataclasses.replace(cfg.model, arch=arch, pretrained=None, freeze_backbone=False, unfreeze_at_epoch=None,
                                backbone_lr=None, input_size=None)
    return dataclasses.replace(cfg, data=data, model=model, train=dataclasses.replace(cfg.train, precision=PRECISION))


# ------------------------------------------------------------------------------------------------ the loader alone
def _loader_child(data, cfg: Config, decode: str, batches: int, queue) -> None:
    """A fresh process: the train ShardLoader of rank 0 of 1 with data.decode=`decode`, batches into bf16 on the
    device; puts {images_per_s, workers, peak_rss_mb, ...} or {error} on `queue`."""
    try:
        import resource

        import psutil
        import torch

        from bench.core import device, sync
        from pipeline.data.datamodule import make_datamodule
        from pipeline.data.decode import default_workers
        from pipeline.log import setup_logging
        from pipeline.model.module import normalize_pixels

        setup_logging()
        dev = device()
        torch.zeros(1, device=dev)  # the CUDA context in both processes before the baseline
        base_mb = psutil.Process().memory_info().rss / 2 ** 20
        dm = make_datamodule(data, 0, 1, cfg.data, normalize_on_device=dev.type == "cuda")
        loader = dm.train_dataloader()

        def stream():
            while True:
                yield from loader

        it, images = stream(), 0

        def take() -> int:
            x, y = next(it)
            x = x.to(dev, non_blocking=True)
            x = (normalize_pixels(x) if x.dtype == torch.uint8 else x).to(torch.bfloat16)
            return len(y)

        for _ in range(2):  # threads, the decoder's pools, nvJPEG's handles
            take()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(batches):
            images += take()
        sync(dev)
        elapsed = time.perf_counter() - t0
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        tree_mb, tree_n = tree_pss_mb(psutil.Process())
        loader.close()
        queue.put({"images_per_s": images / elapsed, "images": images, "seconds": elapsed,
                   "decode_used": dm.decode_used, "workers": cfg.data.decode_workers or default_workers(1),
                   "peak_rss_mb": peak_mb, "baseline_rss_mb": base_mb, "rss_growth_mb": peak_mb - base_mb,
                   "tree_pss_mb": tree_mb, "tree_processes": tree_n})
    except BaseException as exc:  # reported, not raised: the parent records it and goes on
        queue.put({"error": error_text(exc)})


def tree_pss_mb(proc) -> Tuple[float, int]:
    """(MB, processes): the summed PSS of psutil process `proc` and its descendants (the rank and its decode workers);
    a process that ends while being read is left out."""
    import psutil

    total, count = 0, 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_full_info().pss
            count += 1
        except psutil.Error:
            pass
    return total / 2 ** 20, count


def spawned(target: Callable, args: Tuple, what: str, timeout_s: float) -> Any:
    """`target(*args, queue)` in a fresh spawned process (its own CUDA context and memory peak); what it put on the
    queue, or {error} naming `what` when it died or ran past `timeout_s`."""
    import multiprocessing as mp
    import queue as queues

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return q.get(timeout=2)
            except queues.Empty:
                pass
            if proc.exitcode is not None:
                return {"error": f"{what} exited with code {proc.exitcode} before reporting"}
            if time.monotonic() > deadline:
                return {"error": f"{what} did not report within {timeout_s:.0f} s"}
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def loader_alone(data, cfg: Config, decode: str, batches: int, timeout_s: float = 300) -> Dict[str, Any]:
    """`_loader_child` in a spawned process; its result, or {error} when it failed, died or ran past `timeout_s`."""
    return spawned(_loader_child, (data, cfg, decode, batches), f"the loader process (decode={decode})", timeout_s)


def _single_rank_child(cfg: Config, data, specs, steps: int, windows: int, queue) -> None:
    try:
        queue.put([photo_rank_job(cfg, data, specs, steps, windows, horovod=False)])
    except BaseException as exc:
        queue.put({"error": error_text(exc)})


def launch_photo_job(cfg: Config, data, specs, steps: int, windows: int, timeout_s: float = 600) -> List[Dict]:
    """One arch's rank job (`photo_rank_job`): a Horovod rank where Horovod is installed (as the product trains), else
    the same runs in one spawned process with Lightning's single-device strategy, so the photo figures need no Horovod
    build on a bare GPU machine. Results by rank; RuntimeError with the error where the process failed."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        log.info("photos: Horovod is not installed here: the %s job runs in one process (single-device strategy)",
                 cfg.model.arch)
        out = spawned(_single_rank_child, (cfg, data, specs, steps, windows), f"the {cfg.model.arch} job", timeout_s)
        if isinstance(out, dict):
            raise RuntimeError(out["error"])
        return out
    from bench import jobs

    return jobs.launch(cfg, data, 1, specs, steps, windows, rank_fn=photo_rank_job)


# -------------------------------------------------------------------------------------------- the arithmetic (pure)
def window_rates(run: Dict[str, Any]) -> Dict[str, Any]:
    """{images_per_s: [per window]} of one run, or its {error}."""
    if "error" in run:
        return {"error": run["error"]}
    return {"images_per_s": [run["batch_size"] * run["steps"] / w for w in run["window_s"]]}


def _derived(name: str, dataset: str, variant: str, inputs: Dict[str, Dict[str, Any]], per_repeat: Callable,
             parts: Dict[str, Any], skipped: Dict[str, str]) -> Optional[Result]:
    """A Result from figures `inputs` ({label: {images_per_s | error | skipped}}): None (and the reason in `skipped`)
    where one could not run here; else NaN with the errors as its note where one failed."""
    key = f"{name}/{dataset}" + (f"/{variant}" if variant else "")  # Result.key
    missing = [f"{k}: {v['skipped']}" for k, v in inputs.items() if "skipped" in v]
    if missing:
        skipped[key] = "; ".join(missing)
        return None
    errors = [f"{k}: {v['error']}" for k, v in inputs.items() if "error" in v]
    if errors:
        return Result(name, dataset, float("nan"), {**parts, "errors": errors}, 0, [], note="; ".join(errors),
                      variant=variant)
    values = per_repeat()
    return Result(name, dataset, median(values), parts, len(values), values, variant=variant)


def retarget(result: Optional[Result], target: float) -> Optional[Result]:
    """The same ratio judged against `target` (a per-arch target of the same name)."""
    if result is not None and result.target != target:
        result.target = target
        if result.ratio == result.ratio:
            result.passed = bool(result.ratio >= target if result.op == ">=" else result.ratio <= target)
    return result


def photo_results(dataset: str, fig: Dict[str, Any]) -> Tuple[List[Result], Dict[str, Any]]:
    """Results and the per-device dict from the measured figures:
    fig = {"pillow_per_core": {images_per_s | error}, "decoder_one_worker": {...},
           "loader": {decode: {images_per_s, workers, peak_rss_mb, ... | error | skipped}},
           "train": {arch: {"plain" | "memory" | "loader_gpu" | "loader_cpu": {images_per_s: [..] | error | skipped}}}}
    """
    results: List[Result] = []
    skipped: Dict[str, str] = {}
    loader = fig.get("loader", {})
    gpu, cpu = loader.get("gpu", {"skipped": "not run"}), loader.get("cpu", {"skipped": "not run"})
    pillow, one = fig.get("pillow_per_core", {"skipped": "not run"}), fig.get("decoder_one_worker", {})

    def first(f):
        v = f["images_per_s"]
        return v if isinstance(v, (int, float)) else median(v)

    def add(r):
        if r is not None:
            results.append(r)

    add(_derived("gpu_photos_loader_images_per_s", dataset, "decode=gpu", {"loader_gpu": gpu}, lambda: [first(gpu)],
                 {k: v for k, v in gpu.items() if k != "images_per_s"}, skipped))
    add(_derived("gpu_photos_cpu_decode_per_core", dataset, "", {"loader_cpu": cpu, "pillow": pillow},
                 lambda: [first(cpu) / cpu["workers"] / first(pillow)],
                 {"loader_cpu_images_per_s": cpu.get("images_per_s"), "workers": cpu.get("workers"),
                  "pillow_images_per_s_per_core": pillow.get("images_per_s"),
                  "decoder_one_worker_images_per_s": one.get("images_per_s"),
                  "decoder_one_worker_over_pillow": ratio(one.get("images_per_s", float("nan")),
                                                          pillow.get("images_per_s", float("nan")))}, skipped))
    add(_derived("gpu_photos_host_memory_gpu_over_cpu", dataset, "", {"loader_gpu": gpu, "loader_cpu": cpu},
                 lambda: [gpu["tree_pss_mb"] / cpu["tree_pss_mb"]],
                 {"tree_pss_mb_decode_gpu": gpu.get("tree_pss_mb"), "tree_pss_mb_decode_cpu": cpu.get("tree_pss_mb"),
                  "processes_decode_cpu": cpu.get("tree_processes"),
                  "peak_rss_mb_decode_gpu": gpu.get("peak_rss_mb"), "peak_rss_mb_decode_cpu": cpu.get("peak_rss_mb")},
                 skipped))
    per_arch: Dict[str, Any] = {}
    for arch, f in fig.get("train", {}).items():
        plain, memory = f.get("plain", {"skipped": "not run"}), f.get("memory", {"skipped": "not run"})
        summary = {f"images_per_s_{k}": median(v["images_per_s"]) for k, v in f.items() if "images_per_s" in v}
        add(_derived("gpu_photos_train_over_plain", dataset, arch, {"plain": plain, "memory": memory},
                     lambda: [ratio(m, p) for m, p in zip(memory["images_per_s"], plain["images_per_s"])],
                     {"images_per_s_train_in_memory": summary.get("images_per_s_memory"),
                      "images_per_s_plain_loop": summary.get("images_per_s_plain")}, skipped))
        for d in DECODES:
            real = f.get(f"loader_{d}", {"skipped": "not run"})
            add(_derived("gpu_photos_images_per_s", dataset, f"{arch}/decode={d}", {f"loader_{d}": real},
                         lambda: list(real["images_per_s"]), {"arch": arch, "decode": d}, skipped))
            add(retarget(_derived("gpu_photos_loader_over_memory", dataset, f"{arch}/decode={d}",
                                  {"memory": memory, f"loader_{d}": real},
                                  lambda: [ratio(r, m) for r, m in zip(real["images_per_s"], memory["images_per_s"])],
                                  {"images_per_s_real_loader": summary.get(f"images_per_s_loader_{d}"),
                                   "images_per_s_in_memory": summary.get("images_per_s_memory")}, skipped),
                         LOADER_OVER_MEMORY.get(arch, LOADER_OVER_MEMORY[PHOTO_ARCHS[0]])))
        per_arch[arch] = {**summary, "errors": {k: v["error"] for k, v in f.items() if "error" in v}}
    per_dev = {"loader_alone": loader, "pillow_per_core": pillow, "decoder_one_worker": one, "per_arch": per_arch,
               "ratios": {r.key: r.ratio for r in results}, "skipped": skipped,
               "errors": {r.key: r.note for r in results if r.ratio != r.ratio}}
    return results, per_dev


# ---------------------------------------------------------------------------------------------- the measurement
def train_specs(sizes: PhotoSizes, decodes: Sequence[str]) -> List[Dict[str, Any]]:
    """The runs of one arch's rank, in order: plain loop, train() in memory, train() with the loader per decode."""
    from bench.jobs import run_spec

    def spec(kind, source, decode=None):
        return {**run_spec(kind, sizes.warmup, source, PRECISION, sizes.batch_size), "decode": decode,
                "memory_batches": sizes.memory_batches}

    return [spec("plain", "memory"), spec("train", "memory")] + [spec("train", "loader", d) for d in decodes]


def measure_photos(cfg: Config, work: str, quick: bool = False, save: Callable[[Dict[str, Any]], None] = lambda d: None,
                   archs: Optional[Sequence[str]] = None) -> Tuple[List[Result], Dict[str, Any]]:
    """The photo figures (module docstring); `save(per_dev)` after each part (a run cut short keeps what it had)."""
    import shutil

    import torch

    from bench.photos_data import (decoder_images_per_s, photos_without_spark, pillow_images_per_s,
                                   train_contents)
    from pipeline.data.gpu_decode import gpu_decode_problem

    cuda = torch.cuda.is_available()
    sizes = photo_sizes(quick, cuda)
    archs = tuple(archs or sizes.archs)
    t0 = time.perf_counter()
    fig: Dict[str, Any] = {"loader": {}, "train": {}}
    info: Dict[str, Any] = {"sizes": dataclasses.asdict(sizes), "precision": PRECISION, "archs": list(archs),
                            "device": torch.cuda.get_device_name(0) if cuda else "cpu (test-only switch)"}
    folder = os.path.join(work, "photos")
    try:
        data = photos_without_spark(folder, sizes.train_rows, sizes.val_rows, sizes.image_size, sizes.batch_size)
        info["dataset"] = {"train_rows": data.plan.train.total_rows, "val_rows": data.plan.val.total_rows,
                           "steps_per_epoch": data.plan.train.steps_per_epoch, "classes": len(data.class_names)}
    except Exception as exc:  # nothing else can run without the rows
        log.exception("photos: writing the rows failed")
        info["errors"] = {"data": error_text(exc)}
        return [], info
    dataset = f"photos_{sizes.train_rows}_{sizes.image_size}px"

    def progress() -> Tuple[List[Result], Dict[str, Any]]:
        results, per_dev = photo_results(dataset, fig)
        per_dev = {**info, **per_dev, "seconds": time.perf_counter() - t0}
        save(per_dev)
        return results, per_dev

    try:
        rows: List[Any] = []
        for key, fn in (("pillow_per_core", lambda: pillow_images_per_s([r[0] for r in rows])),
                        ("decoder_one_worker", lambda: decoder_images_per_s(rows, sizes.image_size, 3))):
            try:
                rows = rows or train_contents(data, sizes.reference_images)
                fig[key] = {"images_per_s": fn(), "images": len(rows)}
            except Exception as exc:
                fig[key] = {"error": error_text(exc)}
        gpu_problem = gpu_decode_problem()
        decodes = [d for d in DECODES if d == "cpu" or gpu_problem is None]
        for d in DECODES:
            if d not in decodes:
                fig["loader"][d] = {"skipped": gpu_problem}
                continue
            fig["loader"][d] = loader_alone(data, photo_config(cfg, sizes, archs[0], d), d, sizes.loader_batches)
            log.info("photos: loader alone, decode=%s: %s", d, fig["loader"][d])
        done = progress()
        for arch in archs:
            acfg = photo_config(cfg, sizes, arch)
            # train() with the loader: the GPU decode where it runs (the CPU decode's rate is the loader's figure
            # above, and a CUDA call's minutes are scarce), else the CPU one
            trained = [d for d in decodes if d == "gpu"] or decodes[:1]
            specs = train_specs(sizes, trained)
            labels = ["plain", "memory"] + [f"loader_{d}" for d in trained]
            runs: Dict[str, Any] = {f"loader_{d}": {"skipped": gpu_problem if d not in decodes else
                                                    "not trained on a CUDA machine (its loader rate is measured)"}
                                    for d in DECODES if d not in trained}
            try:
                job = launch_photo_job(acfg, data, specs, sizes.steps, sizes.windows)
                runs.update({label: window_rates(run) for label, run in zip(labels, job[0]["runs"])})
            except Exception as exc:
                log.exception("photos: the %s job failed", arch)
                runs.update({label: {"error": error_text(exc)} for label in labels})
            fig["train"][arch] = runs
            log.info("photos: %s: %s", arch, runs)
            done = progress()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return done
