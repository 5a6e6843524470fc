"""`lakehouse sample-data --kind photos`: an ImageNet-shaped JPEG tree (RGB, ~400x350 of varying sizes, quality 90),
class per folder, the same files for the same seed, and every file one the ingest's decoder accepts."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.lakehouse.sample_data import PHOTO_CLASSES, photo_size, render_photos


def _tree(root: Path):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_photos_are_a_class_per_folder_tree_of_rgb_jpegs_of_imagenet_shape(tmp_path):
    from PIL import Image

    from pipeline.images import inspect_image

    counts = render_photos(str(tmp_path), count=30, classes=3, seed=7)
    assert counts == {"stripes": 10, "rings": 10, "checks": 10}
    files = _tree(tmp_path)
    assert len(files) == 30 and {f.split("/")[0] for f in files} == set(PHOTO_CLASSES[:3])
    assert all(f.endswith(".jpg") and f.count("/") == 1 for f in files)
    sizes, nbytes = [], []
    for f in files:
        content = (tmp_path / f).read_bytes()
        with Image.open(io.BytesIO(content)) as img:
            assert img.format == "JPEG" and img.mode == "RGB"
            # Pillow's quality 90 scales the standard tables by 0.2: the luminance DC step 16 -> 3, chroma 17 -> 3
            assert img.quantization[0][0] == 3 and img.quantization[1][0] == 3
            sizes.append(img.size)
        assert inspect_image(content)[2] == "RGB"  # what ingest runs on every file: decodes, within the pixel bound
        nbytes.append(len(content))
    w, h = np.array(sizes).T
    assert len(set(sizes)) > 20  # sizes vary
    assert 320 < w.mean() < 480 and 280 < h.mean() < 420, (w.mean(), h.mean())
    assert (w > h).any() and (h > w).any()  # landscape and portrait
    kb = np.array(nbytes) / 1024
    assert 30 < kb.mean() < 160, kb.mean()  # a noisy photo's JPEG at quality 90, not a flat synthetic one


def test_the_size_distribution_averages_about_400_by_350():
    sizes = np.array([photo_size(np.random.default_rng([0, i])) for i in range(2000)])
    assert abs(sizes[:, 0].mean() - 400) < 20 and abs(sizes[:, 1].mean() - 350) < 20, sizes.mean(0)
    assert sizes.min() >= 160 and sizes.max() <= 800


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_ones(tmp_path):
    render_photos(str(tmp_path / "a"), count=6, seed=3)
    render_photos(str(tmp_path / "b"), count=6, seed=3)
    render_photos(str(tmp_path / "c"), count=6, seed=4)
    files = _tree(tmp_path / "a")
    assert files == _tree(tmp_path / "b") == _tree(tmp_path / "c")
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert all((tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes() for f in files)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="--count"):
        render_photos("/nonexistent", count=0)
    with pytest.raises(ValueError, match="--classes"):
        render_photos("/nonexistent", count=3, classes=len(PHOTO_CLASSES) + 1)


def test_the_cli_writes_photos_and_keeps_digits_the_default(tmp_path, capsys):
    from pipeline.cli import main

    assert main(["sample-data", "--kind", "photos", "--count", "4", "--classes", "2",
                 "--out", str(tmp_path / "p")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"out": str(tmp_path / "p"), "kind": "photos", "images": 4, "classes": {"stripes": 2, "rings": 2}}
    assert main(["sample-data", "--limit", "12", "--out", str(tmp_path / "d")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["kind"] == "digits" and out["images"] == 12
    assert all(f.endswith(".png") for f in _tree(tmp_path / "d"))
