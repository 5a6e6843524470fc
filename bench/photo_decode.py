"""The CPU decode of photos (`lakehouse bench --only photo_decode`; no Spark, no table): a phone's 4032x3024 JPEGs
cropped to 224 px at a reduced JPEG scale (`pipeline.data.crops`' draft) against the same crops decoded at full size;
ImageNet-shaped JPEGs through the rank's CPU decoder (1 worker and one per core) against a plain Pillow decode loop on
one core. Each pair takes turns in one run."""
from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Dict, List, Tuple

import numpy as np

from bench.core import Result, interleaved, median, patched, ratio
from pipeline.log import get_logger

log = get_logger(__name__)

DATASET = "photos_4032x3024"
IMAGENET_DATASET = "photos_imagenet_shaped"
PHOTO_SIZE = (4032, 3024)  # a 12 MP phone photo
CROP = 224


def phone_photos(count: int) -> List[bytes]:
    """`count` synthetic photos of PHOTO_SIZE (sample-data's generator: texture, shading, sensor grain; ~6 MB each
    at quality 90), classes in turn."""
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

    return [render_photo(PHOTO_CLASSES[i % len(PHOTO_CLASSES)], 11, i, size=PHOTO_SIZE)[0] for i in range(count)]


def crop_jobs(photos: List[bytes]) -> List[Tuple[bytes, Tuple]]:
    """Each photo twice: a training crop (random resized crop and flip, batch 0's draws) and the validation crop."""
    from pipeline.data.crops import crop_draws, train_box, val_box

    draws = crop_draws(0, 0, len(photos))
    w, h = PHOTO_SIZE
    return [(c, train_box(w, h, draws[i])) for i, c in enumerate(photos)] + [(c, val_box(w, h)) for c in photos]


def _decode_all(jobs: List[Tuple[bytes, Tuple]], full_size: bool) -> Tuple[float, List[np.ndarray]]:
    """images/s of `crops.crop_hwc` over `jobs` on this thread, and its crops; `full_size`: the reduced-scale decode
    turned off (every JPEG decoded whole, as before it)."""
    from pipeline.data import crops

    off = patched(crops, "draft_scale", lambda _orig: lambda *_a, **_k: 1) if full_size else contextlib.nullcontext()
    with off:
        t0 = time.perf_counter()
        out = [crops.crop_hwc(content, box, CROP, 3) for content, box in jobs]
        return len(jobs) / (time.perf_counter() - t0), out


def measure_photo_decode(sizes, quick: bool = False) -> List[Result]:
    """`cpu_decode_large_photo_speedup`: images/s with the reduced-scale decode over full-size decode, on the same
    crops of the same photos, the two taking turns (sizes.repeats rounds after a warm-up of each); the parts say how
    far the pixels moved (mean and 99th percentile of |draft - full| in levels) and the scales taken."""
    from pipeline.data.crops import draft_scale

    photos = phone_photos(4 if quick else 12)
    jobs = crop_jobs(photos)
    drafted, whole = _decode_all(jobs, False)[1], _decode_all(jobs, True)[1]  # the warm-up: its crops compared
    with_draft, full = interleaved(lambda: _decode_all(jobs, False)[0], lambda: _decode_all(jobs, True)[0],
                                   sizes.repeats)
    per = [ratio(a, b) for a, b in zip(with_draft, full)]
    diff = np.concatenate([np.abs(a.astype(np.int16) - b.astype(np.int16)).ravel() for a, b in zip(drafted, whole)])
    w, h = PHOTO_SIZE
    scales = [draft_scale(w, h, box[2], box[3], CROP) for _, box in jobs]
    parts: Dict[str, Any] = {
        "draft_images_per_s": median(with_draft), "full_decode_images_per_s": median(full),
        "photos": len(photos), "crops": len(jobs), "photo_size": f"{w}x{h}", "crop_px": CROP,
        "mean_jpeg_mb": float(np.mean([len(p) for p in photos])) / 1e6,
        "scales_taken": {str(s): scales.count(s) for s in sorted(set(scales))},
        "pixels_mean_abs_diff": float(diff.mean()), "pixels_p99_abs_diff": float(np.percentile(diff, 99)),
        "pixels_max_abs_diff": int(diff.max())}
    log.info("photo_decode: %.1f img/s with the reduced-scale decode, %.1f decoding whole (%.2fx); pixels moved "
             "%.2f levels on average", parts["draft_images_per_s"], parts["full_decode_images_per_s"], median(per),
             parts["pixels_mean_abs_diff"])
    note = ("" if median(per) >= 1.3 else "the full-size decode of the denominator is itself fast now (simplejpeg and "
            "torch's resize: ~1.37x the Pillow path's crops/s, docs/PERFORMANCE.md), while the reduced-scale decode "
            "still entropy-decodes every block of the file: what it saves is the IDCT, upsampling and colour work")
    return [Result("cpu_decode_large_photo_speedup", DATASET, median(per), parts, len(per), per, note=note)]


def imagenet_photos(count: int) -> List[bytes]:
    """`count` ImageNet-shaped JPEGs (sample-data's: ~400x350 RGB, quality 90), classes in turn."""
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

    return [render_photo(PHOTO_CLASSES[i % len(PHOTO_CLASSES)], 13, i)[0] for i in range(count)]


def _decoder_images_per_s(photos: List[bytes], workers: int, batch: int) -> float:
    """images/s of the rank's CPU decoder (pipeline.data.decode.Decoder: headers, random resized crops and flips to
    CROP px, NHWC uint8 as the loader takes them with channels_last) with `workers` (1: a thread of this process; more:
    that many processes), every photo once in batches of `batch`, the next batches decoded ahead as the loader does;
    after a warm-up batch that starts the workers."""
    from pipeline.data.decode import Decoder, EncodedBatch

    rows = np.empty((len(photos), 2), dtype=object)
    rows[:, 0] = photos
    rows[:, 1] = [f"photo/{i}.jpg" for i in range(len(photos))]
    decoder = Decoder(CROP, 3, train=True, seed=0, workers=workers, channels_last=True)
    try:
        decoder.decode(EncodedBatch(rows[:batch], 0))
        items = ((EncodedBatch(rows[lo:lo + batch], 1 + lo // batch),) for lo in range(0, len(photos), batch))
        t0 = time.perf_counter()
        n = sum(len(out) for (out,) in decoder.batches(items))
        return n / (time.perf_counter() - t0)
    finally:
        decoder.close()


def cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_decode_per_core(sizes, quick: bool = False) -> List[Result]:
    """`cpu_photos_decode_per_core`: images/s per decode worker of the rank's CPU decoder with one worker per core /
    a plain Pillow decode loop on one core (open, decode, RGB), on the same ImageNet-shaped JPEGs; and
    `cpu_photos_decode_over_pillow_every_core`: the decoder's images/s with one worker per core / the same Pillow loop
    run on every core at once (what the host decodes when all its cores decode: on a VM its cores may share one
    physical core's caches and units). All take turns (sizes.repeats rounds after a warm-up); the parts also give one
    worker's figure and the host's own scaling (Pillow on every core, per core, / Pillow on one)."""
    from bench.photos_data import pillow_every_core_images_per_s, pillow_images_per_s

    photos, batch, all_cores = imagenet_photos(128 if quick else 512), 64 if quick else 128, cores()
    workers = sorted({1, all_cores})
    pillow_images_per_s(photos)  # warm-up
    for w in workers:
        _decoder_images_per_s(photos[:2 * batch], w, batch)
    pillow, every, per_workers = [], [], {w: [] for w in workers}
    for r in range(sizes.repeats):
        order = workers if r % 2 == 0 else workers[::-1]
        if r % 2 == 0:
            pillow.append(pillow_images_per_s(photos))
            every.append(pillow_every_core_images_per_s(photos, all_cores))
        for w in order:
            per_workers[w].append(_decoder_images_per_s(photos, w, batch))
        if r % 2:
            every.append(pillow_every_core_images_per_s(photos, all_cores))
            pillow.append(pillow_images_per_s(photos))
    per_core = {w: [ratio(v / w, p) for v, p in zip(per_workers[w], pillow)] for w in workers}
    over_every = [ratio(v, e) for v, e in zip(per_workers[all_cores], every)]
    parts: Dict[str, Any] = {
        "pillow_one_core_images_per_s": median(pillow), "pillow_every_core_images_per_s": median(every),
        "pillow_every_core_per_core_over_one": median([ratio(e / all_cores, p) for e, p in zip(every, pillow)]),
        "cores": all_cores, "photos": len(photos),
        "batch": batch, "crop_px": CROP, "mean_jpeg_kb": float(np.mean([len(p) for p in photos])) / 1e3,
        "decoder": {str(w): {"images_per_s": median(per_workers[w]), "per_core_over_pillow": median(per_core[w])}
                    for w in workers}}
    log.info("photo decode per core: %s; Pillow alone %.0f img/s on one core, %.0f on all %d at once",
             json.dumps(parts["decoder"]), parts["pillow_one_core_images_per_s"],
             parts["pillow_every_core_images_per_s"], all_cores)
    figure, one = median(per_core[all_cores]), median(per_core[1])
    note = ("" if figure >= 0.9 or all_cores == 1 else
            f"one worker decodes at {one:.2f} of Pillow per core; with {all_cores} workers on {all_cores} cores the "
            "rank's own work (each batch's bytes into the ring, its pixels out) takes a share of the same cores, and "
            f"the host's cores decode {parts['pillow_every_core_per_core_over_one']:.2f} of one core's rate each when "
            "all decode at once (Pillow alone, pillow_every_core_per_core_over_one)")
    every_note = ("" if median(over_every) >= 0.9 or all_cores == 1 else
                  "the rank's own work (each batch's bytes into the ring, its pixels out) takes a share of the "
                  "cores the workers decode on")
    return [Result("cpu_photos_decode_per_core", IMAGENET_DATASET, figure, parts, len(per_core[all_cores]),
                   per_core[all_cores], note=note),
            Result("cpu_photos_decode_over_pillow_every_core", IMAGENET_DATASET, median(over_every),
                   {k: parts[k] for k in ("pillow_every_core_images_per_s", "cores", "photos", "batch")}
                   | {"decoder_images_per_s": parts["decoder"][str(all_cores)]["images_per_s"]},
                   len(over_every), over_every, note=every_note)]
