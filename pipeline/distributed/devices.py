"""What a training rank runs on, decided in the rank from its own CUDA: device, DDP backend, precision, threads."""
from __future__ import annotations

from typing import Any, Optional, Tuple

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed")


class DeviceError(RuntimeError):
    """A rank cannot get the GPU it needs (more ranks on this host than GPUs it can see)."""


def rank_device_index(local_rank: int, device_count: int) -> int:
    """The CUDA device a rank pins: its local rank, or 0 when the process sees exactly one GPU.

    Spark GPU scheduling gives a task only its own GPU (CUDA_VISIBLE_DEVICES), which the process sees as device 0
    whatever its local rank; where a process sees every GPU of the host, local rank k takes device k.
    """
    if device_count < 1:
        raise DeviceError("no CUDA device is visible to this rank")
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise DeviceError(f"local rank {local_rank} has no GPU of its own: this process sees {device_count} GPUs "
                          f"(devices 0-{device_count - 1}); run at most {device_count} ranks per host")
    return local_rank


def ddp_backend(has_cuda: bool) -> str:
    """torch.distributed backend for a DDP rank: NCCL for CUDA tensors, gloo on CPU (NCCL rejects CPU tensors)."""
    return "nccl" if has_cuda else "gloo"


def supports_bf16(capability: Optional[Tuple[int, int]]) -> bool:
    """Native bfloat16 math: CUDA compute capability 8.0 (Ampere) and later; None is a CPU."""
    return capability is not None and tuple(capability) >= (8, 0)


def resolve_precision(value: str, has_cuda: bool, capability: Optional[Tuple[int, int]] = None) -> str:
    """Lightning's precision for `train.precision` on this rank.

    `auto`: bf16-mixed on a GPU with native bfloat16, else 32-true (CPU, or an older GPU: ask for 16-mixed there).
    `16-mixed` (float16 with a gradient scaler) needs CUDA: on a CPU rank it is an error, not Lightning's silent
    switch to bf16-mixed.
    """
    if value not in PRECISIONS:
        raise ValueError(f"config key 'train.precision': value {value!r} is not one of {', '.join(PRECISIONS)}")
    if value == "auto":
        return "bf16-mixed" if has_cuda and supports_bf16(capability) else "32-true"
    if value == "16-mixed" and not has_cuda:
        raise ValueError("config key 'train.precision': 16-mixed (float16 with a gradient scaler) needs a CUDA GPU "
                         "and this rank has none; use bf16-mixed or 32-true on CPU")
    return value


def threads_for_rank(configured: Optional[int], ranks_on_host: int) -> Optional[int]:
    """torch threads of one rank: the configured value; else 1 when several ranks share the host; else None
    (torch's own default, for a process alone on its host)."""
    if configured is not None:
        return max(1, int(configured))
    return 1 if ranks_on_host > 1 else None


def trainer_strategy(strategy: Any, world_size: int) -> Any:
    """The Lightning strategy a rank trains with: `strategy` as given (None: "auto"), except DDP on one rank, which
    trains with Lightning's single-device strategy ("auto"): one rank has nothing to average, and DDP's wrapper would
    still copy every gradient bucket and all-reduce it over a group of one in every step. HorovodStrategy skips its
    own work on one rank; FSDP is left as it is."""
    if strategy is None:
        return "auto"
    from pytorch_lightning.strategies import DDPStrategy

    if world_size == 1 and isinstance(strategy, DDPStrategy):
        return "auto"
    return strategy


def cuda_capability(index: int) -> Optional[Tuple[int, int]]:
    """Compute capability of CUDA device `index` of this process, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(index))

