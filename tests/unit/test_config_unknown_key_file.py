"""An unknown key in a YAML profile, or in the base merged under it, is refused naming the file it is in and the
dotted key (load_config's docstring promises the file; the check of the merged config alone could name the key only)."""
import pytest

from pipeline.config import ConfigError, load_config


def test_an_unknown_key_in_a_profile_names_the_profile_and_the_key(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("train:\n  max_epochs: 3\n  max_epoch: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(profile))
    msg = str(err.value)
    assert str(profile) in msg and "'train.max_epoch'" in msg and "max_epochs" in msg  # the valid keys listed too


def test_an_unknown_key_in_the_base_names_the_base_not_the_profile(tmp_path):
    (tmp_path / "shared.yaml").write_text("model:\n  lrate: 0.25\n")
    (tmp_path / "p.yaml").write_text("extends: shared.yaml\ntrain:\n  max_epochs: 3\n")
    with pytest.raises(ConfigError, match=r"shared\.yaml: unknown config key 'model\.lrate'"):
        load_config(str(tmp_path / "p.yaml"))


def test_an_unknown_section_names_the_file(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  np: 2\n")
    (tmp_path / "p.yaml").write_text("train:\n  max_epochs: 3\n")
    with pytest.raises(ConfigError, match=r"base\.yaml: unknown config key 'trainer'; valid keys of the top level"):
        load_config(str(tmp_path / "p.yaml"))


def test_known_keys_of_both_files_still_load(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  lr: 0.25\nspark:\n  conf:\n    spark.any.key: x\n")
    (tmp_path / "p.yaml").write_text("train:\n  max_epochs: 3\n")
    cfg = load_config(str(tmp_path / "p.yaml"))
    assert cfg.model.lr == 0.25 and cfg.train.max_epochs == 3 and cfg.spark.conf == {"spark.any.key": "x"}
