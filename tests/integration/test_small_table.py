"""A new user's own small folder at the defaults (issue 25, item 13): a few hundred images of 4 visually easy classes,
mixed sizes and modes, ingested and trained with `lakehouse train` on the local profile as it is. At the profile's
batch of 32 on 2 ranks an epoch would be 4 steps: `data.min_steps_per_epoch` lowers the batch so each has 16, and
early stopping does not give up while BatchNorm's statistics settle. The model ends well above chance and is
crowned."""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, available_readers, cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

CLASSES = ("circle", "square", "triangle", "cross")
PER_CLASS = 90
MODES = ("RGB", "L", "RGBA", "P")


def _draw(kind: str, rng: random.Random, path: Path) -> None:
    """One shape, filled, at a random place, scale and colour on a noisy background, in a random size and mode."""
    from PIL import Image, ImageDraw

    size = rng.randint(40, 160)
    bg = tuple(rng.randint(0, 90) for _ in range(3))
    img = Image.new("RGB", (size, size), bg)
    px = img.load()
    for _ in range(size * 2):  # speckle
        px[rng.randrange(size), rng.randrange(size)] = tuple(rng.randint(0, 120) for _ in range(3))
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.25, 0.42) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    fg = tuple(rng.randint(170, 255) for _ in range(3))
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif kind == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif kind == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    else:
        w = r / 3
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fg)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fg)
    mode = rng.choice(MODES)
    img = img.convert(mode) if mode != "P" else img.convert("P", palette=Image.ADAPTIVE)
    if mode in ("RGB", "L") and rng.random() < 0.5:
        img.save(path.with_suffix(".jpg"), format="JPEG", quality=85)
    else:
        img.save(path, format="PNG")


def _folder(root: Path) -> Path:
    rng = random.Random(7)
    for kind in CLASSES:
        (root / kind).mkdir(parents=True)
        for i in range(PER_CLASS):
            _draw(kind, rng, root / kind / f"{kind}_{i:03d}.png")
    return root


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def test_a_small_four_class_folder_at_the_defaults_ends_well_above_chance_and_is_crowned(tmp_path):
    source = _folder(tmp_path / "photos")
    paths = [f"delta.table={tmp_path}/delta/shapes", f"data.cache_dir={tmp_path}/cache",
             f"train.checkpoint_dir={tmp_path}/checkpoints", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
             f"mlflow.artifact_location={tmp_path}/mlartifacts", "mlflow.registered_model=shapes"]
    if available_readers() == ["arrow"]:
        paths.append("data.reader=arrow")
    conf = ["--conf", str(ROOT / "conf/local.yaml")]
    ingest = subprocess.run(cli("ingest", "--source", str(source), *conf, *paths), cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert ingest.returncode == 0, ingest.stdout[-2000:] + ingest.stderr[-3000:]
    assert _last_json(ingest.stdout)["rows_written"] == len(CLASSES) * PER_CLASS

    train = subprocess.run(cli("train", *conf, *paths), cwd=tmp_path, capture_output=True, text=True, timeout=800)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    summary = _last_json(train.stdout)
    # min_epochs (warm-up + 2 x patience = 7 of the profile's 8): no stop while val_loss wobbles after the warm-up
    assert summary["epochs"] >= 7, summary
    # 286 train rows over 2 ranks: 143 each, lowered from 32 to 143 // 16 = 8 per rank
    assert summary["batch_size_used"] < 32, summary
    assert summary["val_acc"] > 0.6, summary  # chance is 0.25
    assert summary["champion"] is True, summary
