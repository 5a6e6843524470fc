"""The JSON report of scripts/gpu_check.sh: device, versions, Horovod's build, GPU-tier outcomes, samples/s per configuration."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from typing import Any, Dict, List, Optional

# (arch, channels, image size, batch): the configurations of the reference figures in docs/STACK (plain PyTorch loop
# on GPU-resident batches, one GPU).
CONFIGS = [("cnn", 1, 32, 64), ("cnn", 1, 32, 512), ("resnet", 3, 64, 64), ("resnet", 3, 64, 256)]


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device() -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "gpus": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                 "memory_gib": round(p.total_memory / 2**30, 1),
                                 "bf16": bool(torch.cuda.is_bf16_supported())})
        try:
            info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as exc:
            info["nccl"] = f"unknown ({exc})"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def horovod() -> Dict[str, Any]:
    try:
        import horovod as hv
        import horovod.torch as hvd
    except Exception as exc:
        return {"installed": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"installed": True, "version": hv.__version__, "nccl_built": bool(hvd.nccl_built()),
            "gloo_built": bool(hvd.gloo_built()), "mpi_built": bool(hvd.mpi_built())}


def tests(junit: str) -> Dict[str, Any]:
    if not os.path.exists(junit):
        return {"ran": False}
    cases: List[Dict[str, Any]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:500]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    counts: Dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    return {"ran": True, "counts": counts, "cases": cases}


def plain_loop(warmup: int = 10, steps: int = 50) -> List[Dict[str, Any]]:
    """samples/s of a plain PyTorch loop (the project's networks, SGD, GPU-resident batches) per configuration and
    precision on GPU 0: the reference the bench compares the product's path with."""
    import torch

    from pipeline.model.nets import build_network

    dev = torch.device("cuda", 0)
    precisions = ["32-true"] + (["bf16-mixed"] if torch.cuda.is_bf16_supported() else [])
    out = []
    for arch, channels, size, batch in CONFIGS:
        for precision in precisions:
            torch.manual_seed(0)
            net = build_network(arch, channels, 10).to(dev)
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            x = torch.randn(batch, channels, size, size, device=dev)
            y = torch.randint(0, 10, (batch,), device=dev)
            loss_fn = torch.nn.CrossEntropyLoss()

            def step() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                    loss = loss_fn(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            for _ in range(warmup):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            out.append({"path": "plain-loop", "arch": arch, "input": f"{channels}x{size}x{size}", "batch": batch,
                        "precision": precision, "samples_per_s": round(batch * steps / (time.perf_counter() - t0), 1)})
    return out


def bench_figures() -> Dict[str, Any]:
    """The bench's GPU figures of the product's path (Lightning + strategy), where it offers them without Spark."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: bench/ sits beside pipeline/
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        from bench import gpu as bench_gpu
    except Exception as exc:
        return {"skipped": f"bench.gpu is not importable here: {type(exc).__name__}: {exc}"}
    fn = getattr(bench_gpu, "standalone_figures", None)
    if fn is None:
        return {"skipped": "bench.gpu offers no standalone_figures() (its measure_gpu needs Spark-converted "
                           "data); run `lakehouse bench` where Spark and Java are"}
    return fn()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--junit", required=True)
    ap.add_argument("--horovod-log", default=None)
    ap.add_argument("--pytest-rc", type=int, default=None)
    ap.add_argument("--seconds", default="", help="step=seconds,...")
    args = ap.parse_args()

    report: Dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
                              "python": platform.python_version(), "platform": platform.platform()}
    report["device"] = device()
    report["versions"] = {d: _version(d) for d in ("torch", "pytorch-lightning", "torchmetrics", "numpy", "pyarrow",
                                                   "pandas", "mlflow-skinny", "mlflow", "horovod", "pyspark",
                                                   "petastorm")}
    report["horovod"] = horovod()
    if args.horovod_log and os.path.exists(args.horovod_log):
        with open(args.horovod_log) as fh:
            report["horovod"]["build_notes"] = [line.strip() for line in fh if line.startswith("build_horovod:")]
    report["tests"] = tests(args.junit)
    report["pytest_exit_status"] = args.pytest_rc
    report["seconds"] = {k: int(v) for k, v in (p.split("=") for p in args.seconds.split(",") if "=" in p)}
    if report["device"]["cuda_available"]:
        try:
            report["throughput"] = plain_loop()
        except Exception as exc:
            report["throughput"] = {"error": f"{type(exc).__name__}: {exc}"}
        report["bench"] = bench_figures()
    else:
        report["throughput"] = {"skipped": "no CUDA device visible"}
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(json.dumps({"report": args.out, "tests": report["tests"].get("counts"),
                      "nccl_built": report["horovod"].get("nccl_built")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
