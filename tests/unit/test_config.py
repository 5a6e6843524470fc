"""Config loading, overrides and the errors that name the key."""
import pytest

from pipeline.config import ConfigError, load_config, parse_override

from conftest import ROOT


def test_local_profile_merges_over_base():
    cfg = load_config(str(ROOT / "conf/local.yaml"))
    assert cfg.delta.engine == "delta-rs"
    assert cfg.delta.table == "work/delta/digits"  # from local.yaml
    assert cfg.data.val_fraction == 0.2  # from base.yaml
    assert cfg.train.early_stopping.patience == 3


def test_overrides_are_typed_and_nested():
    cfg = load_config(str(ROOT / "conf/local.yaml"),
                      ["train.np=-4", "model.lr=0.05", "delta.version=3", "train.early_stopping.patience=7",
                       "train.early_stopping.stopping_threshold=0.55", "mlflow.promote=false",
                       "spark.conf.spark.jars=/opt/delta.jar"])
    assert cfg.train.np == -4 and cfg.model.lr == 0.05 and cfg.delta.version == 3
    assert cfg.train.early_stopping.patience == 7
    assert cfg.train.early_stopping.stopping_threshold == 0.55
    assert cfg.mlflow.promote is False
    assert cfg.spark.conf == {"spark.jars": "/opt/delta.jar"}


def test_int_widens_to_float_and_null_clears():
    cfg = load_config(None, ["model.lr=1", "delta.version=null"])
    assert cfg.model.lr == 1.0 and isinstance(cfg.model.lr, float)
    assert cfg.delta.version is None


def test_unknown_key_names_key_and_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.batchsize=3"])
    msg = str(err.value)
    assert "data.batchsize" in msg and "batch_size" in msg and "val_fraction" in msg


def test_unknown_section():
    with pytest.raises(ConfigError, match="unknown config key 'trainer'"):
        load_config(None, ["trainer.np=2"])


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.batch_size=big"])
    assert "data.batch_size" in str(err.value) and "'big'" in str(err.value) and "int" in str(err.value)


def test_choice_and_range_validation():
    with pytest.raises(ConfigError, match="train.backend"):
        load_config(None, ["train.backend=mpi"])
    with pytest.raises(ConfigError, match="data.val_fraction"):
        load_config(None, ["data.val_fraction=1.5"])
    with pytest.raises(ConfigError, match="train.np"):
        load_config(None, ["train.np=0"])
    with pytest.raises(ConfigError, match=r"data.memory_cache_mb': value -1 must be >= 0"):
        load_config(None, ["data.memory_cache_mb=-1"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("train.np")


def test_yaml_file_unknown_key_is_reported(tmp_path):
    (tmp_path / "base.yaml").write_text("data:\n  batch_size: 8\n")
    (tmp_path / "p.yaml").write_text("model:\n  archh: cnn\n")
    with pytest.raises(ConfigError, match="model.archh"):
        load_config(str(tmp_path / "p.yaml"))


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/profile.yaml")


def test_flat_has_dotted_keys():
    flat = load_config(None).flat()
    assert flat["train.early_stopping.monitor"] == "val_loss"
    assert flat["delta.engine"] == "delta-rs"


@pytest.mark.parametrize("key", ["mlflow.gate_metric", "train.early_stopping.monitor"])
def test_gate_and_early_stopping_metrics_must_be_logged_ones(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("conf/local.yaml", [f"{key}=val_f1"])


def test_a_validated_config_is_frozen_and_overrides_make_a_new_one():
    import dataclasses

    from pipeline.config import apply_overrides, load_config

    cfg = load_config(None, ["train.np=-2"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.np = 4  # what a run learns goes into its job, never into the user's config
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = cfg.train
    other = apply_overrides(cfg, {"train.np": 4})
    assert (cfg.train.np, other.train.np) == (-2, 4) and other is not cfg


@pytest.mark.parametrize("text,value", [("1e-4", 1e-4), ("5E-3", 5e-3), ("1.0e-2", 1e-2), ("2.5E+1", 25.0),
                                        ("1e3", 1000.0)])
def test_a_float_with_an_exponent_is_read_on_the_command_line_and_in_yaml(tmp_path, text, value):
    # YAML 1.1 reads 1e-4 (no dot) as a string: the float key must still take it
    cfg = load_config(None, [f"model.lr={text}"])
    assert cfg.model.lr == value and isinstance(cfg.model.lr, float)
    profile = tmp_path / "p.yaml"
    profile.write_text(f"model:\n  lr: {text}\n")
    assert load_config(str(profile)).model.lr == value


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", ".inf", "1e999", "1e-4x", "e-4", "1e"])
def test_a_float_key_refuses_what_is_not_a_finite_number_naming_the_key(text):
    with pytest.raises(ConfigError, match=r"model.lr.*not a (finite )?float"):
        load_config(None, [f"model.lr={text}"])


def test_an_int_key_refuses_an_exponent_naming_the_key():
    with pytest.raises(ConfigError, match="train.max_epochs.*not an int"):
        load_config(None, ["train.max_epochs=1e3"])


@pytest.mark.parametrize("text,value", [("2_5e-1", 2.5), ("+1E-4", 1e-4), (".5e1", 5.0), ("7.", 7.0)])
def test_a_float_key_takes_what_pythons_float_reads(tmp_path, text, value):
    # PyYAML reads these as strings (no dot, or '_' before an exponent) or as floats: either way the key takes them
    assert load_config(None, [f"model.lr={text}"]).model.lr == value
    profile = tmp_path / "p.yaml"
    profile.write_text(f"model:\n  lr: '{text}'\n")  # quoted in a file: still a number for a float key
    assert load_config(str(profile)).model.lr == value


def test_a_float_key_refuses_an_int_too_large_for_a_float_naming_the_key():
    with pytest.raises(ConfigError, match="model.lr.*not a finite float"):
        load_config(None, ["model.lr=1" + "0" * 400])  # YAML reads an int; float() of it overflows


def test_an_int_key_given_a_whole_number_in_float_form_says_how_to_write_it():
    for text in ("1e3", "1000.0"):
        with pytest.raises(ConfigError, match=r"train.max_epochs.*is not an int: write the whole number 1000"):
            load_config(None, [f"train.max_epochs={text}"])
    with pytest.raises(ConfigError, match=r"train.max_epochs.*'1e-3' is not an int$"):
        load_config(None, ["train.max_epochs=1e-3"])
