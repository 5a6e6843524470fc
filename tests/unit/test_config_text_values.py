"""Text keys keep their text: a `key=value` override of a str, Optional[str] or spark.conf key is the text as typed
(YAML would cut `#...`, read 1.10 as 1.1, 1:30:00 as 5400, off as False); numbers, bools and lists stay YAML-typed. In a
YAML file a text key's unquoted value that YAML changed is refused, naming the key and saying to quote it."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override,key,value", [
    ("delta.table=/data/run #2/table", "delta.table", "/data/run #2/table"),
    ("mlflow.experiment=1.10", "mlflow.experiment", "1.10"),
    ("mlflow.experiment=0x10", "mlflow.experiment", "0x10"),
    ("mlflow.experiment=no", "mlflow.experiment", "no"),
    ("mlflow.experiment=2019-01-01", "mlflow.experiment", "2019-01-01"),
    ("tune.study=1:30:00", "tune.study", "1:30:00"),  # Optional[str]; YAML 1.1 reads it as 5400
    ("model.pretrained=/w/a: b.safetensors", "model.pretrained", "/w/a: b.safetensors"),
    ("mlflow.experiment='1.10'", "mlflow.experiment", "1.10"),  # YAML quotes still mean what they mean
])
def test_a_text_key_override_keeps_the_text_as_typed(override, key, value):
    assert load_config(str(ROOT / "conf/local.yaml"), [override]).flat()[key] == value


@pytest.mark.parametrize("override,spark_key,value", [
    ("spark.conf.spark.jars=null", "spark.jars", "null"),
    ("spark.conf.spark.foo=a: b", "spark.foo", "a: b"),
    ("spark.conf.spark.sql.ansi.enabled=off", "spark.sql.ansi.enabled", "off"),
    ("spark.conf.spark.sql.ansi.enabled=true", "spark.sql.ansi.enabled", "true"),
    ("spark.conf.spark.executor.memory=4g", "spark.executor.memory", "4g"),
    ("spark.conf.spark.sql.shuffle.partitions=08", "spark.sql.shuffle.partitions", "08"),
    ("spark.conf.spark.app.name='a b'", "spark.app.name", "a b"),
])
def test_a_spark_conf_override_is_the_text_spark_gets(override, spark_key, value):
    assert load_config(None, [override]).spark.conf == {spark_key: value}


@pytest.mark.parametrize("text", ["null", "~", ""])
def test_an_optional_text_key_is_null_only_for_the_null_words(text):
    cfg = load_config(None, [f"model.pretrained={text}", f"tune.study={text}"])
    assert cfg.model.pretrained is None and cfg.tune.study is None


def test_a_text_key_that_cannot_be_null_refuses_null_naming_the_key():
    with pytest.raises(ConfigError, match=r"mlflow\.tracking_uri.*not a str"):
        load_config(None, ["mlflow.tracking_uri=null"])


def test_numbers_bools_and_lists_are_still_read_as_yaml():
    cfg = load_config(None, ["model.lr=1e-3", "train.early_stopping.enabled=off", "delta.version=3",
                             "model.mean=[0.1, 0.2, 0.3]", "data.batch_size=32", "mlflow.promote=false",
                             "delta.version=null"])
    assert cfg.model.lr == 1e-3 and cfg.train.early_stopping.enabled is False and cfg.delta.version is None
    assert cfg.model.mean == [0.1, 0.2, 0.3] and cfg.data.batch_size == 32 and cfg.mlflow.promote is False
    assert load_config(None, ["data.batch_size=auto"]).data.batch_size == "auto"
    other = apply_overrides(cfg, {"mlflow.experiment": "1.10", "spark.conf": {"spark.jars": "/j.jar"}})
    assert other.mlflow.experiment == "1.10" and other.spark.conf == {"spark.jars": "/j.jar"}


@pytest.mark.parametrize("line,key", [
    ("tune:\n  study: 1:30:00\n", "tune.study"),
    ("mlflow:\n  experiment: 1.10\n", "mlflow.experiment"),
    ("mlflow:\n  experiment: 0x10\n", "mlflow.experiment"),
    ("spark:\n  conf:\n    spark.sql.shuffle.partitions: 0x10\n", "spark.conf.spark.sql.shuffle.partitions"),
])
def test_a_yaml_file_text_key_that_yaml_changed_is_refused_naming_the_key(tmp_path, line, key):
    profile = tmp_path / "p.yaml"
    profile.write_text(line)
    with pytest.raises(ConfigError) as err:
        load_config(str(profile))
    assert f"'{key}'" in str(err.value) and "quote" in str(err.value)


def test_a_yaml_file_text_key_yaml_kept_is_taken(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("tune:\n  study: '1:30:00'\nmlflow:\n  experiment: 123\n"
                       "spark:\n  conf:\n    spark.sql.shuffle.partitions: 8\n"
                       "train:\n  max_epochs: 7\nmodel:\n  lr: 0.5\n")
    cfg = load_config(str(profile))
    assert cfg.tune.study == "1:30:00" and cfg.mlflow.experiment == "123"
    assert cfg.spark.conf == {"spark.sql.shuffle.partitions": "8"}
    assert type(cfg.train.max_epochs) is int and type(cfg.model.lr) is float  # plain values in the config


@pytest.mark.parametrize("profile", sorted(p.name for p in (ROOT / "conf").glob("*.yaml")))
def test_every_shipped_profile_still_loads(profile):
    load_config(str(ROOT / "conf" / profile))
