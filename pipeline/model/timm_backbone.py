"""timm backbones for `model.arch: timm/<name>`: the network, its input transform, and local pretrained weights."""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.data.transforms import PIXEL_MEAN, PIXEL_STD
from pipeline.log import get_logger

log = get_logger(__name__)

PREFIX = "timm/"
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
# where a weights file sits in a Hugging Face cache or repository folder, in the order timm itself tries them
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors",
                   "open_clip_pytorch_model.bin")
# a safetensors metadata key under which the project stores the backbone's input transform with its weights
CFG_METADATA_KEY = "lakehouse_pretrained_cfg"


class PretrainedWeightsError(ValueError):
    """`model.pretrained` is missing, unreadable, or does not fit the network; the message names the file."""


def is_timm_arch(arch: str) -> bool:
    return isinstance(arch, str) and arch.startswith(PREFIX)


def timm_name(arch: str) -> str:
    name = arch[len(PREFIX):] if is_timm_arch(arch) else ""
    if not name:
        raise ValueError(f"config key 'model.arch': {arch!r} names no timm model (timm/<name>, e.g. timm/resnet18)")
    return name


def import_timm():
    """timm, or an error saying what to install (timm imports torchvision, which must match torch's build)."""
    try:
        import timm
    except Exception as exc:  # ImportError, or torchvision's RuntimeError when its build does not match torch
        import torch as _torch

        raise ImportError(
            f"config key 'model.arch': timm/<name> needs the timm package and a torchvision built for this torch "
            f"({_torch.__version__}); importing timm failed with {type(exc).__name__}: {exc}. Install them with "
            f"`pip install timm torchvision==<the release matching torch {_torch.__version__.split('+')[0]}>` "
            f"(a GPU image or a Databricks ML runtime has a matching torchvision already; on this project's CPU "
            f"setup run scripts/setup_vision.sh for .venv-vision)") from None
    return timm


def timm_problems() -> List[str]:
    """Why a timm/<name> arch cannot be built here (for `lakehouse doctor`), or nothing."""
    try:
        import_timm()
    except ImportError as exc:
        return [str(exc)]
    return []


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Nothing is downloaded while timm builds a model: the Hugging Face hub is told it is offline."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _as_list(value: Any) -> List[float]:
    return [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _per_channel(values: Sequence[float], channels: int) -> List[float]:
    """The pretrained mean/std for `channels` inputs: as given, or their average when the count differs (timm adapts
    a 3-channel stem to 1 channel by summing its kernels, so a grey image is normalised with the mean statistic)."""
    values = list(values)
    if len(values) == channels:
        return values
    return [sum(values) / len(values)] * channels


def input_transform(pretrained_cfg: Dict[str, Any], channels: int, data_size: int, input_size: Optional[int],
                    mean: Optional[List[float]], std: Optional[List[float]], interpolation: Optional[str],
                    follow_pretrained: bool) -> Dict[str, Any]:
    """The backbone's input: size, mean, std, interpolation. The model.* values where set; else, with pretrained
    weights, the backbone's pretrained config; else the table's size and the project's fixed 0.5/0.5."""
    cfg_size = pretrained_cfg.get("input_size") or (channels, data_size, data_size)
    size = input_size or (int(cfg_size[-1]) if follow_pretrained else data_size)
    mean_ = mean or (_as_list(pretrained_cfg.get("mean", PIXEL_MEAN)) if follow_pretrained else [PIXEL_MEAN])
    std_ = std or (_as_list(pretrained_cfg.get("std", PIXEL_STD)) if follow_pretrained else [PIXEL_STD])
    interp = interpolation or (pretrained_cfg.get("interpolation") if follow_pretrained else None) or "bilinear"
    if interp not in INTERPOLATIONS:
        interp = "bicubic" if "cubic" in str(interp) else "bilinear"
    return {"input_size": int(size), "mean": _per_channel(mean_, channels), "std": _per_channel(std_, channels),
            "interpolation": interp}


class TimmClassifier(nn.Module):
    """A timm model behind the project's input convention: it takes the loader's normalised pixels
    ((p/255 - 0.5) / 0.5, decoded once at data.image_size), re-normalises them with the backbone's mean/std and resizes
    them to its input size on the model's device. The transform is kept in buffers, so the state dict alone rebuilds
    it (the served model needs nothing but the arch name, the class count and the channels)."""

    def __init__(self, name: str, in_chans: int, num_classes: int, transform: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        timm = import_timm()
        with _offline():
            self.model = timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans)
        self.timm_name = name
        t = transform or {"input_size": 0, "mean": [PIXEL_MEAN] * in_chans, "std": [PIXEL_STD] * in_chans,
                          "interpolation": "bilinear"}
        self.register_buffer("input_mean", torch.tensor(t["mean"], dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("input_std", torch.tensor(t["std"], dtype=torch.float32).view(1, -1, 1, 1))
        # [size, interpolation index]: host copies in _size/_interp (read per batch without a device sync)
        self.register_buffer("input_spec", torch.tensor([int(t["input_size"]),
                                                         INTERPOLATIONS.index(t["interpolation"])]))
        self._sync_spec()

    def _sync_spec(self) -> None:
        spec = self.input_spec.detach().cpu().tolist()
        self._size, self._interp = int(spec[0]), INTERPOLATIONS[int(spec[1])]
        mean, std = self.input_mean.detach().cpu().flatten(), self.input_std.detach().cpu().flatten()
        # x = (p - 0.5) / 0.5 in; (p - mean) / std out  =>  x * scale + shift
        self._identity = bool(torch.allclose(mean, torch.full_like(mean, PIXEL_MEAN))
                              and torch.allclose(std, torch.full_like(std, PIXEL_STD)))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._sync_spec()

    @property
    def transform(self) -> Dict[str, Any]:
        return {"input_size": self._size, "mean": self.input_mean.flatten().tolist(),
                "std": self.input_std.flatten().tolist(), "interpolation": self._interp}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._identity:
            scale = (PIXEL_STD / self.input_std).to(x.dtype)
            x = x * scale + ((PIXEL_MEAN - self.input_mean) / self.input_std).to(x.dtype)
        if self._size and x.shape[-1] != self._size:
            kw = {} if self._interp == "nearest" else {"align_corners": False}
            x = F.interpolate(x, size=(self._size, self._size), mode=self._interp, **kw)
        return self.model(x)

    def head_module(self) -> nn.Module:
        """timm's classifier; several heads (a distilled DeiT's (head, head_dist)) as one ModuleList."""
        head = self.model.get_classifier()
        return nn.ModuleList(head) if isinstance(head, (tuple, list)) else head


# ----------------------------------------------------------------------------------------------- pretrained weights
def resolve_weights_file(path: str) -> str:
    """A weights file: `path` itself, or the weights file of a Hugging Face cache/repository folder
    (models--org--name/snapshots/<rev>/model.safetensors, the revision refs/main points at when present)."""
    if not os.path.exists(path):
        raise PretrainedWeightsError(f"config key 'model.pretrained': {path} does not exist (nothing is downloaded: "
                                     "put the weights file or the Hugging Face cache folder on a path every rank "
                                     "can read)")
    if os.path.isfile(path):
        return path
    roots = [path]
    ref = os.path.join(path, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as fh:
            roots.insert(0, os.path.join(path, "snapshots", fh.read().strip()))
    roots += sorted(glob.glob(os.path.join(path, "snapshots", "*")))
    for root in roots:
        for name in HF_WEIGHT_FILES:
            if os.path.isfile(os.path.join(root, name)):
                return os.path.join(root, name)
    raise PretrainedWeightsError(f"config key 'model.pretrained': folder {path} holds none of "
                                 f"{', '.join(HF_WEIGHT_FILES)} (nor under snapshots/<revision>/)")


def _folder_config(weights: str) -> Dict[str, Any]:
    """The pretrained_cfg in config.json beside a Hugging Face weights file, if any."""
    cfg_file = os.path.join(os.path.dirname(weights), "config.json")
    if not os.path.isfile(cfg_file):
        return {}
    try:
        with open(cfg_file) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return dict(data.get("pretrained_cfg") or {})


def read_weights(path: str) -> Tuple[str, Dict[str, torch.Tensor], Dict[str, Any]]:
    """(the file read, its state dict, the pretrained_cfg stored with it) from a safetensors file, a torch state dict
    (also a Lightning checkpoint's `state_dict`, or a dict under `state_dict` / `model`) or a Hugging Face folder."""
    weights = resolve_weights_file(path)
    cfg: Dict[str, Any] = _folder_config(weights)
    try:
        if weights.endswith(".safetensors"):
            from safetensors import safe_open
            from safetensors.torch import load_file

            state = load_file(weights, device="cpu")
            with safe_open(weights, framework="pt") as fh:
                meta = fh.metadata() or {}
            if CFG_METADATA_KEY in meta:
                cfg.update(json.loads(meta[CFG_METADATA_KEY]))
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PretrainedWeightsError(f"config key 'model.pretrained': {weights} is not a readable safetensors file "
                                     f"or torch state dict ({type(exc).__name__}: {exc})") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and isinstance(state.get(key), dict) and not isinstance(state.get(key),
                                                                                             torch.Tensor):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PretrainedWeightsError(f"config key 'model.pretrained': {weights} holds no state dict of tensors")
    if isinstance(state.get("input_spec"), torch.Tensor) or any(k.startswith("model.") for k in state):
        cfg.update(_cfg_of_project_state(state))
    return weights, _strip_prefixes(state), cfg


def _cfg_of_project_state(state: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The input transform a project's own TimmClassifier state dict carries (its buffers)."""
    for prefix in ("", "network.", "model.network."):
        if f"{prefix}input_spec" in state:
            size, interp = state[f"{prefix}input_spec"].tolist()
            # size 0: the network takes the table's size as it comes (no resize)
            return {"input_size": [0, int(size), int(size)],
                    "mean": state[f"{prefix}input_mean"].flatten().tolist(),
                    "std": state[f"{prefix}input_std"].flatten().tolist(), "interpolation": INTERPOLATIONS[int(interp)]}
    return {}


def _strip_prefixes(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """timm's own keys: a project checkpoint (network.model.*), a TimmClassifier (model.*) or DDP's module.*"""
    state = {k: v for k, v in state.items() if not k.endswith(("input_spec", "input_mean", "input_std"))}
    for prefix in ("network.model.", "model.", "module."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _classifier_keys(model: nn.Module) -> List[str]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("classifier") or []
    names = [names] if isinstance(names, str) else list(names)
    return [f"{n}.{p}" for n in names for p in ("weight", "bias")]


def load_pretrained(model: nn.Module, path: str, in_chans: int) -> Dict[str, Any]:
    """Load `path` into the timm `model` strictly, except: a classifier of another class count is left at its fresh
    initialisation, and a first conv of another channel count is adapted as timm does (summed/repeated kernels).

    Returns what was done ({"file", "head_reinitialized", "adapted", "pretrained_cfg"}).

    Raises:
        PretrainedWeightsError: the file is missing or unreadable, or a tensor is missing, extra or of another shape
        (naming the file and the first such tensor).
    """
    from timm.models import adapt_input_conv

    weights, state, stored_cfg = read_weights(path)
    own = model.state_dict()
    head = set(_classifier_keys(model))
    first_conv = (getattr(model, "pretrained_cfg", None) or {}).get("first_conv")
    first_conv = [first_conv] if isinstance(first_conv, str) else list(first_conv or [])
    reinit, adapted, file_classes = [], [], None
    for key in list(state):
        if key not in own:
            continue
        theirs, mine = state[key], own[key]
        if theirs.shape == mine.shape:
            continue
        if key in head:
            reinit.append(key)
            file_classes = int(theirs.shape[0])
            del state[key]
        elif any(key == f"{c}.weight" for c in first_conv) and theirs.dim() == 4 and theirs.shape[0] == mine.shape[0]:
            state[key] = adapt_input_conv(in_chans, theirs)
            adapted.append(key)
    problems = []
    for key, tensor in own.items():  # in the network's own order: the first problem named is the first layer's
        if key in reinit:
            continue
        if key not in state:
            if key.endswith("num_batches_tracked"):  # a BatchNorm counter many files leave out: the network's
                state[key] = tensor  # own, as torch's strict load fills it in (whatever the file's metadata says)
                continue
            problems.append(f"{key} is missing from the file (the network expects {tuple(tensor.shape)})")
        elif state[key].shape != tensor.shape:
            problems.append(f"{key} has shape {tuple(state[key].shape)} in the file, the network expects "
                            f"{tuple(tensor.shape)}")
    extra = [k for k in state if k not in own]
    problems += [f"{k} is in the file but not in the network" for k in extra]
    if problems:
        raise PretrainedWeightsError(
            f"config key 'model.pretrained': {weights} does not fit timm model {type(model).__name__} "
            f"({len(problems)} mismatched tensor(s)); first: {problems[0]}")
    result = model.load_state_dict(state, strict=not reinit)
    if set(result.missing_keys) - set(reinit) or result.unexpected_keys:  # cannot happen after the checks above
        raise PretrainedWeightsError(f"config key 'model.pretrained': {weights}: {result}")
    if reinit:
        log.info("model.pretrained: classifier %s re-initialised (%s classes in %s, %d here)", ", ".join(reinit),
                 file_classes, weights, int(own[reinit[0]].shape[0]))
    if adapted:
        log.info("model.pretrained: %s adapted to %d input channel(s)", ", ".join(adapted), in_chans)
    return {"file": weights, "head_reinitialized": bool(reinit), "adapted": adapted, "pretrained_cfg": stored_cfg}


def build_timm_network(arch: str, in_chans: int, num_classes: int, data_size: int = 0,
                       pretrained: Optional[str] = None, input_size: Optional[int] = None,
                       mean: Optional[List[float]] = None, std: Optional[List[float]] = None,
                       interpolation: Optional[str] = None) -> TimmClassifier:
    """`model.arch: timm/<name>` with the table's classes and channels, `model.pretrained` loaded when set, and its
    input transform (model.input_size/mean/std/interpolation, else the pretrained config, else the table's)."""
    net = TimmClassifier(timm_name(arch), in_chans, num_classes)
    pretrained_cfg = dict(getattr(net.model, "pretrained_cfg", None) or {})
    if pretrained:
        loaded = load_pretrained(net.model, pretrained, in_chans)
        pretrained_cfg.update({k: v for k, v in loaded["pretrained_cfg"].items() if v is not None})
    t = input_transform(pretrained_cfg, in_chans, data_size, input_size, mean, std, interpolation,
                        follow_pretrained=bool(pretrained))
    with torch.no_grad():
        net.input_mean.copy_(torch.tensor(t["mean"]).view(1, -1, 1, 1))
        net.input_std.copy_(torch.tensor(t["std"]).view(1, -1, 1, 1))
        net.input_spec.copy_(torch.tensor([0 if t["input_size"] == data_size else t["input_size"],
                                           INTERPOLATIONS.index(t["interpolation"])]))
    net._sync_spec()
    return net


def save_pretrained(network: nn.Module, path: str) -> str:
    """Write a network's weights as a `model.pretrained` file (safetensors, with its input transform as metadata)."""
    from safetensors.torch import save_file

    inner = network.model if isinstance(network, TimmClassifier) else network
    meta = {}
    if isinstance(network, TimmClassifier):
        t = network.transform
        # input size 0: the network took its table's size as it came; a fine-tune does the same (no resize)
        meta[CFG_METADATA_KEY] = json.dumps({"input_size": [0, t["input_size"], t["input_size"]],
                                             "mean": t["mean"], "std": t["std"],
                                             "interpolation": t["interpolation"]})
    state = {k: v.detach().cpu().contiguous() for k, v in inner.state_dict().items()}
    save_file(state, path, metadata=meta)
    return path
