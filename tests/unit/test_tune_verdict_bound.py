"""A sweep whose pruning verdict may take as long as the stall bound is refused before it starts: the ranks wait for
the verdict at an epoch end without a step, and the driver's stall watchdog would end a healthy trial."""
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.tune.sweep import sweep_config


def test_a_verdict_wait_not_below_the_stall_bound_is_refused_naming_both_keys():
    cfg = load_config(None, ["train.stall_timeout_s=20", "tune.verdict_timeout_s=30"])
    with pytest.raises(ConfigError, match=r"tune\.verdict_timeout_s.*train\.stall_timeout_s"):
        sweep_config(cfg, None, None)
    assert sweep_config(load_config(None, ["train.stall_timeout_s=20", "tune.verdict_timeout_s=10"]), None, None)
    # no pruning: no verdict is waited for
    assert sweep_config(load_config(None, ["train.stall_timeout_s=20", "tune.pruner=none"]), None, None)
