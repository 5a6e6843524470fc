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
