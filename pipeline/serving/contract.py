"""The preprocessing contract of an exported model: what turns image bytes into its input, as data and as reference code."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from pipeline.data.crops import VAL_CROP, center_crop_decode
from pipeline.data.transforms import PIXEL_MEAN, PIXEL_STD
from pipeline.tracking.pyfunc import check_meta
from pipeline.images import ImageDecodeError, decode_image

CONTRACT_FILE = "contract.json"
CONTRACT_VERSION = 1
INPUT_NAME = "pixels"
OUTPUT_NAME = "probabilities"


def preprocessing_contract(meta: Dict[str, Any], model: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Describe, from the served model's meta, how image bytes become the exported network's input.

    The numbers are those the training loader and the pyfunc use (pipeline.data.transforms), written out
    so that a runtime without Python's `pipeline` (ONNX Runtime, libtorch) can reproduce them.
    """
    meta = check_meta(meta)
    channels, size = meta["channels"], meta["image_size"]
    return {
        "contract_version": CONTRACT_VERSION,
        "input": {
            "name": INPUT_NAME,
            "dtype": "float32",
            "layout": "NCHW",
            "shape": [None, channels, size, size],
            "channels": channels,
            "height": size,
            "width": size,
            "color_mode": "L" if channels == 1 else "RGB",
            "resize": "bilinear (PIL Image.BILINEAR), only when the decoded image is not height x width",
            **({"center_crop": meta["center_crop"],
                "crop": "first the central square of center_crop x the shorter side, resized bilinear (antialiased) "
                        "to height x width (the validation transform of a model whose ranks decoded its rows)"}
               if meta.get("center_crop") else {}),
            "scale": 1.0 / 255.0,
            "mean": [PIXEL_MEAN] * channels,
            "std": [PIXEL_STD] * channels,
            "formula": "x[c] = (pixel[c] * scale - mean[c]) / std[c], pixel in 0..255",
        },
        "output": {
            "name": OUTPUT_NAME,
            "dtype": "float32",
            "shape": [None, len(meta["class_names"])],
            "meaning": "softmax probabilities; the label is class_names[argmax]",
            "class_names": list(meta["class_names"]),
        },
        "network": {"arch": meta["arch"], "width": meta["width"]},
        "model": dict(model or {}),
    }


def check_contract(contract: Dict[str, Any]) -> Dict[str, Any]:
    """Validate a loaded contract; raise ValueError naming the missing key."""
    for section, keys in (("input", ("channels", "height", "width", "color_mode", "scale", "mean", "std")),
                          ("output", ("class_names",))):
        if section not in contract:
            raise ValueError(f"preprocessing contract has no '{section}' section; got keys {sorted(contract)}")
        missing = [k for k in keys if k not in contract[section]]
        if missing:
            raise ValueError(f"preprocessing contract key(s) {', '.join(f'{section}.{k}' for k in missing)} missing")
    return contract


def load_contract(path: str) -> Dict[str, Any]:
    with open(path) as fh:
        return check_contract(json.load(fh))


def preprocess(contents: Sequence[bytes], contract: Dict[str, Any]) -> np.ndarray:
    """Reference implementation of the contract with PIL and numpy only: image bytes -> float32 (N, C, H, W).

    Each image is decoded by pipeline.images.decode_image, the codec training and the served model use.
    Raises ValueError naming the row of an undecodable image, or of one over the pixel bound (pipeline.images), and
    the key of a contract that codec cannot follow (not square, or a color_mode other than its channels').
    """
    spec = check_contract(contract)["input"]
    c, h, w = int(spec["channels"]), int(spec["height"]), int(spec["width"])
    if h != w:
        raise ValueError(f"preprocessing contract input.height={h} and input.width={w} differ: the codec "
                         f"(pipeline.images.decode_image) resizes to a square")
    if c not in (1, 3) or spec["color_mode"] != ("L" if c == 1 else "RGB"):
        raise ValueError(f"preprocessing contract input.color_mode={spec['color_mode']!r} with input.channels={c}: "
                         f"the codec (pipeline.images.decode_image) decodes 'L' (1 channel) or 'RGB' (3)")
    if spec.get("center_crop") not in (None, VAL_CROP):
        raise ValueError(f"preprocessing contract input.center_crop={spec['center_crop']!r}: the codec "
                         f"(pipeline.data.crops.center_crop_decode) takes the central {VAL_CROP} only")
    mean = np.asarray(spec["mean"], dtype=np.float32).reshape(c, 1, 1)
    std = np.asarray(spec["std"], dtype=np.float32).reshape(c, 1, 1)
    out = np.empty((len(contents), c, h, w), dtype=np.uint8)
    for i, content in enumerate(contents):
        try:  # the header's size checked against the bound before any decode
            out[i] = center_crop_decode(content, h, c) if spec.get("center_crop") else decode_image(content, h, c)
        except ImageDecodeError as exc:
            raise ValueError(f"row {i}: {exc}") from None
    return (out.astype(np.float32) * np.float32(spec["scale"]) - mean) / std


def labels_of(probabilities: np.ndarray, contract: Dict[str, Any]) -> List[str]:
    names = contract["output"]["class_names"]
    return [names[int(i)] for i in np.asarray(probabilities).argmax(axis=1)]
