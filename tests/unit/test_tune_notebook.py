"""notebooks/04_tune.ipynb reopens the study with the storage's real URL (`storage_url(cfg)`), not the summary's,
which is redacted: with a password in `tune.storage` the redacted URL cannot connect. The notebook's cell runs here as
written, against a recording stand-in for `optuna.load_study` (no sweep, no database)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import nbformat

from pipeline.config import Config, apply_overrides
from pipeline.redact import redact_url

ROOT = Path(__file__).resolve().parents[2]


def test_the_tune_notebook_reopens_the_study_with_the_real_storage_url(monkeypatch):
    import optuna

    url = "postgresql://tuner:s3cret@db.example:5432/optuna"
    cfg = apply_overrides(Config(), {"tune.storage": url})
    opened = []

    def load_study(study_name, storage):
        opened.append((study_name, storage))
        return SimpleNamespace(trials_dataframe=lambda attrs: None)

    monkeypatch.setattr(optuna, "load_study", load_study)
    nb = nbformat.read(str(ROOT / "notebooks" / "04_tune.ipynb"), as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "load_study" in c.source)
    summary = {"study": "demo-1", "storage": redact_url(url)}  # what run_tune returns: the password hidden
    assert summary["storage"] != url
    exec(compile(cell.source, "04_tune.ipynb", "exec"), {"cfg": cfg, "summary": summary})
    assert opened == [("demo-1", url)]
