"""The GPU tier: every test here needs CUDA and is skipped with the reason where none is visible.

Imports nothing beyond torch, Lightning, Horovod and the project (no pyspark, petastorm): scripts/gpu_check.sh runs
it on a bare CUDA machine. LAKEHOUSE_GPU_TIER_ON_CPU=1 runs the same tests on CPU ranks over gloo (NCCL and sync
checks skipped), to develop the tier on a machine without a GPU; it proves nothing about GPUs.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from .gpu_env import HERE, cuda_state, on_cpu


def pytest_collection_modifyitems(config, items):
    ok, why = cuda_state()
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not ok and not on_cpu():
            item.add_marker(pytest.mark.skip(reason=f"GPU tier needs CUDA: {why}"))


@pytest.fixture(scope="session")
def gpu_ranks() -> int:
    """Ranks for the tier: one per visible GPU (every GPU used), or 2 CPU ranks in the CPU development mode."""
    import torch

    return torch.cuda.device_count() if cuda_state()[0] else 2
