"""What every rank's machine used in an epoch (host CPU and memory, the rank's peak resident memory and peak GPU
memory), gathered to rank 0 with one all-gather at the epoch end and logged there with the epoch's metrics."""
from __future__ import annotations

import resource
import sys
from typing import Dict, List

import pytorch_lightning as pl
import torch

# per rank, in this order; the GPU fields are logged only where the rank trains on a GPU
FIELDS = ("host_cpu_percent", "host_memory_used_mb", "peak_rss_mb", "gpu_peak_memory_mb", "gpu_reserved_memory_mb")
GPU_FIELDS = FIELDS[3:]


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


class RankResources(pl.Callback):
    """Samples this rank's machine over each epoch: `psutil.cpu_percent` since the epoch started (the whole host),
    the host's used memory, this process's peak RSS and, on a GPU, the peak memory torch allocated on the rank's device
    in the epoch (the peak is reset at each epoch start) and what its caching allocator holds.
    `epoch_metrics(trainer)` is a collective: every rank calls it at the same epoch end."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._psutil.cpu_percent(interval=None)  # the next call measures from here
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def sample(self, device: torch.device) -> List[float]:
        gpu = device.type == "cuda"
        return [float(self._psutil.cpu_percent(interval=None)),
                float(self._psutil.virtual_memory().used) / 1e6,
                peak_rss_mb(),
                torch.cuda.max_memory_allocated(device) / 1e6 if gpu else 0.0,
                torch.cuda.memory_reserved(device) / 1e6 if gpu else 0.0]

    def epoch_metrics(self, trainer) -> Dict[str, float]:
        """`<field>_rank_<r>` for every rank (rank r's machine), on every rank."""
        device = trainer.strategy.root_device
        local = torch.tensor(self.sample(device), dtype=torch.float64, device=device)
        gathered = trainer.strategy.all_gather(local)
        rows = (gathered.reshape(-1, len(FIELDS)) if gathered.dim() > 1 else gathered.reshape(1, -1)).cpu().tolist()
        fields = FIELDS if device.type == "cuda" else FIELDS[:3]
        return {f"{name}_rank_{r}": row[i] for r, row in enumerate(rows) for i, name in enumerate(FIELDS)
                if name in fields}

