"""`lakehouse doctor` in a notebook on a Databricks runtime: a real kernel (nbclient) with DATABRICKS_RUNTIME_VERSION set."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CELL = """from pipeline.config import load_config
from pipeline.doctor import run_doctor
status = run_doctor(load_config("conf/databricks/dbr-17.3-ml.yaml"))
print("doctor status", status)
"""


def test_doctor_in_a_notebook_names_the_target_and_what_the_runtime_lacks(tmp_path, monkeypatch):
    import nbformat
    from ipykernel.kernelspec import install
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    install(kernel_name="lakehouse-doctor", display_name="lakehouse doctor", prefix=str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))
    assert KernelSpecManager().get_kernel_spec("lakehouse-doctor").argv[0] == sys.executable
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")  # what a notebook on a 17.3 LTS ML cluster has
    monkeypatch.setenv("LAKEHOUSE_PROGRESS", "0")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    NotebookClient(nb, kernel_name="lakehouse-doctor", timeout=300, startup_timeout=120,
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    out = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert "Databricks Runtime 17.3: target dbr-17.3-ml (Spark 4.0, Python 3.12" in out, out
    # this kernel is not 17.3's runtime: its Python and pyarrow are named against the target's, with what to do
    import pyarrow

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert (py == "3.12") != (f"runs Python 3.12, this is Python {py}" in out), out
    if pyarrow.__version__ != "19.0.1":
        assert f"pyarrow {pyarrow.__version__} is not the 19.0.1 that constraints-dbr-17.3-ml.txt records" in out, out
        assert "doctor status 1" in out, out
    assert "profile " not in out  # the local install profiles are not what is checked on Databricks
