"""One DDP or FSDP rank for tests/gpu/test_gpu_training.py, started by torchrun: trains, writes rank<N>.json to argv[1].

argv: OUT_DIR PRECISION [ddp|fsdp]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the package `gpu`


def main() -> None:
    import torch
    import torch.distributed as dist
    from pytorch_lightning.strategies import DDPStrategy

    from gpu.test_gpu_training import fit

    try:
        from pipeline.distributed.devices import ddp_backend
    except ImportError:  # before the DDP-on-NCCL change: what it must choose
        def ddp_backend(has_cuda: bool) -> str:
            return "nccl" if has_cuda else "gloo"

    out_dir, precision = sys.argv[1], sys.argv[2]
    kind = sys.argv[3] if len(sys.argv) > 3 else "ddp"
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    backend = ddp_backend(torch.cuda.is_available())
    if kind == "fsdp":
        from pipeline.distributed.fsdp import LakehouseFSDPStrategy

        strategy = LakehouseFSDPStrategy(process_group_backend=backend)
    else:
        strategy = DDPStrategy(process_group_backend=backend)
    result = fit(strategy, precision, rank, devices=local)
    result["backend"] = dist.get_backend() if dist.is_initialized() else backend
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
