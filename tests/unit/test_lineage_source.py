"""The run's input dataset records the pinned Delta version, version 0 included (MLflow's own source drops it)."""
import json

import pytest

from pipeline.tracking.lineage import delta_dataset


@pytest.mark.parametrize("version", [0, 3])
def test_dataset_source_names_table_and_version(version):
    entity = delta_dataset("/data/delta/images", version)._to_mlflow_entity()
    assert entity.source_type == "delta_table"
    assert json.loads(entity.source) == {"path": "/data/delta/images", "delta_table_version": version}
    assert entity.name == f"images@v{version}"


class _Client:
    """Stands in for MlflowClient: log_inputs fails with `errors` in turn, then succeeds."""

    def __init__(self, *errors):
        self.errors, self.calls = list(errors), 0

    def log_batch(self, run_id, tags, synchronous):
        pass

    def log_inputs(self, run_id, datasets):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def test_lineage_asks_again_when_another_run_inserted_the_same_dataset_first():
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.lineage import log_lineage

    race = MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, datasets.name")
    client = _Client(race)
    log_lineage(client, "run", "/data/delta/images", 0, {"train": 8})
    assert client.calls == 2
    with pytest.raises(MlflowException, match="IntegrityError"):
        log_lineage(_Client(race, race, race), "run", "/data/delta/images", 0, {"train": 8})


def test_lineage_does_not_retry_other_errors():
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.lineage import log_lineage

    client = _Client(MlflowException("RESOURCE_DOES_NOT_EXIST: run 'run' not found"))
    with pytest.raises(MlflowException, match="not found"):
        log_lineage(client, "run", "/data/delta/images", 0, {"train": 8})
    assert client.calls == 1
