"""The training plane on GPUs: Horovod with NCCL on every visible GPU, DDP on NCCL, bf16-mixed, ranks' weights equal,
no host-device synchronization inside a training step. The project's ImageClassifier and HorovodStrategy, on in-memory
uint8 batches (the data path is tests/gpu/test_gpu_pipeline.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from .gpu_env import on_cpu

ROOT = Path(__file__).resolve().parents[2]
# horovod.run pickles the worker with cloudpickle; the workers cannot import this file under pytest's name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.timeout(900)]
ROWS_PER_RANK, BATCH, EPOCHS = 512, 64, 2
FORBIDDEN_IN_RANKS = ("pyspark", "petastorm", "mlflow")


# ---------------------------------------------------------------- used inside the ranks

def images(n: int, seed: int, size: int = 32, classes: int = 10):
    """uint8 (n, 1, size, size) images whose label is drawn as a bright row, and the labels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = (torch.rand(n, 1, size, size, generator=g) * 96).to(torch.uint8)
    x[torch.arange(n), 0, y * 3 + 1, :] = 255
    return x, y


def digest(module) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_sync_guard():
    """A callback that turns CUDA host-device synchronization into an error from each training batch's start to its
    end (forward, backward, the strategy's gradient all-reduce, the optimizer step)."""
    import pytorch_lightning as pl
    import torch

    class NoHostSync(pl.Callback):
        steps = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.set_sync_debug_mode("default")
            self.steps += 1

        def on_exception(self, trainer, pl_module, exception):
            torch.cuda.set_sync_debug_mode("default")

    return NoHostSync()


def where_trained_callback():
    """A callback that records where the parameters were during training (Lightning moves the module back to the CPU
    when fit ends, so the device is read at the first training batch)."""
    import pytorch_lightning as pl
    import torch

    class WhereTrained(pl.Callback):
        device, device_name = "", ""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not self.device:
                param = next(pl_module.parameters())
                self.device = str(param.device)
                self.device_name = torch.cuda.get_device_name(param.device) if param.is_cuda else "cpu"

    return WhereTrained()


def fit(strategy, precision: str, rank: int, devices: int = 1, sync_guard: bool = False, arch: str = "cnn",
        pretrained: str = None):
    """Train the project's ImageClassifier (`arch`: cnn, resnet or timm/<name>, `pretrained`: a model.pretrained
    file) on this rank's own rows; what the test compares across ranks."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from pipeline.config import ModelConfig
    from pipeline.model.module import ImageClassifier

    gpu = torch.cuda.is_available()
    pl.seed_everything(7, verbose=False)  # same initial weights on every rank (and the strategy broadcasts rank 0's)
    steps = ROWS_PER_RANK // BATCH
    model = ImageClassifier.from_config(ModelConfig(arch=arch, lr=0.05, pretrained=pretrained), channels=1,
                                        num_classes=10, lr=0.05, steps_per_epoch=steps, max_epochs=EPOCHS)
    x, y = images(ROWS_PER_RANK, seed=100 + rank)  # each rank its own rows: unaveraged gradients would diverge
    vx, vy = images(BATCH * 2, seed=999 + rank)
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False, pin_memory=gpu, drop_last=True)
    val = DataLoader(TensorDataset(vx, vy), batch_size=BATCH, pin_memory=gpu)
    guard = make_sync_guard() if sync_guard else None
    where = where_trained_callback()
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="gpu" if gpu else "cpu", devices=devices, strategy=strategy,
                         precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                         callbacks=[where] + ([guard] if guard else []))
    trainer.fit(model, train, val)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"rank": rank, "digest": digest(model), "metrics": metrics, "device": where.device,
            "device_name": where.device_name, "strategy": type(strategy).__name__,
            "sync_guarded_steps": guard.steps if guard else 0, "precision": str(trainer.precision),
            "imported": sorted(m for m in FORBIDDEN_IN_RANKS if m in sys.modules)}


def horovod_rank(precision: str, sync_guard: bool, arch: str = "cnn", pretrained: str = None):
    import horovod.torch as hvd
    import torch

    from pipeline.distributed.horovod_strategy import HorovodStrategy

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    out = fit(HorovodStrategy(), precision, hvd.rank(), sync_guard=sync_guard, arch=arch, pretrained=pretrained)
    out.update(size=hvd.size(), nccl_built=bool(hvd.nccl_built()))
    return out


def run_horovod(np_: int, *args):
    import horovod

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + old if old else "")
    try:
        return horovod.run(horovod_rank, args=args, num_proc=np_, hosts=f"localhost:{np_}", use_gloo=True,
                           start_timeout=120)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


# ---------------------------------------------------------------- the tests

def test_horovod_is_built_with_nccl():
    import horovod.torch as hvd

    if on_cpu():
        pytest.skip("CPU development mode: a CPU torch builds Horovod without NCCL")
    assert hvd.nccl_built(), "horovod.torch.nccl_built() is 0: rebuild with scripts/build_horovod.sh on this machine"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_horovod_trains_on_every_gpu_and_ranks_agree(gpu_ranks, precision):
    results = run_horovod(gpu_ranks, precision, False)
    assert [r["rank"] for r in results] == list(range(gpu_ranks)) and {r["size"] for r in results} == {gpu_ranks}
    assert len({r["digest"] for r in results}) == 1, f"ranks' weights differ after training: {results}"
    for r in results:
        assert r["metrics"]["train_loss"] == r["metrics"]["train_loss"]  # finite, logged once per epoch
        assert r["metrics"]["val_acc"] > 0.2, r["metrics"]  # learned the drawn row (chance is 0.1)
        assert r["imported"] == [], f"rank {r['rank']} imported {r['imported']}"
        assert precision in r["precision"] or precision.split("-")[0] in r["precision"]
        if not on_cpu():
            assert r["device"] == f"cuda:{r['rank']}", r  # one rank per GPU, rank i on GPU i (one node)
            assert r["nccl_built"]


def test_no_host_sync_inside_training_steps(gpu_ranks):
    if on_cpu():
        pytest.skip("CPU development mode: torch.cuda.set_sync_debug_mode needs CUDA")
    results = run_horovod(gpu_ranks, "bf16-mixed", True)
    for r in results:
        assert r["sync_guarded_steps"] == EPOCHS * (ROWS_PER_RANK // BATCH), r
    assert len({r["digest"] for r in results}) == 1


def run_torchrun(gpu_ranks: int, out: Path, strategy: str, precision: str):
    """`strategy` (ddp, fsdp) ranks through torchrun (as TorchDistributor starts them); their results by rank."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpu_ranks}",
           str(Path(__file__).with_name("ddp_rank.py")), str(out), precision, strategy]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(results) == gpu_ranks
    assert {r["backend"] for r in results} == {"gloo" if on_cpu() else "nccl"}
    for r in results:
        assert r["metrics"]["val_acc"] > 0.2, r["metrics"]
        assert r["imported"] == [], f"rank {r['rank']} imported {r['imported']}"
        if not on_cpu():
            assert r["device"] == f"cuda:{r['rank']}", r
    return results


def test_ddp_on_nccl_on_every_gpu(gpu_ranks, tmp_path):
    """DDP, the backend chosen the way the project's DDP ranks choose it: NCCL with GPUs, gloo on CPU."""
    results = run_torchrun(gpu_ranks, tmp_path, "ddp", "bf16-mixed")
    assert len({r["digest"] for r in results}) == 1, f"ranks' weights differ after DDP training: {results}"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fsdp_on_nccl_on_every_gpu(gpu_ranks, tmp_path, precision):
    """The project's FSDP strategy (LakehouseFSDPStrategy: size-based units, sharded state) over NCCL: each rank
    holds a shard, so weights are compared through the loss and accuracy, not a digest."""
    results = run_torchrun(gpu_ranks, tmp_path, "fsdp", precision)
    for r in results:
        assert r["strategy"] == "LakehouseFSDPStrategy", r
        assert precision in r["precision"] or precision.split("-")[0] in r["precision"], r


def test_timm_backbone_in_bf16_from_a_pretrained_file(gpu_ranks, tmp_path):
    """A timm backbone (resnet18) loaded from a local model.pretrained file, fine-tuned in bf16-mixed on every GPU
    through Horovod with NCCL."""
    from pipeline.model.timm_backbone import build_timm_network, save_pretrained

    weights = save_pretrained(build_timm_network("timm/resnet18", in_chans=1, num_classes=10, data_size=32),
                              str(tmp_path / "resnet18.safetensors"))
    results = run_horovod(gpu_ranks, "bf16-mixed", False, "timm/resnet18", weights)
    assert len({r["digest"] for r in results}) == 1, f"ranks' weights differ after training: {results}"
    for r in results:
        assert r["metrics"]["train_loss"] == r["metrics"]["train_loss"], r["metrics"]  # finite
        assert "bf16" in r["precision"], r
        if not on_cpu():
            assert r["device"] == f"cuda:{r['rank']}", r
