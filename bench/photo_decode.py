"""The CPU decode of photos larger than ImageNet's (a phone's 4032x3024 JPEGs): crops to 224 px decoded at a reduced
JPEG scale (`pipeline.data.crops`' draft) against the same crops decoded at full size, taking turns in one run; no
Spark, no table (`lakehouse bench --only photo_decode`)."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Tuple

import numpy as np

from bench.core import Result, interleaved, median, patched, ratio
from pipeline.log import get_logger

log = get_logger(__name__)

DATASET = "photos_4032x3024"
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
    return [Result("cpu_decode_large_photo_speedup", DATASET, median(per), parts, len(per), per)]
