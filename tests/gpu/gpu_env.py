"""Where the GPU tier may run: a CUDA torch with a visible device, or the CPU development mode (see conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple

HERE = Path(__file__).resolve().parent
ON_CPU_VAR = "LAKEHOUSE_GPU_TIER_ON_CPU"


def cuda_state() -> Tuple[bool, str]:
    """(usable, why): a CUDA torch that sees at least one device."""
    try:
        import torch
    except Exception as exc:  # pragma: no cover - the project needs torch
        return False, f"torch is not importable ({exc})"
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is a CPU build (no CUDA)"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return True, f"{torch.cuda.device_count()} CUDA device(s)"


def on_cpu() -> bool:
    return os.environ.get(ON_CPU_VAR) == "1" and not cuda_state()[0]
