"""Render scikit-learn's digits (real 8x8 scans that ship with the package) as a class-per-folder PNG tree."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np

from pipeline.log import get_logger

log = get_logger(__name__)

CLASS_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def render_digits(out_dir: str, size: int = 32, limit: int | None = None) -> Dict[str, int]:
    """Write `out_dir/<class name>/<n>.png`, deterministically; return images per class.

    The 8x8 images (values 0-16) are scaled to 0-255 and enlarged to `size` with nearest-neighbour
    so every file is the same on every machine.
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    out = Path(out_dir)
    counts: Dict[str, int] = {}
    n = len(digits.images) if limit is None else min(limit, len(digits.images))
    for i in range(n):
        name = CLASS_NAMES[int(digits.target[i])]
        pixels = np.clip(digits.images[i] * (255.0 / 16.0), 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels, mode="L").resize((size, size), Image.NEAREST)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:04d}.png", optimize=False)
        counts[name] = counts.get(name, 0) + 1
    log.info("rendered %d digit images in %d classes to %s", n, len(counts), out)
    return counts
