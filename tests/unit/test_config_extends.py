"""A profile's `extends:` (the named base merged under it; a named base that is missing is an error) and the bounds
of the seeds and the distributed timeouts."""
import pytest

from pipeline.config import ConfigError, load_config


def test_a_named_base_is_merged_under_the_profile(tmp_path):
    (tmp_path / "shared.yaml").write_text("model:\n  lr: 0.25\ntrain:\n  max_epochs: 7\n")
    (tmp_path / "p.yaml").write_text("extends: shared.yaml\ntrain:\n  max_epochs: 3\n")
    cfg = load_config(str(tmp_path / "p.yaml"))
    assert cfg.model.lr == 0.25 and cfg.train.max_epochs == 3


def test_a_named_base_that_is_missing_fails_naming_it(tmp_path):
    (tmp_path / "p.yaml").write_text("extends: nope.yaml\ntrain:\n  max_epochs: 3\n")
    with pytest.raises(ConfigError, match=r"extends: 'nope.yaml'.*nope\.yaml does not exist"):
        load_config(str(tmp_path / "p.yaml"))


def test_without_extends_a_missing_base_yaml_is_fine(tmp_path):
    (tmp_path / "p.yaml").write_text("train:\n  max_epochs: 3\n")
    assert load_config(str(tmp_path / "p.yaml")).train.max_epochs == 3


@pytest.mark.parametrize("key", ["data.seed", "train.seed", "tune.seed"])
def test_a_seed_numpy_or_lightning_cannot_take_is_refused_naming_the_key(key):
    # numpy's default_rng refused -1 only at the first batch; Lightning replaced it with a random seed, silently
    for bad in ("-1", str(2 ** 32)):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"{key}={bad}"])
    assert load_config(None, [f"{key}=0"]).flat()[key] == 0


@pytest.mark.parametrize("key", ["train.stall_timeout_s", "train.start_timeout_s"])
def test_a_distributed_bound_of_zero_or_less_is_refused_naming_the_key(key):
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*must be >= 1"):
            load_config(None, [f"{key}={bad}"])
    assert load_config(None, [f"{key}=1"]).flat()[key] == 1
