"""The three notebooks, executed headless in order (nbclient, the venv's Python) against a tmp Delta table and MLflow store."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["01_explore_table.ipynb", "02_train.ipynb", "03_review_registry.ipynb"]
KERNEL = "lakehouse-tests"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory) -> str:
    """A kernelspec for THIS interpreter in a tmp Jupyter path (nothing installed into the venv or ~)."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, display_name="lakehouse tests", prefix=str(prefix))
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(KERNEL)
    assert spec.argv[0] == sys.executable, spec.argv
    yield KERNEL
    mp.undo()


def _outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def test_notebooks_run_in_order(tmp_path, digits_table, kernel_name, monkeypatch):
    import nbformat
    from mlflow import MlflowClient
    from nbclient import NotebookClient

    overrides = [
        f"delta.table={digits_table}",
        f"data.cache_dir={tmp_path}/petastorm_cache",
        f"train.checkpoint_dir={tmp_path}/checkpoints",
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"mlflow.artifact_location={tmp_path}/mlartifacts",
        "mlflow.experiment=notebooks",
        # enough to beat the gate's chance floor (mlflow.gate_min_lift): 1 warm-up epoch stays at chance level
        "train.max_epochs=3", "train.warmup_epochs=0", "data.batch_size=16", "model.lr=0.02",
        "spark.app_name=lakehouse-notebooks",
    ]
    monkeypatch.setenv("LAKEHOUSE_CONF", "conf/local.yaml")
    monkeypatch.setenv("LAKEHOUSE_OVERRIDES", " ".join(overrides))
    monkeypatch.setenv("LAKEHOUSE_PROGRESS", "0")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)

    executed = {}
    for name in NOTEBOOKS:
        nb = nbformat.read(str(ROOT / "notebooks" / name), as_version=4)
        client = NotebookClient(nb, kernel_name=kernel_name, timeout=600, startup_timeout=120,
                                resources={"metadata": {"path": str(ROOT / "notebooks")}})
        try:
            client.execute()  # raises CellExecutionError naming the cell and its traceback
        finally:
            nbformat.write(nb, str(tmp_path / name))  # kept for debugging
        executed[name] = nb

    history = _outputs_text(executed["01_explore_table.ipynb"].cells[next(
        i for i, c in enumerate(executed["01_explore_table.ipynb"].cells) if "table_history" in c.source)])
    assert "CREATE TABLE" in history and "600" in history, history
    grid = [c for c in executed["01_explore_table.ipynb"].cells if "image_grid" in c.source][0]
    assert any("image/png" in out.get("data", {}) for out in grid.outputs), "the image grid was not drawn"

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (version,) = client.search_model_versions("name='lakehouse_classifier'")
    assert version.tags["delta_version"] == "0"
    assert client.get_model_version_by_alias("lakehouse_classifier", "champion").version == version.version
    run = client.get_run(version.run_id)
    assert run.data.tags["world_size"] == "2" and run.data.tags["rank_0_pid"] != run.data.tags["rank_1_pid"]

    review = executed["03_review_registry.ipynb"]
    predicted = [c for c in review.cells if "predict_rows" in c.source][0]
    text = _outputs_text(predicted)
    assert "predicted" in text and "correct" in text, text
