"""What a user got wrong is a configuration error, exit status 2 (README, docs/operations.md "Exit status"), named as
the user gave it: a Delta table or version that is not there (it was a DeltaError, exit 1, and predict named the
config keys for its --table and --version), and a `model.arch` whose library is not installed (it failed in both ranks
after the data was prepared, with a FAILED MLflow run; now the driver refuses it before any run opens or rank starts,
looking the packages up without importing them)."""
import importlib.util
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pyarrow as pa
import pytest
from deltalake import write_deltalake

import pipeline.serving.models as models
import pipeline.serving.predict as predict
import pipeline.tracking.runs as runs
from conftest import ROOT, cli, make_config
from pipeline.config import ConfigError
from pipeline.lakehouse.delta import DeltaError, DeltaRsEngine


@pytest.fixture()
def table(tmp_path):
    """A one-commit Delta table (version 0), written by delta-rs."""
    path = tmp_path / "delta" / "digits"
    write_deltalake(str(path), pa.table({"path": ["/img/0.png", "/img/1.png"], "label": ["zero", "one"]}))
    return path


def test_a_missing_table_or_version_is_a_config_error_and_still_a_delta_error(tmp_path, table):
    engine = DeltaRsEngine()
    with pytest.raises(ConfigError, match=rf"Delta table {tmp_path}/nope does not exist \(config key 'delta.table'\)"):
        engine.pin(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"has no version 5 \(config key 'delta.version'\); versions run from 0 to 0"):
        engine.pin(str(table), 5)
    with pytest.raises(DeltaError, match="no version 5"):  # what the callers that catch a DeltaError still catch
        engine.pin(str(table), 5)


def test_the_error_survives_pickling_and_is_renamed_for_options():
    from pipeline.lakehouse.delta import NoSuchTableError

    exc = NoSuchTableError("/t", 5, 0)
    back = pickle.loads(pickle.dumps(exc))
    assert str(back) == str(exc) and (back.table, back.version, back.latest) == ("/t", 5, 0)
    renamed = exc.named_by("--table", "--version", table="t")
    assert str(renamed) == "Delta table t has no version 5 (--version); versions run from 0 to 0"
    assert isinstance(renamed, ConfigError) and isinstance(renamed, DeltaError)


@pytest.fixture()
def predict_on(monkeypatch):
    """predict_table up to its read of the input table: the registry and MLflow are stand-ins, the engine delta-rs."""
    monkeypatch.setattr(runs, "configure", lambda _cfg: object())
    monkeypatch.setattr(models, "resolve", lambda _client, _uri: SimpleNamespace(name="clf", version="3"))

    def run(table, version=None):
        cfg = SimpleNamespace(mlflow=None, delta=SimpleNamespace(engine="delta-rs", table="/the/config/table",
                                                                  version=None))
        return predict.predict_table(None, cfg, "models:/clf@champion", table, f"{table}-out", version)
    return run


def test_predict_names_its_table_and_version_options_not_the_config_keys(tmp_path, table, predict_on):
    with pytest.raises(ConfigError) as err:
        predict_on(str(tmp_path / "nope"))
    assert str(err.value) == f"Delta table {tmp_path}/nope does not exist (--table)"
    with pytest.raises(ConfigError) as err:
        predict_on(str(table), 5)
    assert str(err.value) == f"Delta table {table} has no version 5 (--version); versions run from 0 to 0"
    assert "config key" not in str(err.value)


def _train_args(tmp_path, *overrides):
    """`lakehouse train`'s arguments with every path under `tmp_path`."""
    return ["train", "--conf", str(ROOT / "conf/local.yaml"), f"data.cache_dir={tmp_path}/cache",
            f"train.checkpoint_dir={tmp_path}/ckpt", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            f"mlflow.artifact_location={tmp_path}/art", "data.reader=arrow", *overrides]


def test_train_exits_2_on_a_table_or_version_that_is_not_there(tmp_path, table, monkeypatch, caplog):
    from pipeline import cli as lakehouse

    # in this process, MLflow a stand-in: the table is pinned after MLflow is reached, whose SQLite store takes
    # seconds to set up; early_start off: the ranks it starts would only be stopped again
    monkeypatch.setattr(runs, "configure", lambda _cfg: object())
    rc = lakehouse.main(_train_args(tmp_path, f"delta.table={tmp_path}/nope", "train.early_start=false"))
    assert rc == 2 and f"Delta table {tmp_path}/nope does not exist (config key 'delta.table')" in caplog.text
    caplog.clear()
    rc = lakehouse.main(_train_args(tmp_path, f"delta.table={table}", "delta.version=5", "train.early_start=false"))
    assert rc == 2 and "has no version 5 (config key 'delta.version'); versions run from 0 to 0" in caplog.text


def _without_timm(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else find_spec(name, *a))


def test_a_timm_arch_without_timm_is_refused_before_the_run_opens_or_a_rank_starts(tmp_path, monkeypatch):
    import pipeline.workflow as workflow

    _without_timm(monkeypatch)

    def opened(*_a, **_k):
        raise AssertionError("MLflow was reached or a rank started before the arch was checked")

    monkeypatch.setattr(runs, "configure", opened)
    monkeypatch.setattr(workflow, "ranks_started_early", opened)
    cfg = make_config(tmp_path, "model.arch=timm/resnet18")
    with pytest.raises(ConfigError, match=r"config key 'model.arch': 'timm/resnet18' needs the timm package.*not "
                                          r"installed.*pip install timm"):
        workflow.train(None, cfg)
    # the project's own networks need nothing more, and ranks on a cluster's executors with no gate on this machine
    # are not refused for this machine's install
    workflow.require_model_arch(make_config(tmp_path, "model.arch=cnn"))
    workflow.require_model_arch(make_config(tmp_path, "model.arch=timm/resnet18", "train.np=2",
                                            "mlflow.promote=false"))


def test_the_arch_check_imports_neither_torch_nor_timm():
    code = ("from pipeline.model.arch_packages import missing_packages\nmissing_packages('timm/resnet18')\n"
            "import sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    assert not loaded & {"torch", "timm", "torchvision"}


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed here (the vision venv)")
def test_train_exits_2_naming_the_arch_before_any_run_or_rank(tmp_path, table):
    # the whole command, in its own process: the exit status as a shell sees it
    env = {**os.environ, "LAKEHOUSE_PROGRESS": "0"}
    env.pop("LAKEHOUSE_DEBUG", None)
    out = subprocess.run(cli(*_train_args(tmp_path, f"delta.table={table}", "model.arch=timm/resnet18")), cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    rc, err = out.returncode, out.stderr
    assert rc == 2, err
    assert "config key 'model.arch': 'timm/resnet18' needs the timm package" in err
    assert not (tmp_path / "mlflow.db").exists()  # MLflow never reached: no run opened, none left FAILED
    assert "Process 0" not in err and "[0]<stderr>" not in err  # no rank started
