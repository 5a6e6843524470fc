"""HorovodStrategy on two real Horovod ranks over Gloo: averaged gradients, broadcasts, reductions, checkpoints."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

pytest.importorskip("horovod.torch")
import horovod  # noqa: E402

NP = 2
N_FEATURES = 4
_REPO_ROOT = str(Path(__file__).resolve().parents[2])

# horovod.run pickles the worker function with cloudpickle. pytest imports this file under a name the worker processes
# cannot import, so ship this module's functions and classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _run(fn, *args):
    """Run fn(*args) on NP Gloo ranks and return the per-rank results (rank order)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + old if old else "")  # workers import `pipeline`
    try:
        return horovod.run(fn, args=args, num_proc=NP, use_gloo=True)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


# ---------------------------------------------------------------- helpers used inside the workers

def _worker_init():
    import horovod.torch as hvd

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    hvd.init()
    return hvd


def _data(n_rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, N_FEATURES, generator=g)
    w = torch.arange(1.0, N_FEATURES + 1).unsqueeze(1)
    y = x @ w + 0.1 * torch.randn(n_rows, 1, generator=g)
    return x, y


def _loader(x, y, batch_size):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _module_class():
    import pytorch_lightning as pl

    class TinyRegressor(pl.LightningModule):
        def __init__(self, seed=0, lr=0.1, momentum=0.0, log_rank=False):
            super().__init__()
            torch.manual_seed(seed)
            self.layer = torch.nn.Linear(N_FEATURES, 1)
            self.lr, self.momentum, self.log_rank = lr, momentum, log_rank
            self.seen = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            if self.log_rank:
                self.log("rank_value", float(self.global_rank), sync_dist=True, on_step=False, on_epoch=True)
                self.log("rank_sum", float(self.global_rank + 1), sync_dist=True, reduce_fx="sum",
                         on_step=False, on_epoch=True)
            return loss

        def on_train_start(self):
            self.seen["params_at_train_start"] = _flat(self)

        def on_train_batch_start(self, batch, batch_idx):
            if "first_batch" not in self.seen:  # runs after the strategy's on_train_start (optimizer broadcast)
                opt = self.trainer.optimizers[0]
                buffers = [opt.state[p].get("momentum_buffer") for p in self.parameters() if p in opt.state]
                self.seen["first_batch"] = {
                    "params": _flat(self),
                    "momentum": torch.cat([b.flatten() for b in buffers if b is not None]).clone() if any(
                        b is not None for b in buffers) else None,
                }

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    return TinyRegressor


def _flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


def _trainer(strategy=None, **kwargs):
    import pytorch_lightning as pl

    opts = dict(accelerator="cpu", devices=1, num_nodes=1, enable_progress_bar=False, logger=False,
                enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=False,
                num_sanity_val_steps=0)
    opts.update(kwargs)
    if strategy is not None:
        opts["strategy"] = strategy
    return pl.Trainer(**opts)


# ---------------------------------------------------------------- worker functions (one horovod.run each)

def _train_on_own_slices():
    """Different data per rank; a plain fit and a fit with gradient accumulation (odd batch count)."""
    hvd = _worker_init()
    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()
    x, y = _data(64)
    x, y = x[rank::size], y[rank::size]  # 32 rows per rank, different on each
    out = {}
    for name, accumulate, batch in (("plain", 1, 8), ("accumulate", 2, 7)):  # 32/7 -> 5 batches: a partial window
        model = _module_class()(seed=0)
        initial = _flat(model)
        trainer = _trainer(HorovodStrategy(), max_epochs=2, accumulate_grad_batches=accumulate)
        trainer.fit(model, _loader(x, y, batch))
        out[name] = {"initial": initial, "final": _flat(model), "steps": trainer.global_step,
                     "optimizer_type": type(trainer.optimizers[0]).__name__,
                     "optimizer_is_horovod": hasattr(trainer.optimizers[0], "skip_synchronize")}
    return out


def _counting_decisions(strategy):
    """Count the strategy's blocking decision all-reduces (the per-step one is gone unless asked for)."""
    calls = []
    real = strategy.reduce_boolean_decision

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    strategy.reduce_boolean_decision = counted
    return calls


def _decision_free_sync():
    """The same fit with the per-step decision all-reduce (the old path) and without it (the default)."""
    hvd = _worker_init()
    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()
    x, y = _data(64, seed=8)
    out = {}
    for name, skip in (("decision", True), ("direct", False)):
        model = _module_class()(seed=0, lr=0.05, momentum=0.9)
        strategy = HorovodStrategy(skip_steps_without_gradients=skip)
        calls = _counting_decisions(strategy)
        trainer = _trainer(strategy, max_epochs=2)
        trainer.fit(model, _loader(x[rank::size], y[rank::size], 4))
        out[name] = {"final": _flat(model), "steps": trainer.global_step, "decisions": len(calls)}
    return out


def _precision_fit(precision):
    """A 2-epoch fit under mixed precision: `bf16-mixed` as users set it (Lightning's flag), or `16-mixed` with a
    CPU GradScaler (as a plugin: Lightning's flag turns CPU float16 into bf16), recording the order of the gradient
    averaging, the scaler's unscale and its step."""
    hvd = _worker_init()
    from pytorch_lightning.plugins.precision import MixedPrecision

    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()
    x, y = _data(64, seed=7)
    model = _module_class()(seed=0, lr=0.05, momentum=0.9)
    dtypes = []
    model.layer.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    initial = _flat(model)
    strategy = HorovodStrategy()
    decisions = _counting_decisions(strategy)
    events = []
    real_sync = strategy._synchronize

    def synchronize(optimizer):
        real_sync(optimizer)
        events.append("averaged")

    strategy._synchronize = synchronize
    if precision == "16-mixed":
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
        real_unscale, real_step = plugin.scaler.unscale_, plugin.scaler.step

        def unscale(optimizer):
            events.append("unscale")
            return real_unscale(optimizer)

        def step(optimizer, *args, **kwargs):
            # inside skip_synchronize(): Horovod's step must not average (again)
            events.append(("step", optimizer._should_synchronize))
            return real_step(optimizer, *args, **kwargs)

        plugin.scaler.unscale_, plugin.scaler.step = unscale, step
        trainer = _trainer(strategy, max_epochs=2, plugins=[plugin])
    else:
        trainer = _trainer(strategy, max_epochs=2, precision=precision)
    trainer.fit(model, _loader(x[rank::size], y[rank::size], 8))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {"initial": initial, "final": _flat(model), "steps": trainer.global_step, "dtypes": sorted(set(map(str, dtypes))),
            "events": events, "decisions": len(decisions), "plugin": type(trainer.precision_plugin).__name__,
            "scale": float(scaler.get_scale()) if scaler is not None else None}


def _one_step(batch_size):
    hvd = _worker_init()
    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()
    x, y = _data(batch_size * size, seed=1)
    model = _module_class()(seed=3, lr=0.1)
    trainer = _trainer(HorovodStrategy(), max_steps=1)
    trainer.fit(model, _loader(x[rank::size], y[rank::size], batch_size))
    return _flat(model)


def _collectives():
    hvd = _worker_init()
    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()
    x, y = _data(32, seed=2)
    model = _module_class()(seed=0, log_rank=True)
    strategy = HorovodStrategy()
    trainer = _trainer(strategy, max_epochs=1)
    trainer.fit(model, _loader(x[rank::size], y[rank::size], 4))
    s = trainer.strategy
    strategy.barrier("test")
    return {
        "metric": trainer.callback_metrics["rank_value"].item(),
        "metric_sum": trainer.callback_metrics["rank_sum"].item(),
        "ranks": (s.global_rank, s.local_rank, s.world_size, s.node_rank, s.is_global_zero, trainer.world_size,
                  trainer.global_rank, trainer.is_global_zero),
        "sampler_kwargs": s.distributed_sampler_kwargs,
        "all_true": s.reduce_boolean_decision(True, all=True),
        "all_mixed": s.reduce_boolean_decision(rank == 0, all=True),
        "any_mixed": s.reduce_boolean_decision(rank == 0, all=False),
        "any_false": s.reduce_boolean_decision(False, all=False),
        "mean_int": s.reduce(torch.tensor(rank + 1)).item(),
        "sum": s.reduce(torch.tensor([1.0, float(rank)]), reduce_op="sum").tolist(),
        "max": s.reduce(torch.tensor(float(rank)), reduce_op="max").item(),
        "reduce_op_sum": s.reduce(torch.tensor(2.0), reduce_op=torch.distributed.ReduceOp.SUM).item(),
        "gather": s.all_gather(torch.tensor([rank, 10 + rank])).tolist(),
        "gather_scalar": s.all_gather(torch.tensor(float(rank))).tolist(),
        # different types on the ranks: Horovod's default op name would differ and hang
        "broadcast": s.broadcast({"from": rank} if rank == 0 else None, src=0),
        "not_a_tensor": s.reduce(3),
    }


def _broadcast_at_start():
    hvd = _worker_init()
    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()
    x, y = _data(16, seed=4)
    model = _module_class()(seed=100 + rank, lr=0.0)  # different initial weights on each rank
    initial = _flat(model)
    trainer = _trainer(HorovodStrategy(), max_steps=2)
    trainer.fit(model, _loader(x[rank::size], y[rank::size], 4))
    return {"initial": initial, "at_train_start": model.seen["params_at_train_start"], "final": _flat(model)}


def _resume(tmpdir):
    """Checkpoint written by rank 0 only; resume from a different file per rank; a second fit on the same model."""
    import gc

    # Horovod's gradient hooks of fit 1 outlive its optimizer until the garbage collector finds the cycle; keep them
    # alive so that the second fit deterministically meets them (the strategy must have made them inert).
    gc.disable()
    hvd = _worker_init()
    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()
    tmp = Path(tmpdir)
    x, y = _data(64, seed=5)
    loader = _loader(x[rank::size], y[rank::size], 8)
    model = _module_class()(seed=0, lr=0.05, momentum=0.9)
    trainer = _trainer(HorovodStrategy(), max_steps=2)
    trainer.fit(model, loader)
    own_path = tmp / f"written_by_rank{rank}.ckpt"
    trainer.save_checkpoint(own_path)  # every rank asks; only rank 0 may write (barrier inside)
    written = sorted(p.name for p in tmp.glob("written_by_rank*.ckpt"))
    rank0_path = tmp / "written_by_rank0.ckpt"
    ckpt = torch.load(rank0_path, weights_only=False)
    rank0_momentum = torch.cat([s["momentum_buffer"].flatten() for s in ckpt["optimizer_states"][0]["state"].values()])
    rank0_weights = torch.cat([v.flatten() for v in ckpt["state_dict"].values()])
    if rank == 0:
        resume_path = rank0_path
    else:  # a rank that restores a different state: weights and momentum off by one
        for state in ckpt["optimizer_states"][0]["state"].values():
            state["momentum_buffer"] += 1.0
        ckpt["state_dict"] = {k: v + 1.0 for k, v in ckpt["state_dict"].items()}
        resume_path = tmp / "tampered_rank1.pt"
        torch.save(ckpt, resume_path)
    hvd.barrier()
    model.seen.clear()
    from pytorch_lightning.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp / "callback", every_n_train_steps=1, save_top_k=-1)
    trainer2 = _trainer(HorovodStrategy(), max_steps=5, enable_checkpointing=True, callbacks=[checkpoints])
    trainer2.fit(model, loader, ckpt_path=str(resume_path))  # same model object: Horovod hooks of fit 1 still exist
    return {
        "written": written,
        "first_batch": model.seen["first_batch"],
        "rank0_momentum": rank0_momentum,
        "rank0_weights": rank0_weights,
        "final": _flat(model),
        "global_step": trainer2.global_step,
        "callback_files": sorted(p.name for p in (tmp / "callback").iterdir()),
    }


def _steps_without_gradients(skip_steps_without_gradients):
    """Manual optimisation: both ranks backward, then only rank 0, then neither; every rank steps each time."""
    hvd = _worker_init()
    import pytorch_lightning as pl
    from pipeline.distributed.horovod_strategy import HorovodStrategy

    rank, size = hvd.rank(), hvd.size()

    class Manual(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(N_FEATURES, 1)
            self.after = []

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            if batch_idx == 0 or (batch_idx == 1 and self.global_rank == 0):
                self.manual_backward(loss)
            opt.step()
            self.after.append(_flat(self))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, weight_decay=0.5)  # a zero-gradient step would move

    x, y = _data(24, seed=6)
    model = Manual()
    strategy = HorovodStrategy(skip_steps_without_gradients=skip_steps_without_gradients)
    _trainer(strategy, max_epochs=1).fit(model, _loader(x[rank::size], y[rank::size], 4))
    return model.after


# ---------------------------------------------------------------- tests

def test_ranks_with_different_data_end_with_identical_weights():
    results = _run(_train_on_own_slices)
    for name in ("plain", "accumulate"):
        r0, r1 = results[0][name], results[1][name]
        assert r0["steps"] == r1["steps"] > 0
        assert torch.equal(r0["final"], r1["final"]), f"{name}: ranks drifted apart: {r0['final']} vs {r1['final']}"
        assert not torch.allclose(r0["final"], r0["initial"]), f"{name}: weights did not move"
        assert r0["optimizer_type"] == "SGD" and not r0["optimizer_is_horovod"]  # plain optimizer handed back
    assert results[0]["plain"]["steps"] == 8 and results[0]["accumulate"]["steps"] == 6


def test_two_ranks_one_step_equals_single_process_step_on_concatenated_batch():
    b = 8
    per_rank = _run(_one_step, b)
    assert torch.equal(per_rank[0], per_rank[1])

    x, y = _data(b * NP, seed=1)
    order = torch.cat([torch.arange(r, b * NP, NP) for r in range(NP)])  # rank 0's rows, then rank 1's
    model = _module_class()(seed=3, lr=0.1)
    start = _flat(model)
    _trainer(max_steps=1).fit(model, _loader(x[order], y[order], b * NP))
    single = _flat(model)
    assert not torch.allclose(single, start)
    torch.testing.assert_close(per_rank[0], single, atol=1e-6, rtol=0)


def test_logged_metrics_and_collectives_reduce_across_ranks():
    results = _run(_collectives)
    for rank, r in enumerate(results):
        assert r["metric"] == pytest.approx(0.5)  # mean of ranks 0 and 1, on both ranks
        assert r["metric_sum"] == pytest.approx(12.0)  # summed over 4 steps: 4 * 1 + 4 * 2
        assert r["ranks"] == (rank, rank, NP, 0, rank == 0, NP, rank, rank == 0)
        assert r["sampler_kwargs"] == {"num_replicas": NP, "rank": rank}
        assert r["all_true"] is True and r["all_mixed"] is False
        assert r["any_mixed"] is True and r["any_false"] is False
        assert r["mean_int"] == pytest.approx(1.5)  # not Horovod's integer average (1)
        assert r["sum"] == [2.0, 1.0]
        assert r["max"] == 1.0
        assert r["reduce_op_sum"] == 4.0
        assert r["gather"] == [[0, 10], [1, 11]]
        assert r["gather_scalar"] == [0.0, 1.0]
        assert r["broadcast"] == {"from": 0}
        assert r["not_a_tensor"] == 3


def test_rank_zero_weights_are_broadcast_before_the_first_step():
    r0, r1 = _run(_broadcast_at_start)
    assert not torch.allclose(r0["initial"], r1["initial"])  # the ranks really started apart
    assert torch.equal(r1["at_train_start"], r0["initial"])
    assert torch.equal(r0["at_train_start"], r0["initial"])
    assert torch.equal(r0["final"], r1["final"])
    assert torch.equal(r0["final"], r0["initial"])  # lr=0


def test_checkpoint_written_by_rank_zero_only_and_resume_broadcasts_optimizer_state(tmp_path):
    r0, r1 = _run(_resume, str(tmp_path))
    assert r0["written"] == r1["written"] == ["written_by_rank0.ckpt"]  # rank 1 asked for written_by_rank1.ckpt too
    assert not (tmp_path / "written_by_rank1.ckpt").exists()
    for r in (r0, r1):
        # after resuming, before the first new step: rank 0's weights and momentum, on both ranks
        assert torch.equal(r["first_batch"]["params"], r0["rank0_weights"])
        assert r["first_batch"]["momentum"] is not None
        assert torch.equal(r["first_batch"]["momentum"], r0["rank0_momentum"])
        assert r["global_step"] == 5
    assert torch.equal(r0["final"], r1["final"])
    # ModelCheckpoint through the strategy: one directory (broadcast from rank 0), one file per step, no hang
    assert [name.split("-step=")[1] for name in r0["callback_files"]] == ["3.ckpt", "4.ckpt", "5.ckpt"]


def test_steps_without_gradients_on_some_or_all_ranks_neither_hang_nor_diverge():
    r0, r1 = _run(_steps_without_gradients, True)  # with the per-step decision: DDP's semantics
    assert len(r0) == len(r1) == 3
    for a, b in zip(r0, r1):
        assert torch.equal(a, b)
    assert not torch.equal(r0[1], r0[0])  # rank 0's gradient (averaged with rank 1's zeros) was applied on both
    assert torch.equal(r0[2], r0[1])  # no gradient anywhere: the step changed nothing


def test_steps_without_gradients_without_a_decision_collective_stay_identical():
    r0, r1 = _run(_steps_without_gradients, False)  # the default: no collective beyond the gradients' own
    assert len(r0) == len(r1) == 3
    for a, b in zip(r0, r1):
        assert torch.equal(a, b)
    assert not torch.equal(r0[1], r0[0])  # rank 1 contributed zeros through the same named allreduces: no hang
    # no gradient anywhere: a zero-gradient SGD step on both ranks, i.e. weight decay alone (lr 0.1, decay 0.5)
    torch.testing.assert_close(r0[2], r0[1] * (1 - 0.1 * 0.5), rtol=1e-6, atol=1e-7)


def test_gradients_averaged_with_no_decision_all_reduce_per_step_and_ranks_agree_bit_for_bit():
    r0, r1 = _run(_decision_free_sync)
    for name in ("decision", "direct"):
        assert r0[name]["steps"] == r1[name]["steps"] == 16
        assert torch.equal(r0[name]["final"], r1[name]["final"]), name
    # the per-step decision is gone: one fewer blocking all-reduce per step (what is left is Lightning's own, per epoch)
    assert r0["decision"]["decisions"] - r0["direct"]["decisions"] == 16
    assert r0["direct"]["decisions"] <= 2
    # with gradients on every rank the decision changed nothing: the same weights either way
    assert torch.equal(r0["direct"]["final"], r0["decision"]["final"])


def test_bf16_mixed_trains_on_cpu_ranks_and_they_agree_bit_for_bit():
    r0, r1 = _run(_precision_fit, "bf16-mixed")
    assert r0["plugin"] == "MixedPrecision" and r0["dtypes"] == ["torch.bfloat16"]  # autocast really ran in bf16
    assert r0["steps"] == r1["steps"] == 8
    assert torch.equal(r0["final"], r1["final"])
    assert not torch.allclose(r0["final"], r0["initial"])
    assert r0["decisions"] <= 2 and r0["events"] == ["averaged"] * 8


def test_16_mixed_scaler_unscales_and_steps_after_the_averaging_inside_skip_synchronize():
    r0, r1 = _run(_precision_fit, "16-mixed")
    assert r0["dtypes"] == ["torch.float16"]
    for r in (r0, r1):
        assert r["events"] == ["averaged", "unscale", ("step", False)] * 8, r["events"]
    assert torch.equal(r0["final"], r1["final"]) and r0["scale"] == r1["scale"]
    assert not torch.allclose(r0["final"], r0["initial"])
