"""One source of defaults: conf/base.yaml and docs/configuration.md are generated from the config dataclasses."""
import yaml

from pipeline import config_docs
from pipeline.config import Config, load_config


def test_generated_files_match_the_code():
    assert config_docs.main(["--check"]) == 0, "run `python -m pipeline.config_docs` and commit the result"


def test_base_yaml_holds_every_key_with_the_code_default():
    data = yaml.safe_load(config_docs.BASE_YAML.read_text())
    assert load_config(str(config_docs.BASE_YAML)) == Config()
    flat_code = Config().flat()

    def walk(prefix, node, out):
        for key, value in node.items():
            dotted = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict) and key != "conf":
                walk(dotted, value, out)
            else:
                out[dotted] = value
        return out

    assert walk("", data, {}) == flat_code


def test_config_in_python_equals_a_cli_run_without_overrides():
    """What a notebook's Config() trains with is what `lakehouse train --conf conf/base.yaml` trains with: the params
    each would log are the same."""
    assert load_config(str(config_docs.BASE_YAML)).flat() == Config().flat()
    assert load_config(None).flat() == Config().flat()


def test_every_key_is_documented_with_its_default():
    text = config_docs.CONFIG_MD.read_text()
    for key, value in Config().flat().items():
        assert f"| `{key}` | `{config_docs._scalar(value)}` |" in text, key


def test_a_drifted_file_fails_the_check(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "base.yaml"
    stale.write_text(config_docs.base_yaml().replace("weight_decay: 0.0001", "weight_decay: 0.0"))
    monkeypatch.setattr(config_docs, "BASE_YAML", stale)
    monkeypatch.setattr(config_docs, "ROOT", tmp_path.parent)
    assert config_docs.main(["--check"]) == 1
    assert "base.yaml drifted" in capsys.readouterr().err



def test_spark_conf_overrides_add_up():
    cfg = load_config(str(config_docs.BASE_YAML), ["spark.conf.spark.a=1", "spark.conf.spark.b.c=2"])
    assert cfg.spark.conf == {"spark.a": "1", "spark.b.c": "2"}
