"""load_pyfunc from several threads: MLflow hands a models-from-code model over through a module global, so loads
in one process must not overlap (two promotion gates in one process once scored two versions with one network)."""
from __future__ import annotations

import sys
import threading
import time

import mlflow.pyfunc

from pipeline.tracking import pyfunc


def test_loads_never_overlap_and_each_thread_gets_its_own_model(monkeypatch):
    inside, most, got = [0], [0], {}
    guard = threading.Lock()
    handed_over = {}  # stands in for mlflow.models.model.__mlflow_model__

    def fake_load_model(uri, suppress_warnings=False):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        handed_over["model"] = uri  # set_model() in the model's code file
        sys.path.insert(0, f"/tmp/code-of-{uri}")  # MLflow prepends the model's code folder
        time.sleep(0.05)
        model = handed_over["model"]  # what load_model returns: the global, as it is now
        with guard:
            inside[0] -= 1
        return model

    monkeypatch.setattr(mlflow.pyfunc, "load_model", fake_load_model)
    path_before = list(sys.path)
    threads = [threading.Thread(target=lambda u=u: got.__setitem__(u, pyfunc.load_pyfunc(u)))
               for u in ("models:/m/1", "models:/m/2", "models:/m/3", "models:/m/4")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    assert got == {u: u for u in got} and len(got) == 4
    assert sys.path == path_before
