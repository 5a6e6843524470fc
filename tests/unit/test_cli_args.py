"""The `lakehouse` command line as a user types it: `key=value` overrides anywhere after the command (the demo's
summary too); `promote --version` a number the model has, else a usage error naming its versions; `bench --help`
naming every measurement `--only` accepts; `sample-data` refusing options its `--kind` does not take and saying when
`--limit` asked for more than it wrote; `cache --conf F ls` as well as `cache ls --conf F`; and a refused `sync-run`
of a folder that is not a run left offline leaving no lock file in it. Each runs the real parser and functions, in
this process (no Spark, no MLflow server)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf" / "local.yaml")


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _usage_error(capsys, argv) -> str:
    """The stderr of `lakehouse ARGV`, which must end as argparse ends a usage error: exit status 2."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    return capsys.readouterr().err


# -- 1. overrides anywhere after the command ---------------------------------------------------------------------------

def test_overrides_typed_after_an_option_are_taken_in_order(tmp_path, capsys):
    first, last = tmp_path / "first", tmp_path / "last"
    assert main(["cache", "ls", f"data.cache_dir={first}", "--conf", CONF, f"data.cache_dir={last}"]) == 0
    assert _last_json(capsys.readouterr().out)["cache_dir"] == str(last)  # the last of a key wins, as in one block


def test_overrides_between_options_reach_tune_and_doctor_too():
    from pipeline.cli import parse_args  # local: the function under test, added with the fix

    args = parse_args(["tune", "delta.table=/t", "--space", "s.yaml", "--trials", "1", "tune.metric=val_acc"])
    assert (args.space, args.trials, args.overrides) == ("s.yaml", 1, ["delta.table=/t", "tune.metric=val_acc"])
    args = parse_args(["doctor", "train.np=1", "--conf", "C", "train.max_epochs=2"])
    assert (args.conf, args.overrides) == ("C", ["train.np=1", "train.max_epochs=2"])


def test_an_unknown_option_is_still_refused_naming_it(capsys):
    err = _usage_error(capsys, ["doctor", "train.np=1", "--conf", CONF, "--bogus", "train.max_epochs=2"])
    assert "lakehouse doctor: error: unrecognized arguments: --bogus" in err
    err = _usage_error(capsys, ["sample-data", "--limit", "2", "train.np=1"])  # takes no overrides
    assert "lakehouse sample-data: error: unrecognized arguments: train.np=1" in err


def test_the_demo_summary_takes_overrides_after_its_options(tmp_path, monkeypatch, capsys):
    import mlflow.tracking

    from pipeline import summary

    seen = []

    class Client:  # the registry the summary asks for the champion: none here
        def __init__(self, uri):
            seen.append(uri)

        def get_model_version_by_alias(self, name, alias):
            raise RuntimeError("no registry in this test")

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Client)
    out = tmp_path / "last_train.json"
    out.write_text("training...\n" + json.dumps({"run_id": "r1", "model_name": "m", "model_version": 1}) + "\n")
    uri = f"sqlite:///{tmp_path}/given.db"
    assert summary.main([str(out), "--conf", CONF, "train.max_epochs=2", f"mlflow.tracking_uri={uri}"]) == 0
    assert seen == [uri] and f"--backend-store-uri {uri}" in capsys.readouterr().out


def test_demo_sh_gives_the_summary_its_options_first():
    """Its overrides ("$@") then follow the file as one block, which any argparse reads."""
    line = [x for x in (ROOT / "scripts" / "demo.sh").read_text().splitlines() if "pipeline.summary" in x]
    assert line == ['.venv/bin/python -m pipeline.summary --conf "$CONF" work/last_train.json "$@"']


# -- 2. promote --version ----------------------------------------------------------------------------------------------

class _Registry:
    """The two registry calls `promote` makes before the gate, on a model holding `versions`."""

    def __init__(self, versions):
        self.versions = [str(v) for v in versions]

    def get_model_version(self, name, version):
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

        if version not in self.versions:
            raise MlflowException(f"Model Version (name={name}, version={version}) not found",
                                  error_code=RESOURCE_DOES_NOT_EXIST)
        return SimpleNamespace(name=name, version=version)

    def search_model_versions(self, *args, **kwargs):
        return [SimpleNamespace(name="lakehouse_classifier", version=v) for v in self.versions]


@pytest.fixture()
def registry(monkeypatch):
    """`promote` against a registry of versions 1-4 and 7; the gate records what it was asked to judge."""
    import pipeline.tracking.runs as runs
    import pipeline.workflow as workflow

    gated = []
    monkeypatch.setattr(runs, "configure", lambda cfg_mlflow: _Registry([1, 2, 3, 4, 7]))
    monkeypatch.setattr(workflow, "gate", lambda client, cfg, version: gated.append(version) or
                        SimpleNamespace(promoted=False, version=version))
    return gated


def test_promote_refuses_a_version_the_model_does_not_have_naming_its_versions(registry, caplog):
    from pipeline.config import Config, ConfigError
    from pipeline.workflow import promote_version

    with pytest.raises(ConfigError, match=r"model 'lakehouse_classifier' has no version 99; its versions: 1-4, 7"):
        promote_version(Config(), 99)
    assert registry == []  # never gated: the gate would call it a failed registry call to retry
    assert main(["promote", "--version", "99", "--conf", CONF]) == 2  # a usage / configuration error
    assert "has no version 99; its versions: 1-4, 7" in caplog.text  # the CLI's log, wherever its handler writes
    assert promote_version(Config(), 3) == {"promoted": False, "version": "3"} and registry == ["3"]


def test_promote_version_must_be_a_number(capsys):
    err = _usage_error(capsys, ["promote", "--version", "abc", "--conf", CONF])
    assert "argument --version: invalid int value: 'abc'" in err


def test_number_ranges():
    from pipeline.workflow import number_ranges

    assert number_ranges([1, 2, 3, 4]) == "1-4"
    assert number_ranges([1, 2, 3, 4, 7, 9, 10]) == "1-4, 7, 9-10"
    assert number_ranges([5]) == "5"


# -- 3. bench --help ---------------------------------------------------------------------------------------------------

def test_bench_help_names_every_measurement_only_accepts(capsys):
    from bench import MEASUREMENTS, STANDALONE
    from bench.gpu import GPU_PARTS

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    only = text[text.index("--only M[,M...] run only these measurements"):text.index("--gpu the GPU")]
    listed = re.search(r"measurements \(([^)]*)\)", only).group(1).split(", ")
    assert listed == list(MEASUREMENTS)  # split_digest among them
    unless = re.search(r"unless only (.*) are asked for", only).group(1).replace(" or ", ", ").split(", ")
    assert unless == list(STANDALONE)
    assert only.rstrip().endswith(f"With --gpu: {', '.join(GPU_PARTS)}")


# -- 4. sample-data ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, said", [
    (["--kind", "photos", "--count", "2", "--size", "64"], "--size applies to --kind digits only, not --kind photos"),
    (["--kind", "digits", "--limit", "2", "--classes", "3"], "--classes applies to --kind photos only, not --kind "
                                                            "digits"),
    (["--limit", "2", "--seed", "4"], "--seed applies to --kind photos only, not --kind digits"),
    (["--count", "0"], "argument --limit/--count: must be at least 1, not 0"),
    (["--kind", "photos", "--count", "2", "--classes", "0"], "argument --classes: must be at least 1, not 0"),
    (["--kind", "photos", "--count", "2", "--classes", "9"], "--classes 9: between 1 and 5"),
])
def test_sample_data_refuses_options_its_kind_does_not_take(tmp_path, capsys, argv, said):
    out = tmp_path / "out"
    err = _usage_error(capsys, ["sample-data", *argv, "--out", str(out)])
    assert f"lakehouse sample-data: error: {said}" in err
    assert not out.exists()  # nothing written


def test_sample_data_says_when_limit_is_more_than_the_digits_it_wrote(tmp_path, monkeypatch, caplog):
    import sklearn.datasets

    from pipeline.lakehouse.sample_data import render_sample

    few = SimpleNamespace(images=np.full((5, 8, 8), 8.0), target=np.arange(5))  # scikit-learn's 1,797, shortened
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda: few)
    with caplog.at_level("WARNING"):
        _, counts = render_sample("digits", str(tmp_path / "d"), 5000)
    assert sum(counts.values()) == 5
    assert "5000 images asked for: scikit-learn's digits are 5 images; wrote all 5 of them" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        render_sample("digits", str(tmp_path / "d"), 5)
    assert "--limit" not in caplog.text


def test_the_library_refuses_an_option_of_the_other_kind_too(tmp_path):
    from pipeline.lakehouse.sample_data import SampleOptionError, render_sample

    with pytest.raises(SampleOptionError, match="--size applies to --kind digits only"):
        render_sample("photos", str(tmp_path / "p"), 2, size=64)
    assert not (tmp_path / "p").exists()


# -- 5. cache --conf ---------------------------------------------------------------------------------------------------

def test_cache_takes_conf_before_the_action_and_after_it(tmp_path, capsys):
    conf = tmp_path / "conf.yaml"
    conf.write_text(f"data:\n  cache_dir: {tmp_path / 'from_conf'}\n")
    assert main(["cache", "--conf", str(conf), "ls"]) == 0
    assert _last_json(capsys.readouterr().out)["cache_dir"] == str(tmp_path / "from_conf")
    assert main(["cache", "ls", "--conf", str(conf)]) == 0
    assert _last_json(capsys.readouterr().out)["cache_dir"] == str(tmp_path / "from_conf")
    assert main(["cache", "--conf", str(conf), "clear", "--force", f"data.cache_dir={tmp_path / 'o'}"]) == 0
    assert _last_json(capsys.readouterr().out)["cache_dir"] == str(tmp_path / "o")


def test_cache_help_names_conf_and_the_actions_options(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cache", "--help"])
    text = capsys.readouterr().out
    assert all(option in text for option in ("--conf", "--key", "--force")), text


# -- 6. sync-run of a folder that is not a run -------------------------------------------------------------------------

def test_sync_run_of_another_folder_is_refused_leaving_no_lock_file(tmp_path):
    from pipeline.tracking.offline import SYNC_LOCK, SyncError, sync_lock
    from pipeline.workflow import sync_run

    folder = tmp_path / "not_a_run"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(SyncError, match="is not a run left offline"):
        sync_run(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    for name in ("run.json", "config.yaml", "model/network.pt"):  # a run left offline is still locked
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text("{}")
    with sync_lock(str(folder)):
        assert (folder / SYNC_LOCK).exists()


def test_an_ingest_source_that_is_not_a_folder_is_refused_before_any_spark_session(tmp_path, monkeypatch, caplog):
    """`lakehouse ingest --source <missing>` said so only after the JVM started (~15 s here)."""
    from pipeline import cli

    def no_session(cfg):
        raise AssertionError("a Spark session was asked for")

    monkeypatch.setattr(cli, "spark_session", no_session)
    rc = cli.main(["ingest", "--source", str(tmp_path / "missing"), "--conf", str(ROOT / "conf/local.yaml")])
    assert rc == 1
    assert f"ingest source {tmp_path / 'missing'} is not a folder" in caplog.text
