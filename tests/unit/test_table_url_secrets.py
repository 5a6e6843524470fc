"""A Delta table given by a URL with credentials (s3a://KEY:SECRET@bucket/...) is recorded without the secret
everywhere it is written outward (a real SQLite MLflow store): the run's delta_table tag and dataset source, the
registered version's tag and description, the train summary and a run left offline; the gate still reads the table
through the config's `delta.table`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from pipeline.config import Config, apply_overrides

SECRET = "wJalrSECRET"
TABLE = f"s3a://AKIAEXAMPLE:{SECRET}@bucket/tables/digits"
SHOWN = "s3a://AKIAEXAMPLE:***@bucket/tables/digits"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('table_secrets')}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return client, client.create_experiment("secrets")


def test_the_runs_lineage_keeps_no_secret_of_the_table_url(store):
    from pipeline.tracking.lineage import log_lineage

    client, exp = store
    run_id = client.create_run(exp).info.run_id
    log_lineage(client, run_id, TABLE, 3, {"train": 8, "val": 2}, extra_tags={"source": TABLE})
    run = client.get_run(run_id)
    assert run.data.tags["delta_table"] == SHOWN and run.data.tags["source"] == SHOWN
    dataset = run.inputs.dataset_inputs[0].dataset
    assert SECRET not in f"{dataset.source} {dataset.name} {dataset.digest}" and SHOWN in dataset.source
    assert '"delta_table_version": 3' in dataset.source


def test_the_registered_version_and_the_train_summary_keep_no_secret_of_the_table_url(store):
    import pipeline.workflow as workflow
    from pipeline.lakehouse.delta import PinnedTable

    client, exp = store
    run_id = client.create_run(exp).info.run_id
    cfg = apply_overrides(Config(), {"delta.table": TABLE, "mlflow.registered_model": "secret_table"})
    pinned = PinnedTable(table=TABLE, version=3, num_files=1, num_rows=10)
    version = workflow.register_version(client, cfg, "/tmp/no-model", run_id, pinned, {"val_acc": 0.5})
    mv = client.get_model_version("secret_table", version)
    assert mv.tags["delta_table"] == SHOWN and SECRET not in str(mv.tags)
    assert SECRET not in (mv.description or "") and SHOWN in mv.description

    run = SimpleNamespace(run_id=run_id, tracking_uri="sqlite:///x.db")
    r0 = SimpleNamespace(world_size=1, metrics={"val_acc": 0.5}, epochs=1, batch_size=4, stopped_early=False)
    summary = workflow.run_summary(run, cfg, pinned, (8, 2), r0, {}, int(version), None)
    assert summary["delta_table"] == SHOWN


def test_a_run_left_offline_keeps_no_secret_of_the_table_url(tmp_path):
    from pipeline.tracking.offline import OfflineRun, record_job

    cfg = apply_overrides(Config(), {"delta.table": TABLE})
    off = OfflineRun(str(tmp_path / "offline_run"))
    run = SimpleNamespace(run_id="r1", experiment_id="1", tracking_uri="sqlite:///x.db")
    r0 = SimpleNamespace(metrics={"val_acc": 0.5}, epochs=1, stopped_early=False)
    record_job(off, run, cfg, SimpleNamespace(table=TABLE, version=3), {"train": 8, "val": 2}, {}, r0)
    texts = [p.read_text() for p in (tmp_path / "offline_run").rglob("*") if p.is_file()]
    assert texts and not [t for t in texts if SECRET in t]
    assert off.read()["lineage"]["table"] == SHOWN


def test_the_gate_reads_a_version_recorded_redacted_through_the_configs_table():
    from pipeline.tracking.gate import _with_credentials

    assert _with_credentials(SHOWN, ["work/delta/other", TABLE + "/"]) == TABLE
    assert _with_credentials(SHOWN, ["s3a://AKIAEXAMPLE:other@bucket/tables/digits2"]) == SHOWN  # not that table
    assert _with_credentials("/data/t", [TABLE]) == "/data/t"  # nothing redacted: as recorded


def test_an_azure_container_is_not_taken_for_a_token():
    from pipeline.redact import redact_url

    url = "abfss://images@acct.dfs.core.windows.net/tables/digits?sv=2021&sig=SIG"
    assert redact_url(url) == "abfss://images@acct.dfs.core.windows.net/tables/digits?sv=2021&sig=***"
    assert redact_url("wasbs://c:KEY@acct.blob.core.windows.net/t") == "wasbs://c:***@acct.blob.core.windows.net/t"
    assert redact_url("https://TOKEN@github.com/o/r") == "https://***@github.com/o/r"
