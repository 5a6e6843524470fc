"""HorovodStrategy on one real Horovod rank: nothing to average, so no Horovod optimizer, no gradient hooks and no
Horovod op in a step; the weights come out as a plain PyTorch loop's, bit for bit, and the collectives give the
rank's own values."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

pytest.importorskip("horovod.torch")
import horovod  # noqa: E402

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker below travels by value

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _one_rank_fit():
    import horovod.torch as hvd
    import horovod.torch.mpi_ops as ops
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from pipeline.distributed.horovod_strategy import HorovodStrategy

    torch.set_num_threads(1)
    hvd.init()
    calls = []
    for name in ("allreduce_async_", "allreduce_async", "allgather_async", "broadcast_async_", "broadcast_async",
                 "grouped_allreduce_async_"):
        original = getattr(ops, name)
        setattr(ops, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.seen = {}

        def training_step(self, batch, batch_idx):
            opt = self.trainer.optimizers[0]
            self.seen.setdefault("horovod_optimizer", hasattr(getattr(opt, "_optimizer", opt), "skip_synchronize"))
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    model = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=1, strategy=HorovodStrategy(), max_epochs=2,
                         enable_progress_bar=False, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    in_fit = list(calls)
    strategy = trainer.strategy
    summed = strategy.reduce(torch.tensor([2.0, 3.0]), reduce_op="sum")
    gathered = strategy.all_gather(torch.tensor([1.0, 2.0]))
    agreed = strategy.broadcast({"a": 1})
    # the same 16 steps as a plain loop
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for i in range(0, 64, 8):
            opt.zero_grad()
            torch.nn.functional.mse_loss(plain(x[i:i + 8]), y[i:i + 8]).backward()
            opt.step()
    return {"calls_in_fit": in_fit, "horovod_optimizer": model.seen["horovod_optimizer"], "size": hvd.size(),
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
            "plain": torch.cat([p.detach().flatten() for p in plain.parameters()]),
            "summed": summed, "gathered": gathered, "agreed": agreed, "ops_after": list(calls)}


def test_one_rank_trains_without_horovods_optimizer_hooks_or_ops_and_matches_a_plain_loop():
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + old if old else "")
    try:
        (out,) = horovod.run(_one_rank_fit, num_proc=1, use_gloo=True)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    assert out["size"] == 1
    assert out["horovod_optimizer"] is False  # not Horovod's DistributedOptimizer: no gradient hooks, no synchronize()
    assert out["calls_in_fit"] == []  # no Horovod op in any step, nor in set-up (broadcasts) or epoch ends
    assert torch.equal(out["weights"], out["plain"])
    assert torch.equal(out["summed"], torch.tensor([2.0, 3.0]))
    assert torch.equal(out["gathered"], torch.tensor([[1.0, 2.0]])) and out["agreed"] == {"a": 1}
    assert out["ops_after"] == []
