"""Sample class-per-folder image trees to ingest: scikit-learn's digits as PNGs, or synthetic ImageNet-shaped JPEGs."""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from pipeline.log import get_logger

log = get_logger(__name__)

CLASS_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

# The photos' classes: each a kind of texture over the whole frame (so a random crop of any part still shows it),
# drawn with a random palette, frequency, orientation and natural-looking noise, so colour alone does not tell them
# apart and a network has structure to learn.
PHOTO_CLASSES = ["stripes", "rings", "checks", "dots", "waves"]
# ImageNet's training JPEGs are about 400x350 on average (issue 36) at quality about 90; sizes vary around that.
PHOTO_MEAN_SIZE = (400, 350)  # width, height
PHOTO_QUALITY = 90
KINDS = ("digits", "photos")


# the options of `lakehouse sample-data` that only one kind takes: given with the other kind they are refused, not
# ignored (the folder would not hold what was asked for)
KIND_OPTIONS = {"digits": ("size",), "photos": ("classes", "seed")}
DIGITS_SIZE = 32  # the side of a digit image in pixels, unless --size says otherwise
PHOTOS_COUNT = 1000  # photos written unless --count says otherwise


class OutputFolderError(ValueError):
    """The output folder holds files this command would not write; nothing was written."""


class SampleOptionError(ValueError):
    """An option of `lakehouse sample-data` that the kind asked for does not take, or a value out of its range (the
    command line's mistake: `lakehouse` reports it as a usage error); nothing was written."""


def check_out_dir(out_dir: str, planned: Set[str]) -> None:
    """Refuse `out_dir` when it holds any file (or link, or other entry that is not a folder) that is not one of
    `planned`, the paths, relative to it, that this command is about to write: the folder would then hold more
    images than the command reports, and an ingest of it would take them all. Writing into the folder of an earlier run
    whose files are all among `planned` (the same command again, or a larger --limit/--count) is allowed: they
    are rewritten in place."""
    out = Path(out_dir)
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise OutputFolderError(f"--out {out_dir}: not a folder; nothing written")
    foreign: List[str] = []
    for dirpath, dirnames, filenames in os.walk(out):  # links to folders are listed, not followed
        for name in sorted(filenames) + sorted(d for d in dirnames if os.path.islink(os.path.join(dirpath, d))):
            rel = os.path.relpath(os.path.join(dirpath, name), out).replace(os.sep, "/")
            if rel not in planned:
                foreign.append(rel)
    if foreign:
        foreign.sort()
        shown = ", ".join(foreign[:5]) + (f" ... ({len(foreign)} in all)" if len(foreign) > 5 else "")
        raise OutputFolderError(f"--out {out_dir} already holds {len(foreign)} file(s) this command would not write "
                                f"(e.g. {shown}): the folder would hold more images than reported, and an ingest of "
                                f"it would take them all; give an empty or new folder, or remove these; nothing "
                                f"written")


def render_digits(out_dir: str, size: int = DIGITS_SIZE, limit: int | None = None) -> Dict[str, int]:
    """Write `out_dir/<class name>/<n>.png`, deterministically; return images per class. A `limit` above the 1,797
    images there are writes them all, with a warning saying so.

    The 8x8 images (values 0-16) are scaled to 0-255 and enlarged to `size` with nearest-neighbour
    so every file is the same on every machine. An `out_dir` holding other files is refused (check_out_dir).
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    if size < 1:
        raise SampleOptionError(f"--size {size}: at least 1 pixel")
    if limit is not None and limit < 1:
        raise SampleOptionError(f"--limit {limit}: at least one image")
    digits = load_digits()
    out = Path(out_dir)
    counts: Dict[str, int] = {}
    n = len(digits.images) if limit is None else min(limit, len(digits.images))
    check_out_dir(out_dir, {f"{CLASS_NAMES[int(digits.target[i])]}/{i:04d}.png" for i in range(n)})
    for i in range(n):
        name = CLASS_NAMES[int(digits.target[i])]
        pixels = np.clip(digits.images[i] * (255.0 / 16.0), 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels, mode="L").resize((size, size), Image.NEAREST)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:04d}.png", optimize=False)
        counts[name] = counts.get(name, 0) + 1
    log.info("rendered %d digit images in %d classes to %s", n, len(counts), out)
    if limit is not None and limit > n:  # said, not only clamped: the caller asked for more than it got
        log.warning("%d images asked for: scikit-learn's digits are %d images; wrote all %d of them", limit, n, n)
    return counts


def photo_size(rng: np.random.Generator) -> Tuple[int, int]:
    """(width, height) of one photo: about 400x350 on average, landscape, portrait and square, 160-800 px a side."""
    area = float(np.prod(PHOTO_MEAN_SIZE)) * float(np.exp(rng.normal(-0.02, 0.2)))
    aspect = float(np.exp(rng.normal(np.log(PHOTO_MEAN_SIZE[0] / PHOTO_MEAN_SIZE[1]), 0.25)))
    w, h = np.sqrt(area * aspect), np.sqrt(area / aspect)
    return int(np.clip(round(w), 160, 800)), int(np.clip(round(h), 160, 800))


def _pink_noise(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """(h, w) noise with a 1/f spectrum (the fall-off of natural images), scaled to unit standard deviation: made at
    a quarter of the size (its power is in the low frequencies) and enlarged."""
    from PIL import Image

    small = _pink_spectrum_noise(rng, max(8, h // 4), max(8, w // 4)).astype(np.float32)
    return np.asarray(Image.fromarray(small, mode="F").resize((w, h), Image.BILINEAR))


def _pink_spectrum_noise(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    spectrum = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f
    spectrum[0, 0] = 0
    noise = np.fft.irfft2(spectrum, s=(h, w))
    return noise / (noise.std() + 1e-12)


def _pattern(kind: str, rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """(h, w) values in [0, 1]: the class's texture at a random scale, orientation and phase."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    theta = rng.uniform(0, np.pi)
    u = x * np.cos(theta) + y * np.sin(theta)
    v = -x * np.sin(theta) + y * np.cos(theta)
    period = rng.uniform(14, 40)  # pixels: still visible after a 0.08-area crop is enlarged to 224
    phase = rng.uniform(0, 2 * np.pi)
    k = 2 * np.pi / period
    if kind == "stripes":
        out = np.sin(k * u + phase)
    elif kind == "rings":
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        out = np.sin(k * np.hypot(x - cx, y - cy) + phase)
    elif kind == "checks":
        out = np.sign(np.sin(k * u + phase) * np.sin(k * v + phase)) * 0.8
    elif kind == "dots":
        out = np.exp(-((np.sin(k * u / 2 + phase) ** 2 + np.sin(k * v / 2 + phase) ** 2) * 6.0)) * 2 - 1
    elif kind == "waves":
        out = np.sin(k * u + rng.uniform(2, 5) * np.sin(k * v / rng.uniform(2, 4)) + phase)
    else:
        raise ValueError(f"unknown photo class {kind!r}; one of {', '.join(PHOTO_CLASSES)}")
    return (out + 1) / 2


def render_photo(kind: str, seed: int, index: int,
                 size: Optional[Tuple[int, int]] = None) -> Tuple[bytes, Tuple[int, int]]:
    """One synthetic RGB photo of class `kind` as JPEG bytes (quality PHOTO_QUALITY) and its (width, height); the same
    bytes for the same (seed, index) on every machine with the same libjpeg. `size`: (width, height) instead of an
    ImageNet-shaped one (a phone's 4032x3024, say)."""
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    w, h = photo_size(rng) if size is None else (int(size[0]), int(size[1]))
    pattern = _pattern(kind, rng, h, w)[..., None]
    paper = rng.uniform(0, 255, 3)
    ink = np.clip(paper + rng.choice([-1.0, 1.0], 3) * rng.uniform(60, 160, 3), 0, 255)  # never a faint texture
    img = paper + (ink - paper) * pattern  # the texture in two random colours
    light = _pink_noise(rng, h, w)[..., None] * rng.uniform(10, 30)  # shading and clutter, as in a photo
    # sensor noise (uniform, cheap to draw): what makes a photo's JPEG about 100 KB at quality 90
    grain = rng.integers(-32, 33, (h, w, 3), dtype=np.int16)
    pixels = np.clip(img + light + grain, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="JPEG", quality=PHOTO_QUALITY)
    return buf.getvalue(), (w, h)


def render_photos(out_dir: str, count: int, classes: int = len(PHOTO_CLASSES), seed: int = 0) -> Dict[str, int]:
    """Write `count` synthetic JPEG photos as `out_dir/<class>/<n>.jpg` (classes in turn, the first `classes` of
    PHOTO_CLASSES), deterministically from `seed`; return images per class. An `out_dir` holding other files is
    refused (check_out_dir)."""
    if count < 1:
        raise SampleOptionError(f"--count {count}: at least one photo")
    if not 1 <= classes <= len(PHOTO_CLASSES):
        raise SampleOptionError(f"--classes {classes}: between 1 and {len(PHOTO_CLASSES)}")
    names: List[str] = PHOTO_CLASSES[:classes]
    check_out_dir(out_dir, {f"{names[i % classes]}/{i:05d}.jpg" for i in range(count)})
    out = Path(out_dir)
    counts: Dict[str, int] = {}
    total = 0
    for i in range(count):
        name = names[i % classes]
        content, _ = render_photo(name, seed, i)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.jpg").write_bytes(content)
        counts[name] = counts.get(name, 0) + 1
        total += len(content)
    log.info("rendered %d synthetic JPEG photos (%.0f KB each on average) in %d classes to %s", count,
             total / count / 1024, len(counts), out)
    return counts


def render_sample(kind: str, out_dir: str | None, count: int | None, size: int | None = None,
                  classes: int | None = None, seed: int | None = None) -> Tuple[str, Dict[str, int]]:
    """`lakehouse sample-data`: (the folder written, images per class) for `kind` digits or photos. `size` (digits),
    `classes` and `seed` (photos): None for the kind's default.

    Raises:
        SampleOptionError: `kind` is neither; an option given that `kind` does not take (KIND_OPTIONS), naming both;
            a count, size or number of classes out of range. Nothing is written.
    """
    if kind not in KINDS:
        raise SampleOptionError(f"--kind {kind!r}: one of {', '.join(KINDS)}")
    given = {"size": size, "classes": classes, "seed": seed}
    for other, names in KIND_OPTIONS.items():
        wrong = [f"--{name}" for name in names if other != kind and given[name] is not None]
        if wrong:
            raise SampleOptionError(f"{' and '.join(wrong)} {'applies' if len(wrong) == 1 else 'apply'} to --kind "
                                    f"{other} only, not --kind {kind}; nothing written")
    out = out_dir or f"work/sample/{kind}"
    if kind == "digits":
        return out, render_digits(out, size=DIGITS_SIZE if size is None else size, limit=count)
    return out, render_photos(out, PHOTOS_COUNT if count is None else count,
                              len(PHOTO_CLASSES) if classes is None else classes, 0 if seed is None else seed)
