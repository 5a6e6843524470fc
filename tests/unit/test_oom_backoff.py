"""OOM back-off's rules: what counts as an out-of-memory, halving down to 1, the LR rule, a checkpoint restated."""
import math

import pytest
import torch

from pipeline.config import ConfigError, DataConfig, load_config
from pipeline.distributed.backoff import backs_off, halved, is_out_of_memory, lr_batch_factor, start_batch_size
from pipeline.distributed.checkpoints.restate import converted_position, rescale_checkpoint


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:83] . DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 1073741824 bytes"),
    RuntimeError("CUDA error: out of memory"),
    MemoryError("Unable to allocate 3.00 GiB for an array"),
])
def test_out_of_memory_is_recognised(exc):
    assert is_out_of_memory(exc)


def test_out_of_memory_is_recognised_through_the_launchers_report_and_causes():
    from pipeline.distributed.launcher import DistributedTrainingError

    reported = DistributedTrainingError("training failed on rank 1: OutOfMemoryError: CUDA out of memory: injected")
    assert is_out_of_memory(reported)
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("horovod.run failed") from inner
    except RuntimeError as outer:
        assert is_out_of_memory(outer)


@pytest.mark.parametrize("exc", [RuntimeError("injected failure at step 3 on rank 1 (debug.fail_at_step)"),
                                 ValueError("memory_cache_mb must be >= 0"), None])
def test_other_failures_are_not_out_of_memory(exc):
    assert not is_out_of_memory(exc)


def test_halving_goes_down_to_one_per_rank_then_names_the_key():
    sizes, b = [], 256
    while True:
        try:
            b = halved(b)
        except ConfigError as err:
            assert "data.batch_size" in str(err) and "1 sample per rank" in str(err)
            break
        sizes.append(b)
    assert sizes == [128, 64, 32, 16, 8, 4, 2, 1]
    assert halved(7) == 3


def test_lr_follows_the_global_batch_by_the_scaling_rule():
    assert lr_batch_factor(32, 64, "linear") == 0.5
    assert lr_batch_factor(32, 64, "sqrt") == pytest.approx(1 / math.sqrt(2))
    assert lr_batch_factor(32, 64, "none") == 1.0
    assert lr_batch_factor(64, 64, "linear") == 1.0  # no back-off: today's rate exactly


def test_converted_position_keeps_the_epoch_and_the_samples_within_it():
    # 3 epochs of 10 steps of 64, then 4 steps into the 4th -> 20 steps of 32 per epoch: 3 epochs + 8 steps
    assert converted_position(34, 4, 10, 64, 20, 32) == (68, 8)
    assert converted_position(30, 10, 10, 64, 21, 32) == (63, 21)  # an epoch that had ended stays ended
    assert converted_position(9, 9, 10, 64, 11, 32) == (10, 10)  # mid-epoch never reaches the epoch's last step


def _progress(total, current):
    return {"total": {"ready": total, "completed": total, "started": total, "processed": total},
            "current": {"ready": current, "completed": current, "started": current, "processed": current},
            "is_last_batch": False}


def test_rescale_checkpoint_restates_steps_schedule_and_rates(tmp_path):
    src, dst = str(tmp_path / "last.ckpt"), str(tmp_path / "last-batch32.ckpt")
    optim = {"optimizer": {"step": _progress(34, 4), "zero_grad": _progress(34, 4)}}
    torch.save({"global_step": 34, "epoch": 3, "lakehouse": {"delta_version": 0}, "state_dict": {"w": torch.ones(2)},
                "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"steps_per_epoch": 10}]},
                                       "epoch_loop.state_dict": {"_batches_that_stepped": 34},
                                       "epoch_loop.batch_progress": _progress(34, 4),
                                       "epoch_loop.scheduler_progress": _progress(34, 4),
                                       "epoch_loop.automatic_optimization.optim_progress": optim,
                                       "epoch_progress": _progress(3, 3)}},
                "optimizer_states": [{"param_groups": [{"lr": 0.02, "initial_lr": 0.02, "momentum": 0.9}]}],
                "lr_schedulers": [{"base_lrs": [0.02], "_last_lr": [0.02], "last_epoch": 34, "_step_count": 35}]}, src)
    assert rescale_checkpoint(src, dst, 10, 64, 20, 32, 0.5) == 68
    c = torch.load(dst, weights_only=False)
    fit = c["loops"]["fit_loop"]
    assert c["global_step"] == 68 and fit["epoch_loop.state_dict"]["_batches_that_stepped"] == 68
    assert fit["epoch_loop.batch_progress"] == {**_progress(68, 8), "is_last_batch": False}
    assert fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"] == _progress(68, 8)
    assert fit["epoch_progress"] == _progress(3, 3) and fit["state_dict"]["combined_loader"][0]["steps_per_epoch"] == 20
    assert c["optimizer_states"][0]["param_groups"][0] == {"lr": 0.01, "initial_lr": 0.01, "momentum": 0.9}
    assert c["lr_schedulers"][0] == {"base_lrs": [0.01], "_last_lr": [0.01], "last_epoch": 68, "_step_count": 69}
    assert c["lakehouse"] == {"delta_version": 0} and torch.equal(c["state_dict"]["w"], torch.ones(2))


def test_auto_batch_size_config(tmp_path):
    assert start_batch_size(DataConfig(batch_size="auto", auto_batch_start=128)) == 128
    assert start_batch_size(DataConfig(batch_size=16)) == 16
    assert backs_off(DataConfig(batch_size="auto"), False)
    assert not backs_off(DataConfig(batch_size=16), False) and backs_off(DataConfig(batch_size=16), True)
    cfg = load_config(None, ["data.batch_size=auto", "data.auto_batch_start=64", "train.oom_backoff=true"])
    assert cfg.data.batch_size == "auto" and cfg.train.oom_backoff and cfg.flat()["data.batch_size"] == "auto"
    assert load_config(None, ["data.batch_size=8"]).data.batch_size == 8
    for bad in ("data.batch_size=big", "data.batch_size=0", "data.auto_batch_start=0", "debug.fail_with=segv"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])
