"""The backends behind `train.backend`, by name: each pairs the launch of its ranks with the strategy they train with
(Lightning's registry of strategies, the same idea). The one place that reads `train.backend` after validation."""
from __future__ import annotations

from typing import Dict

from pipeline.config import Config, ConfigError
from pipeline.distributed.backends.base import Backend, MachineFacts
from pipeline.distributed.backends.horovod import HOROVOD
from pipeline.distributed.backends.single import SINGLE
from pipeline.distributed.backends.torch_dist import DDP, FSDP

BACKENDS: Dict[str, Backend] = {b.name: b for b in (HOROVOD, DDP, FSDP, SINGLE)}

__all__ = ["BACKENDS", "Backend", "MachineFacts", "backend_of", "get", "name_of"]


def get(name: str) -> Backend:
    """The backend called `name`.

    Raises:
        ConfigError: no backend has that name (names the key `train.backend` and the known names)."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"config key 'train.backend': {name!r} is not {', '.join(BACKENDS)}") from None


def backend_of(cfg: Config) -> Backend:
    """The backend `cfg` trains with (`train.backend`)."""
    return get(cfg.train.backend)


def name_of(cfg: Config) -> str:
    """The name of the backend `cfg` trains with, as runs and summaries report it."""
    return backend_of(cfg).name
