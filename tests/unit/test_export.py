"""`lakehouse export`: ONNX with external data, nothing left in --out by a failed export, failures named."""
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pipeline.serving.export as ex
from pipeline.model.nets import build_network
from pipeline.serving.contract import CONTRACT_FILE

WIDTH = 64  # SmallCNN at width 64: ~1.5 MB of weights, over the 1 MB limit the tests set
META = {"arch": "cnn", "width": WIDTH, "channels": 1, "image_size": 16, "class_names": ["a", "b", "c"]}


def _net(width=WIDTH):
    torch.manual_seed(0)
    return build_network("cnn", 1, 3, width=width).eval()


class _Client:
    """An MLflow client that logs artifacts into a folder (runs/<run>/<artifact path>/) and keeps version tags."""

    def __init__(self, root: Path):
        self.root, self.tags = root, {}

    def log_artifact(self, run_id, local_path, artifact_path=None):
        dest = self.root / run_id / (artifact_path or "")
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(local_path, dest)

    def set_model_version_tag(self, name, version, key, value):
        self.tags[(name, version, key)] = value


def _export_model(monkeypatch, tmp_path, net, fmt, out):
    client = _Client(tmp_path / "runs")
    pinned = SimpleNamespace(name="clf", version="3", run_id="run1")
    monkeypatch.setattr(ex, "configure", lambda _mlflow: client)
    monkeypatch.setattr(ex, "resolve", lambda _client, _uri: pinned)
    monkeypatch.setattr(ex, "load_network", lambda _pinned: (net, dict(META)))
    result = ex.export_model(SimpleNamespace(mlflow=None), "models:/clf/3", fmt, str(out) if out else None)
    return result, client


def _torch_writes_a_file_per_weight(monkeypatch):
    """torch.onnx.export as torch writes a model over 2 GB: model.onnx plus one external file per weight beside it."""
    import onnx

    real = torch.onnx.export

    def export(module, args, f, **kw):
        real(module, args, f, **kw)
        model = onnx.load(f)
        onnx.save_model(model, f, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)

    monkeypatch.setattr(torch.onnx, "export", export)


@pytest.mark.parametrize("torch_external", [False, True], ids=["inline", "torch-external"])
@pytest.mark.parametrize("to_out", [True, False], ids=["out", "no-out"])
def test_onnx_over_the_size_limit_keeps_its_weights_in_one_data_file_logged_beside_it(monkeypatch, tmp_path,
                                                                                        torch_external, to_out):
    import onnx
    import onnxruntime as ort

    monkeypatch.setattr(ex, "ONNX_INLINE_LIMIT", 2 ** 20)
    if torch_external:
        _torch_writes_a_file_per_weight(monkeypatch)
    net, out = _net(), tmp_path / "out"
    result, client = _export_model(monkeypatch, tmp_path, net, "onnx", out if to_out else None)
    expected_files = {"model.onnx", ex.ONNX_DATA_FILE, CONTRACT_FILE}
    logged = client.root / "run1" / "export" / "onnx"
    assert set(os.listdir(logged)) == expected_files
    assert client.tags[("clf", "3", "export_onnx")] == "runs:/run1/export/onnx"
    assert sorted(result["files"]) == sorted(expected_files)
    folders = [logged, out] if to_out else [logged]
    if to_out:
        assert set(os.listdir(out)) == expected_files
        assert set(os.listdir(tmp_path)) == {"out", "runs"}  # no staging folder or torch's weight files left beside
    x = ex._probe(META, 5).numpy()
    with torch.no_grad():
        expected = torch.softmax(net(torch.from_numpy(x)), 1).numpy()
    for folder in folders:
        model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        assert (folder / "model.onnx").stat().st_size < 2 ** 20 < (folder / ex.ONNX_DATA_FILE).stat().st_size
        assert (folder / ex.ONNX_DATA_FILE).stat().st_mode == (folder / "model.onnx").stat().st_mode
        places = {d.value for t in model.graph.initializer for d in t.external_data if d.key == "location"}
        assert places == {ex.ONNX_DATA_FILE}
        assert "preprocessing_contract" in {p.key for p in model.metadata_props}
        onnx.checker.check_model(str(folder / "model.onnx"))
        session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        got = session.run([ex.OUTPUT_NAME], {ex.INPUT_NAME: x})[0]
        assert float(np.abs(got - expected).max()) <= ex.PARITY_TOL


def test_a_small_onnx_model_stays_one_file_and_drops_an_earlier_exports_data_file(monkeypatch, tmp_path):
    out = tmp_path / "out"
    monkeypatch.setattr(ex, "ONNX_INLINE_LIMIT", 2 ** 20)
    ex.export_network(_net(), META, "onnx", out)
    assert (out / ex.ONNX_DATA_FILE).is_file()
    monkeypatch.undo()
    result = ex.export_network(_net(width=4), {**META, "width": 4}, "onnx", out)
    assert result["files"] == ["model.onnx", CONTRACT_FILE]
    assert set(os.listdir(out)) == {"model.onnx", CONTRACT_FILE}
    assert ex.run_exported("onnx", out / "model.onnx", ex._probe(META, 2).numpy()).shape == (2, 3)


def _listing(folder: Path):
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else None


@pytest.mark.parametrize("fmt", ex.FORMATS)
def test_a_failed_parity_check_leaves_out_as_it_was(monkeypatch, tmp_path, fmt):
    fresh, earlier = tmp_path / "fresh", tmp_path / "earlier"
    ex.export_network(_net(width=4), {**META, "width": 4}, fmt, earlier)
    before = _listing(earlier)
    monkeypatch.setattr(ex, "PARITY_TOL", -1.0)  # stand-in for any parity failure
    errors = []
    for out in (fresh, earlier):
        with pytest.raises(ex.ExportError) as info:
            ex.export_network(_net(), META, fmt, out, {"name": "clf", "version": "3"})
        errors.append(str(info.value))
    assert not fresh.exists()
    assert _listing(earlier) == before
    assert set(os.listdir(tmp_path)) == {"earlier"}  # no staging folder left beside --out
    for error in errors:
        assert error.startswith(f"{fmt} export of model 'clf' version 3: probabilities differ"), error
        assert "on probe inputs; nothing written to " in error and error.endswith(", not logged"), error


def test_an_exporter_failure_is_an_export_error_naming_the_model_and_leaves_nothing(monkeypatch, tmp_path):
    def broken(*_a, **_kw):
        raise RuntimeError("protobuf: message too large")

    monkeypatch.setattr(torch.onnx, "export", broken)
    out = tmp_path / "out"
    with pytest.raises(ex.ExportError, match=r"onnx export of model 'clf' version 3 failed \(RuntimeError: protobuf"):
        ex.export_network(_net(width=4), {**META, "width": 4}, "onnx", out, {"name": "clf", "version": "3"})
    assert os.listdir(tmp_path) == []


def test_the_export_is_staged_inside_out_so_only_out_must_be_writable(monkeypatch, tmp_path):
    """A volume's root or a mount point as --out: its parent may be read-only, and a rename from the parent into a
    mount point crosses file systems; the staging folder is inside --out, on its file system."""
    made = []
    real = ex.tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(Path(kwargs["dir"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ex.tempfile, "mkdtemp", recording)
    out = tmp_path / "volume"
    out.mkdir()
    ex.export_network(_net(width=4), {**META, "width": 4}, "torchscript", out)
    assert made == [out.resolve()]
    assert set(os.listdir(out)) == {"model.pt", CONTRACT_FILE}  # the staging folder gone


def _onnx_version(path: Path) -> str:
    """The model version recorded in an ONNX file's own contract (its metadata `preprocessing_contract`)."""
    import json

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    return json.loads(props["preprocessing_contract"])["model"]["version"]


def test_an_export_logs_its_own_files_while_another_export_writes_the_same_out(monkeypatch, tmp_path):
    """Export A logged its files from the shared --out after moving them there: an export B into the same --out in
    between made run A log B's model.onnx and contract.json. A logs from its private staging folder now."""
    import json

    out = tmp_path / "out"
    client = _Client(tmp_path / "runs")
    real_log = client.log_artifact
    other = []

    def log_artifact(run_id, local_path, artifact_path=None):
        if not other:  # B runs to the end while A logs its first file
            other.append(ex.export_network(_net(width=8), {**META, "width": 8}, "onnx", out,
                                           {"name": "clf", "version": "7"}))
        real_log(run_id, local_path, artifact_path)

    client.log_artifact = log_artifact
    pinned = SimpleNamespace(name="clf", version="3", run_id="run1")
    monkeypatch.setattr(ex, "configure", lambda _mlflow: client)
    monkeypatch.setattr(ex, "resolve", lambda _client, _uri: pinned)
    monkeypatch.setattr(ex, "load_network", lambda _pinned: (_net(width=4), {**META, "width": 4}))
    result = ex.export_model(SimpleNamespace(mlflow=None), "models:/clf/3", "onnx", str(out))
    logged = client.root / "run1" / "export" / "onnx"
    assert other and result["model_version"] == "3"
    assert _onnx_version(logged / "model.onnx") == "3", "run A logged export B's model.onnx"
    assert json.loads((logged / CONTRACT_FILE).read_text())["model"]["version"] == "3"
    # --out holds one export's files, both of them of the same export
    assert _onnx_version(out / "model.onnx") == json.loads((out / CONTRACT_FILE).read_text())["model"]["version"]
    assert set(os.listdir(out)) == {"model.onnx", CONTRACT_FILE}


def test_exports_into_one_out_at_once_leave_one_exports_files_never_a_mix(monkeypatch, tmp_path):
    """Each export moves its files in one rename per file; two at once interleaved their moves (A's model.onnx, then
    all of B's, then A's contract.json: B's model under A's contract). The moves hold --out's lock now."""
    import json
    import threading

    out = tmp_path / "out"
    real_replace = os.replace
    state = {"started": False}
    threads = []
    b_waits = threading.Event()

    def sleep(seconds):  # the export module's only sleep: B waiting for A's lock
        if threading.current_thread() is not threading.main_thread():
            b_waits.set()
        time.sleep(seconds)

    def replace(src, dst):
        real_replace(src, dst)
        if not state["started"] and threading.current_thread() is threading.main_thread():
            state["started"] = True  # A has moved its first file: B starts its whole export now
            t = threading.Thread(target=lambda: state.setdefault("b", ex.export_network(
                _net(width=8), {**META, "width": 8}, "onnx", out, {"name": "clf", "version": "7"})))
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 120
            while t.is_alive() and not b_waits.is_set() and time.monotonic() < deadline:
                t.join(0.05)  # B moved all its files (nothing stopped it), or waits for A's lock

    monkeypatch.setattr(ex, "time", SimpleNamespace(monotonic=time.monotonic, strftime=time.strftime, sleep=sleep))
    monkeypatch.setattr(ex.os, "replace", replace)
    ex.export_network(_net(width=4), {**META, "width": 4}, "onnx", out, {"name": "clf", "version": "3"})
    for t in threads:
        t.join(timeout=60)
    assert "b" in state
    versions = (_onnx_version(out / "model.onnx"), json.loads((out / CONTRACT_FILE).read_text())["model"]["version"])
    assert versions in (("3", "3"), ("7", "7")), f"--out mixes two exports: model.onnx of {versions[0]}, " \
                                                 f"contract.json of {versions[1]}"
    assert set(os.listdir(out)) == {"model.onnx", CONTRACT_FILE}  # no lock file or staging folder left


def test_a_lock_held_too_long_or_left_by_a_gone_process_is_named_and_nothing_moves(monkeypatch, tmp_path):
    import socket
    import subprocess
    import sys

    out = tmp_path / "out"
    ex.export_network(_net(width=4), {**META, "width": 4}, "onnx", out)
    before = _listing(out)
    lock = out / ex.LOCK_FILE
    monkeypatch.setattr(ex, "LOCK_WAIT_S", 0.3)
    lock.write_text("host elsewhere pid 12345 since 2026-01-01T00:00:00\n")  # another host's export, running
    with pytest.raises(ex.ExportError, match=r"onnx export of model 'clf' version 3: checked, but .*"
                                             r"\.export\.lock is held \(host elsewhere pid 12345 since .*\); nothing "
                                             r"moved into .*: run one export at a time per --out"):
        ex.export_network(_net(width=8), {**META, "width": 8}, "onnx", out, {"name": "clf", "version": "3"})
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(f"host {socket.gethostname()} pid {int(gone.stdout)} since 2026-01-01T00:00:00\n")
    monkeypatch.setattr(ex, "LOCK_WAIT_S", 30.0)  # not waited for: its holder is gone
    started = time.monotonic()
    with pytest.raises(ex.ExportError, match=r"left by a process of this host that is gone: remove it"):
        ex.export_network(_net(width=8), {**META, "width": 8}, "onnx", out)
    assert time.monotonic() - started < 10
    lock.unlink()
    assert _listing(out) == before  # the earlier export untouched
    ex.export_network(_net(width=8), {**META, "width": 8}, "onnx", out)
    assert set(os.listdir(out)) == {"model.onnx", CONTRACT_FILE}
