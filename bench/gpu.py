"""GPU throughput per precision: images/s per GPU of the product's train() against a plain PyTorch loop on
GPU-resident batches, and the input-bound fraction with the real loader (only where torch sees CUDA)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench.core import VERDICT_RULE, Result, Sizes, input_bound_fraction, median, ratio, verdict
from pipeline.config import Config, ConfigError
from pipeline.log import get_logger

log = get_logger(__name__)

PRECISIONS = ("32-true", "bf16-mixed")
MIN_BATCH = 256  # the target (Lightning / plain >= 0.8) holds at batch >= 256


def gpu_batch_size(cfg: Config) -> int:
    from pipeline.data.plan import start_batch_size

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


def cuda_problem() -> Optional[str]:
    """Why the GPU figures cannot run here (torch sees no CUDA device), or None."""
    import torch

    if torch.cuda.is_available():
        return None
    return f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda or 'none'})"


def measure_gpu(cfg: Config, prep, sizes: Sizes) -> Tuple[List[Result], Dict[str, Any]]:
    """On one GPU (1 Horovod rank), per precision: plain loop, train() in memory, train() with the real loader.
    Nothing without CUDA (the caller lists the part under `skipped` with `cuda_problem()`)."""
    import torch

    if cuda_problem() is not None:
        return [], {}
    from bench.conversion import replan
    from bench.input_bound import later_warmup
    from bench.jobs import launch, per_run, run_spec

    bs = gpu_batch_size(cfg)
    data = replan(cfg, prep.data1, 1, bs)
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


GPU_ARCHS = ("cnn", "resnet", "timm/resnet18")
# what `bench --gpu --only` picks from: the architectures on 32 px synthetic pixels (and the loader alone on them), and
# the ImageNet-shaped photos (bench/photos_gpu.py)
GPU_PARTS = ("archs", "photos")


def gpu_parts(only: Optional[Sequence[str]]) -> List[str]:
    """The parts of `bench --gpu` to run (`--only`); every part when None.

    Raises:
        ConfigError: a part that is not one of GPU_PARTS.
    """
    unknown = sorted(set(only or ()) - set(GPU_PARTS))
    if unknown:
        raise ConfigError(f"bench --gpu --only: unknown part(s) {', '.join(unknown)}; choose from "
                          f"{', '.join(GPU_PARTS)}")
    return [p for p in GPU_PARTS if not only or p in only]


def installed_reader(configured: str, runs: Callable[[str], Optional[str]]) -> Tuple[str, Optional[str]]:
    """The reader the GPU figures use, and why it is not the configured one (None when it is).

    `runs(name)` says why reader `name` cannot run in this install (None when it can). A GPU image has no Petastorm
    (STACK.md), so `data.reader=petastorm` (conf/local.yaml's) falls back to the arrow reader, which reads the same
    Parquet files with pyarrow alone; any other reader that cannot run is refused here, before a rank is launched."""
    why = runs(configured)
    if why is None:
        return configured, None
    if configured == "petastorm" and runs("arrow") is None:
        return "arrow", f"data.reader={configured} cannot run here ({why}): the GPU figures read with data.reader=arrow"
    raise ConfigError(why)


def run_gpu_bench(cfg: Config, out: str, quick: bool = False, archs: Sequence[str] = GPU_ARCHS,
                  rows: int = 0, only: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """`lakehouse bench --gpu`: the GPU figures alone, per architecture and precision, on a converted data set written
    with pyarrow (no Spark or Java, as on a bare GPU image): images/s per GPU of a plain PyTorch loop, of train() on
    GPU-resident batches and of train() with the real ShardLoader, Lightning / plain and the input-bound fraction;
    beside them the loader alone (rows/s read and decoded on the CPU, per reader), which says whether the reader
    can feed the GPU's rate; and, first, the ImageNet-shaped photos (photos_gpu.measure_photos). `only`: these of
    GPU_PARTS. Writes `out` (JSON) after each part, and returns it."""
    import dataclasses
    import json
    import os
    import shutil
    import tempfile
    import time

    from bench import loader
    from bench.conversion import Prepared
    from bench.core import FULL, QUICK, load, machine
    from bench.datasets import converted_without_spark
    from bench.photos_gpu import measure_photos, on_cpu_switch
    from bench.report import log_table

    parts = gpu_parts(only)

    # the reader first: a refusal names data.reader before anything is converted or launched
    reader, fallback = installed_reader(cfg.data.reader, loader.reader_problem)
    if fallback:
        log.warning("bench --gpu: %s", fallback)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, reader=reader))
    no_cuda = cuda_problem()
    if no_cuda and not (on_cpu_switch() and parts == ["photos"]):
        raise ConfigError(f"bench --gpu: {no_cuda}")
    # 3 repeats and 50k rows per loader repeat: the figures fit one device-tool call (10 minutes) with the tier
    sizes = QUICK if quick else dataclasses.replace(FULL, repeats=3, loader_min_rows=50_000)
    # train.threads_per_rank as configured (null: torch's default for one process per GPU, as users run it)
    # the reader every epoch (a real table does not fit data.memory_cache_mb): the input-bound case that matters
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, memory_cache_mb=0))
    out = os.path.abspath(out)
    # scratch data in the temp folder, not beside the report (a call cut short would leave it among the results)
    work = tempfile.mkdtemp(prefix="lakehouse-gpu-bench-")
    bs = gpu_batch_size(cfg)
    rows = rows or bs * (64 if quick else 128)
    t0 = time.perf_counter()
    data = converted_without_spark(work, rows, cfg.data.image_size, cfg.data.channels, batch_size=bs)
    prep = Prepared(name=f"synthetic_{rows}_{cfg.data.image_size}px_{cfg.data.channels}ch", table="(pyarrow)",
                    version=0, rows=rows, class_names=data.class_names, data=data, data1=data)
    report: Dict[str, Any] = {"bench": "lakehouse --gpu", "quick": quick, "repeats": sizes.repeats,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(),
                              "load": {"before": load()}, "sizes": dataclasses.asdict(sizes), "batch_size": bs,
                              "dataset": prep.info(), "reader": reader, "reader_fallback": fallback,
                              "per_arch": {}, "parts": parts, "verdict_rule": VERDICT_RULE}
    results: List[Result] = []
    # {part, or a figure's key: why}: a figure a part leaves out here (the photos' decode=gpu without nvJPEG, ...);
    # a part that raised or gave no figure. Every part of --gpu is asked for by name (--gpu itself names them).
    skipped: Dict[str, str] = {}
    failed: Dict[str, str] = {}

    def write(final: bool = False) -> None:
        report["load"]["after"] = load()
        report["results"] = [dataclasses.asdict(r) for r in results]
        report["ratios"] = {r.key: r.ratio for r in results}
        report["passed"] = {r.key: r.passed for r in results}
        judged = verdict(results, skipped, failed, explicit=parts)
        report["skipped"], report["failed"] = dict(skipped), judged["failed"]
        # while the run goes on (a report written after each part) neither holds: the rest is not measured yet
        report["all_passed"] = final and judged["all_passed"]
        report["complete"] = final and judged["complete"]
        report["finished"] = final  # the run reached its end (a call cut short leaves false)
        report["duration_s"] = time.perf_counter() - t0
        report["out"] = out
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(report, fh, indent=2, default=str)

    def photos_so_far(per_dev: Dict[str, Any]) -> None:
        report["photos"] = per_dev
        write()

    try:
        if "photos" in parts:  # first: the figures never measured yet; `write` keeps each part's as it ends
            try:
                photo_results, photo_dev = measure_photos(cfg, work, quick, save=photos_so_far)
            except Exception as exc:  # recorded; the architectures still run
                log.exception("bench --gpu: the photo figures failed")
                failed["photos"] = f"{type(exc).__name__}: {exc}"
                report.setdefault("photos", {})["failed"] = failed["photos"]
            else:
                results.extend(photo_results)
                skipped.update(photo_dev.get("skipped", {}))
                if not photo_results:  # the rows could not be written: nothing else ran
                    failed["photos"] = f"yielded no figure: {photo_dev.get('errors') or 'no error recorded'}"
                    report.setdefault("photos", photo_dev)
            write()
        for reader in (loader.available_readers(cfg) if "archs" in parts else ()):
            res = loader.measure_loader(cfg, prep, sizes, reader, uncached=True)
            results.append(res)
            report.setdefault("loader_alone", {})[reader] = res.parts
        for arch in (archs if "archs" in parts else ()):
            acfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, arch=arch, pretrained=None))
            log.info("bench --gpu: %s at batch %d", arch, bs)
            arch_results, per_dev = measure_gpu(acfg, prep, sizes)
            if not arch_results:
                failed[f"archs/{arch}"] = cuda_problem() or "yielded no figure"
            for r in arch_results:
                r.variant = f"{arch}/{r.variant}"
            results.extend(arch_results)
            report["per_arch"][arch] = per_dev
            write()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(final=True)
    log_table(report)
    log.info("bench --gpu report written to %s (%.0f s)", out, report["duration_s"])
    return report
