"""train.precision and train.threads_per_rank in the config, and the per-rank choices of device, DDP backend,
precision and threads (pure functions of what the rank sees)."""
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.distributed.devices import (DeviceError, ddp_backend, rank_device_index, resolve_precision,
                                          supports_bf16, threads_for_rank)

from conftest import ROOT


def test_precision_defaults_to_auto_and_takes_each_choice():
    assert load_config(str(ROOT / "conf/local.yaml")).train.precision == "auto"
    assert load_config(None).train.precision == "auto"
    for value in ("32-true", "bf16-mixed", "16-mixed", "auto"):
        assert load_config(None, [f"train.precision={value}"]).train.precision == value


@pytest.mark.parametrize("value", ["16", "bf16", "fp16", "64-true", "16-true"])
def test_unknown_precision_names_the_key_and_the_choices(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"train.precision={value}"])
    msg = str(err.value)
    assert "train.precision" in msg and "bf16-mixed" in msg and "32-true" in msg


def test_threads_per_rank_null_by_default_explicit_value_kept_zero_rejected():
    assert load_config(None).train.threads_per_rank is None
    assert load_config(str(ROOT / "conf/local.yaml")).train.threads_per_rank is None
    assert load_config(None, ["train.threads_per_rank=3"]).train.threads_per_rank == 3
    with pytest.raises(ConfigError, match="train.threads_per_rank"):
        load_config(None, ["train.threads_per_rank=0"])


def test_auto_precision_is_bf16_on_a_bf16_gpu_else_32():
    assert resolve_precision("auto", has_cuda=False) == "32-true"
    assert resolve_precision("auto", has_cuda=True, capability=(9, 0)) == "bf16-mixed"  # H100
    assert resolve_precision("auto", has_cuda=True, capability=(8, 0)) == "bf16-mixed"  # A100
    assert resolve_precision("auto", has_cuda=True, capability=(7, 0)) == "32-true"  # V100: no native bf16
    assert supports_bf16((8, 6)) and not supports_bf16((7, 5)) and not supports_bf16(None)


def test_explicit_precision_wins_and_16_mixed_needs_cuda():
    assert resolve_precision("bf16-mixed", has_cuda=False) == "bf16-mixed"  # Lightning trains bf16 on CPU
    assert resolve_precision("32-true", has_cuda=True, capability=(9, 0)) == "32-true"
    assert resolve_precision("16-mixed", has_cuda=True, capability=(7, 0)) == "16-mixed"
    with pytest.raises(ValueError, match="train.precision.*16-mixed.*CUDA"):
        resolve_precision("16-mixed", has_cuda=False)
    with pytest.raises(ValueError, match="train.precision"):
        resolve_precision("fp8", has_cuda=True, capability=(9, 0))


def test_ddp_backend_is_nccl_with_cuda_else_gloo():
    assert ddp_backend(True) == "nccl"
    assert ddp_backend(False) == "gloo"


def test_each_rank_pins_its_local_rank_or_device_zero_when_it_sees_one_gpu():
    assert [rank_device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]  # every GPU of the host visible
    assert [rank_device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]  # Spark GPU scheduling: only its own
    with pytest.raises(DeviceError, match="local rank 2.*2 GPUs"):
        rank_device_index(2, 2)  # more ranks on this host than GPUs
    with pytest.raises(DeviceError, match="no CUDA device"):
        rank_device_index(0, 0)


def test_threads_one_per_rank_when_ranks_share_a_host_else_torch_default_explicit_wins():
    assert threads_for_rank(None, 2) == 1
    assert threads_for_rank(None, 1) is None  # a process alone on its host: torch's default
    assert threads_for_rank(4, 2) == 4 and threads_for_rank(3, 1) == 3
