"""Integration tests of pipeline.serving: `lakehouse predict` on real Spark + delta-rs, `mlflow models serve` over HTTP,
ONNX (onnxruntime) and TorchScript (a fresh interpreter without `pipeline`) parity with the registered pyfunc.

The registered model: a SmallCNN (width 8) fitted for 5 epochs (Adam, then BatchNorm statistics of all rows) in this process with a plain torch loop on the
shared 600-digit table (seconds; confident predictions, so top-1 comparisons are not decided by float noise),
logged with pipeline.tracking.pyfunc.log_model into a real SQLite store, registered and aliased `champion`.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, cli, free_port, make_config, start_server, stop_mlflow_server

pytestmark = pytest.mark.integration

VENV_BIN = Path(sys.executable).parent
NAME = "serving_clf"
CORRUPT_PATH = "/corrupt/not-an-image.png"
CORRUPT_BYTES = b"\x89PNG\r\n\x1a\n but the rest is not a PNG"
# PIL identifies this as EPS: with Ghostscript installed, decoding it runs the sender's PostScript
EPS_BYTES = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
             b"0 setgray 0 0 8 8 rectfill\nshowpage\n%%EOF\n")
ACCEPTED = "accepted formats: JPEG, PNG, GIF, BMP, TIFF, WEBP"


def _table_rows(table: Path) -> pa.Table:
    from deltalake import DeltaTable

    dt = DeltaTable(str(table))
    return pa.concat_tables([pq.read_table(u.replace("file://", "")) for u in dt.file_uris()])


@pytest.fixture(scope="module")
def rows(digits_table) -> pa.Table:
    return _table_rows(digits_table).sort_by("path")


@pytest.fixture(scope="module")
def registered(tmp_path_factory, rows):
    """(cfg, pinned model) of a briefly trained CNN registered as `serving_clf` version 1, alias champion."""
    import torch

    from pipeline.data.transforms import decode_batch
    from pipeline.model.module import network_meta
    from pipeline.model.nets import build_network
    from pipeline.serving.models import resolve
    from pipeline.tracking.pyfunc import log_model
    from pipeline.tracking.registry import register_model
    from pipeline.tracking.runs import configure, experiment_id_of

    root = tmp_path_factory.mktemp("serving")
    cfg = make_config(root, "mlflow.experiment=serving", f"mlflow.registered_model={NAME}", "model.width=8")
    by_index = dict(zip(rows.column("label_index").to_pylist(), rows.column("label").to_pylist()))
    class_names = [by_index[i] for i in range(len(by_index))]
    x = torch.from_numpy(decode_batch(rows.column("content").to_pylist(), 32, 1))
    y = torch.tensor(rows.column("label_index").to_pylist())
    torch.manual_seed(0)
    net = build_network("cnn", 1, len(class_names), width=8)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net.train()
    for _ in range(5):
        perm = torch.randperm(len(y))
        for start in range(0, len(y), 32):
            idx = perm[start:start + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    for module in net.modules():  # BatchNorm: population statistics of the rows, not a lagging running average
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None
    with torch.no_grad():
        net(x)
    net.eval()
    with torch.no_grad():
        acc = float((net(x).argmax(1) == y).float().mean())
    client = configure(cfg.mlflow)
    run_id = client.create_run(experiment_id_of(client, cfg.mlflow.experiment)).info.run_id
    meta = network_meta(cfg.model, 1, 32, class_names)
    uri = log_model(net, meta, input_example_content=rows.column("content")[0].as_py(), run_id=run_id)
    version = register_model(client, uri, NAME, run_id, {"val_acc": f"{acc:.4f}"})
    client.set_registered_model_alias(NAME, "champion", version)
    client.set_terminated(run_id)
    assert acc > 0.5, f"the test model did not learn (train acc {acc})"
    return cfg, resolve(client, f"models:/{NAME}@champion")


@pytest.fixture(scope="module")
def pyfunc_out(registered, rows) -> pd.DataFrame:
    """The registered model's answers, in this process, for every row of the table (sorted by path)."""
    _, pinned = registered
    model = mlflow.pyfunc.load_model(pinned.uri)
    return model.predict(pd.DataFrame({"content": rows.column("content").to_pylist()}))


def _run(cmd, timeout, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)
    assert res.returncode == 0, f"{cmd[:3]} exited {res.returncode}:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_predict_scores_every_row_and_keeps_the_undecodable_one(registered, rows, pyfunc_out, tmp_path):
    from deltalake import DeltaTable, write_deltalake

    cfg, pinned = registered
    table, out = tmp_path / "input", tmp_path / "predictions"
    write_deltalake(str(table), rows)  # version 0: the 600 digits
    corrupt = {name: None for name in rows.schema.names}
    corrupt.update({"path": CORRUPT_PATH, "label": "?", "label_index": -1, "content": CORRUPT_BYTES})
    write_deltalake(str(table), pa.Table.from_pylist([corrupt], schema=rows.schema), mode="append")  # version 1
    # the table as a user may type it, relative to the working directory (ROOT): its rows record its location
    args = ["predict", "--model", f"models:/{NAME}@champion", "--table", os.path.relpath(table, ROOT), "--version", "1",
            "--out", str(out), "--conf", str(ROOT / "conf/local.yaml"),
            f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}", f"mlflow.experiment={cfg.mlflow.experiment}",
            "spark.app_name=lakehouse-predict-test"]
    started = time.monotonic()
    result = _run(cli(*args), timeout=240)
    seconds = time.monotonic() - started
    assert result["rows"] == len(rows) + 1 and result["errors"] == 1, result
    assert result["rows_written"] == len(rows) + 1 and result["rows_check"].startswith(
        f"passed: {len(rows) + 1} rows in the "), result  # a local --out: counted from its commit's data files
    assert (result["model_version"], result["input_version"], result["out_version"]) == (pinned.version, 1, 0)

    dt = DeltaTable(str(out))
    assert dt.version() == 0 and len(dt.history()) == 1  # one commit
    got = dt.to_pyarrow_table().to_pandas().sort_values("path").reset_index(drop=True)
    assert len(got) == len(rows) + 1 and got["path"].is_unique
    assert set(got["model_name"]) == {NAME} and set(got["model_version"]) == {int(pinned.version)}
    assert set(got["input_version"]) == {1} and set(got["input_table"]) == {os.path.realpath(table)}
    bad = got[got["path"] == CORRUPT_PATH].iloc[0]
    assert bad["label"] is None and pd.isna(bad["probability"]) and bad["probabilities"] is None
    assert "not a decodable image" in bad["error"], bad["error"]
    good = got[got["path"] != CORRUPT_PATH].reset_index(drop=True)
    assert good["error"].isna().all() and good["label"].notna().all()
    assert list(good["path"]) == rows.column("path").to_pylist()
    assert list(good["label"]) == list(pyfunc_out["label"])
    np.testing.assert_allclose(good["probability"].to_numpy(), pyfunc_out["probability"].to_numpy(), atol=1e-6)
    model = mlflow.pyfunc.load_model(pinned.uri)
    frame = pd.DataFrame({"content": rows.column("content").to_pylist()})
    t0 = time.monotonic()
    model.predict(frame)
    direct = len(rows) / (time.monotonic() - t0)
    print(f"\nlakehouse predict: {len(got)} rows in {seconds:.1f} s end to end (CLI, new Spark); "
          f"{result['rows_per_s']} rows/s inside predict_table (read, score, write, commit); pyfunc in one "
          f"process: {direct:.0f} rows/s; ratio {result['rows_per_s'] / direct:.2f}")


def _start_server(model_uri: str, tracking_uri: str, log_path: Path, **extra_env: str):
    port = free_port()
    # MLflow execs `uvicorn` by name: the venv's bin must be on PATH (as in an activated venv)
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri,
           "PATH": os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]), **extra_env}
    cmd = [str(VENV_BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local",
           "-h", "127.0.0.1", "-p", str(port), "-w", "1"]
    url = f"http://127.0.0.1:{port}"
    return start_server(cmd, f"{url}/ping", log_path, "mlflow models serve", 120, env=env), url


def _post(url: str, body) -> tuple:
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, {"raw": text}


@pytest.mark.timeout(600)
def test_a_process_that_loaded_the_model_still_imports_the_whole_installed_package(registered, rows, pyfunc_out,
                                                                                  tmp_path):
    """What a reused Spark Python worker does: load the registered model as spark_udf does (mlflow.pyfunc.load_model
    puts the model's code folder first on sys.path for good), score, then run training code. The model runs the code
    it was logged with, and the installed `pipeline` stays whole (seen before: `predict` then `train` in one Spark
    session failed in the worker with "No module named 'pipeline.data.convert'")."""
    cfg, pinned = registered
    script = textwrap.dedent(f"""
        import json, mlflow, pandas as pd, pyarrow.parquet as pq
        mlflow.set_tracking_uri({cfg.mlflow.tracking_uri!r})
        model = mlflow.pyfunc.load_model({pinned.uri!r})
        out = model.predict(pd.DataFrame({{"content": pq.read_table({str(tmp_path / "rows.parquet")!r})
                                                         .column("content").to_pylist()}}))
        import pipeline, pipeline.data.convert
        served = type(model.unwrap_python_model()).__module__
        print(json.dumps({{"pipeline": pipeline.__file__, "served": served, "labels": out["label"].tolist()}}))
    """)
    pq.write_table(rows.select(["content"]), tmp_path / "rows.parquet")
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(out["pipeline"]).resolve() == (ROOT / "pipeline" / "__init__.py").resolve()
    assert out["served"].startswith("lakehouse_model_") and out["served"].endswith(".tracking.pyfunc"), out
    assert out["labels"] == pyfunc_out["label"].tolist()


def test_served_model_answers_like_the_pyfunc_and_refuses_bad_rows_with_400(registered, rows, pyfunc_out, tmp_path):
    cfg, _ = registered
    picks = list(range(0, len(rows), 40))  # 15 real images from the table
    b64 = [base64.b64encode(rows.column("content")[i].as_py()).decode() for i in picks]
    proc, url = _start_server(f"models:/{NAME}@champion", cfg.mlflow.tracking_uri, tmp_path / "serve.log")
    try:
        for body in ({"dataframe_split": {"columns": ["content"], "data": [[s] for s in b64]}},
                     {"instances": [{"content": s} for s in b64]}):
            status, answer = _post(url, body)
            assert status == 200, answer
            preds = answer["predictions"]
            assert [p["label"] for p in preds] == [pyfunc_out["label"][i] for i in picks]
            np.testing.assert_allclose([p["probabilities"] for p in preds],
                                       np.stack(pyfunc_out["probabilities"].to_numpy()[picks]), atol=1e-6)

        not_image = base64.b64encode(b"these bytes are no image").decode()
        eps = base64.b64encode(EPS_BYTES).decode()
        cases = {
            "not an image (row 1)": ({"dataframe_split": {"columns": ["content"], "data": [[b64[0]], [not_image]]}},
                                     ["row 1", "content", "not a decodable image"]),
            "not an image, instances": ({"instances": [{"content": b64[0]}, {"content": b64[1]},
                                                       {"content": not_image}]}, ["row 2", "not a decodable image"]),
            # dataframe_split: MLflow base64-decodes the binary column itself, before the model (column named)
            "bad base64": ({"dataframe_split": {"columns": ["content"], "data": [[b64[0]], ["abc"]]}},
                           ["content", "Incorrect padding"]),
            # instances: the model decodes the base64 text itself (row named)
            "bad base64, instances": ({"instances": [{"content": b64[0]}, {"content": "abc"}]},
                                      ["row 1", "content", "not valid base64"]),
            # a format outside the allow-list (pipeline.images.ACCEPTED_FORMATS): its PIL plugin never reads it
            "EPS (row 1)": ({"instances": [{"content": b64[0]}, {"content": eps}]},
                            ["row 1", "content", "not a decodable image", ACCEPTED]),
            "wrong column": ({"dataframe_split": {"columns": ["image"], "data": [[b64[0]]]}},
                             ["missing inputs", "content"]),
        }
        for what, (body, needles) in cases.items():
            status, answer = _post(url, body)
            assert status == 400, (what, status, answer)
            message = answer.get("message", "")
            for needle in needles:
                assert needle in message, (what, needle, message[-1500:])
            assert "stack_trace" not in answer and "Traceback" not in json.dumps(answer), (what, answer)
            if what not in ("bad base64", "wrong column"):  # the model's refusals (those two are MLflow's own)
                # only the model's message: MLflow's server wrapped it as "Failed to predict data '<the request>'"
                assert message.startswith("model input row") and b64[0][:40] not in message, (what, message[:300])
        # on_error=null: an error row's probability is a JSON null, not the bare token NaN that strict parsers refuse
        text = _post_text(url, {"instances": [{"content": b64[0]}, {"content": not_image}],
                                "params": {"on_error": "null"}})
        preds = json.loads(text, parse_constant=_refuse_constant)["predictions"]
        assert preds[0]["probability"] > 0 and preds[1]["probability"] is None and preds[1]["label"] is None, preds
        assert "not a decodable image" in preds[1]["error"]
        # the per-call pixel budget (2,000,000,000 declared pixels): 32 Group-4 TIFFs of 8000x8000 (a few KB each,
        # 0.15 s and 65 MB each to decode) are refused from their headers, the 32nd named, nothing decoded
        status, answer = _post(url, {"instances": [{"content": b64[0]}] + [{"content": _g4_tiff_b64()}] * 32})
        assert status == 400, (status, str(answer)[:300])
        assert answer["message"].startswith("the 33 rows' headers declare 2,048,0"), answer["message"][:300]
        for needle in ("over this model's budget of 2,000,000,000 pixels per call (set by the model's config "
                       "max_pixels_per_call)", "ran out at model input row 32, column 'content'"):
            assert needle in answer["message"], answer["message"]
        # the server still answers after the refusals
        assert _post(url, {"instances": [{"content": b64[0]}]})[0] == 200
        # the request example stored with the model is a request the server takes
        example = json.loads(Path(mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{NAME}@champion/serving_input_example.json")).read_text())
        status, answer = _post(url, example)
        assert status == 200 and answer["predictions"][0]["label"] == pyfunc_out["label"][0], answer
    finally:
        stop_mlflow_server(proc)
    assert proc.poll() is not None


def _post_text(url: str, body) -> str:
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


def _refuse_constant(token):
    raise ValueError(f"not JSON (RFC 8259): the bare token {token}")


def _g4_tiff_b64(side: int = 8000) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (side, side), 0).save(buf, format="TIFF", compression="group4")
    return base64.b64encode(buf.getvalue()).decode()


def _peak_rss_mb(pid: int) -> dict:
    """The peak resident memory (VmHWM, MB) of a process and of each of its descendants, by pid."""
    import psutil

    peaks = {}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/status") as fh:
                line = next(x for x in fh if x.startswith("VmHWM:"))
            peaks[proc.pid] = int(line.split()[1]) / 1024
        except (OSError, StopIteration):
            continue
    return peaks


@pytest.mark.timeout(600)
def test_served_model_refuses_a_decompression_bomb_from_its_header_and_a_request_over_its_row_limit(
        registered, rows, tmp_path):
    """The issue's file (a ~164 KB PNG declaring 13000x13000 pixels, ~500 MB decoded) sent to `mlflow models serve`:
    400 naming the row and the pixel count, and the server's processes' peak memory grows by under 100 MB (decoded,
    it grew by ~1 GB). A request over the row limit (param max_rows) is 400 naming the limit; a request may lower
    the limit, never raise it (the issue's `"max_rows": 2**62` scored 30,000 rows). The server still answers
    afterwards."""
    import io

    from PIL import Image

    cfg, _ = registered
    img = Image.new("L", (13000, 13000), 0)
    img.paste(255, (0, 0, 64, 64))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    del img
    assert len(buf.getvalue()) < 300_000
    bomb = base64.b64encode(buf.getvalue()).decode()
    good = base64.b64encode(rows.column("content")[0].as_py()).decode()
    proc, url = _start_server(f"models:/{NAME}@champion", cfg.mlflow.tracking_uri, tmp_path / "serve.log")
    try:
        assert _post(url, {"instances": [{"content": good}]})[0] == 200  # the model loaded, the worker warm
        before = _peak_rss_mb(proc.pid)
        t0 = time.monotonic()
        status, answer = _post(url, {"instances": [{"content": good}, {"content": bomb}]})
        took = time.monotonic() - t0
        after = _peak_rss_mb(proc.pid)
        assert status == 400, answer
        message = answer.get("message", "")
        assert "row 1" in message and "13000x13000 = 169,000,000 pixels" in message, message
        grown = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
        print(f"bomb answered in {took:.3f} s; peak memory growth by process (MB): {grown}")
        assert max(grown.values()) < 100, grown
        assert took < 30, took  # a hang guard; the figure itself is in docs/PERFORMANCE.md

        status, answer = _post(url, {"instances": [{"content": good}] * 3, "params": {"max_rows": 2}})
        assert status == 400 and "3 rows in one call, over the limit of 2 (param 'max_rows')" in answer["message"]
        assert _post(url, {"instances": [{"content": good}] * 3})[0] == 200  # under the default limit
        # a client cannot lift the server's limit (10,000 rows, recorded when the model was logged)
        t0 = time.monotonic()
        status, answer = _post(url, {"instances": [{"content": good}] * 10_001, "params": {"max_rows": 2**62}})
        assert status == 400, (status, str(answer)[:500])
        assert (f"param 'max_rows': {2**62:,} is over this model's limit of 10,000 rows per call"
                in answer["message"]), answer["message"]
        assert time.monotonic() - t0 < 30  # refused before any row is decoded (a hang guard: the status says it)
        status, answer = _post(url, {"instances": [{"content": good}], "params": {"max_rows": 10_001}})
        assert status == 400 and "over this model's limit of 10,000" in answer["message"], answer
        assert _post(url, {"instances": [{"content": good}], "params": {"max_rows": 10_000}})[0] == 200
    finally:
        stop_mlflow_server(proc)
    assert proc.poll() is not None


@pytest.mark.timeout(600)
def test_the_row_limit_is_set_when_the_model_is_logged_or_the_server_starts_never_by_a_request(registered, rows,
                                                                                             tmp_path):
    """log_model records the limit in the model's config; LAKEHOUSE_SERVING_MAX_ROWS in the server's environment (or
    a Python loader's model_config) sets it when the server starts; a request's max_rows may only lower it."""
    from pipeline.tracking.pyfunc import load_pyfunc

    cfg, pinned = registered
    info = mlflow.models.get_model_info(pinned.uri)
    assert info.flavors["python_function"]["config"] == {"max_rows_per_call": 10_000,  # MLmodel: config
                                                         "max_pixels_per_call": 2_000_000_000}
    assert {p.name: p.default for p in info.signature.params}["max_rows"] is None  # none given: the model's limit

    good = base64.b64encode(rows.column("content")[0].as_py()).decode()
    proc, url = _start_server(f"models:/{NAME}@champion", cfg.mlflow.tracking_uri, tmp_path / "serve.log",
                              LAKEHOUSE_SERVING_MAX_ROWS="2")
    try:
        assert _post(url, {"instances": [{"content": good}] * 2})[0] == 200
        status, answer = _post(url, {"instances": [{"content": good}] * 3})
        assert status == 400, answer
        assert ("3 rows in one call, over the limit of 2 rows per call (set by LAKEHOUSE_SERVING_MAX_ROWS)"
                in answer["message"]), answer["message"]
        for asked in (3, 10_000, 2**62):  # even for one row: the request asked for what it may not have
            status, answer = _post(url, {"instances": [{"content": good}], "params": {"max_rows": asked}})
            assert status == 400, (asked, answer)
            assert (f"param 'max_rows': {asked:,} is over this model's limit of 2 rows per call (set by "
                    f"LAKEHOUSE_SERVING_MAX_ROWS); a request may lower it, never raise it") in answer["message"]
        status, answer = _post(url, {"instances": [{"content": good}] * 2, "params": {"max_rows": 1}})
        assert status == 400 and "2 rows in one call, over the limit of 1 (param 'max_rows')" in answer["message"]
        assert _post(url, {"instances": [{"content": good}], "params": {"max_rows": 1}})[0] == 200
    finally:
        stop_mlflow_server(proc)

    frame = pd.DataFrame({"content": [rows.column("content")[0].as_py()] * 3})
    lowered = mlflow.pyfunc.load_model(pinned.uri, model_config={"max_rows_per_call": 2})
    with pytest.raises(ValueError, match=r"3 rows in one call, over the limit of 2 rows per call \(set by the "
                                         r"model's config max_rows_per_call\)"):
        lowered.predict(frame)
    with pytest.raises(ValueError, match=r"param 'max_rows': 3 is over this model's limit of 2 rows per call"):
        lowered.predict(frame, params={"max_rows": 3})
    assert len(load_pyfunc(pinned.uri).predict(frame)) == 3  # as logged: 10,000


def _contents(rows, n=None):
    return rows.column("content").to_pylist()[:n]


@pytest.mark.timeout(600)
def test_onnx_export_matches_the_pyfunc_on_every_row(registered, rows, pyfunc_out, tmp_path):
    import onnxruntime as ort

    from pipeline.serving.contract import load_contract, preprocess
    from pipeline.serving.export import export_model

    cfg, pinned = registered
    result = export_model(cfg, f"models:/{NAME}@champion", "onnx", str(tmp_path / "onnx"))
    assert (result["model_name"], result["model_version"]) == (NAME, pinned.version)
    assert result["max_abs_diff"] <= 1e-4
    contract = load_contract(result["contract"])
    assert contract["input"]["mean"] == [0.5] and contract["input"]["std"] == [0.5]
    assert len(contract["output"]["class_names"]) == 10
    session = ort.InferenceSession(result["path"], providers=["CPUExecutionProvider"])
    assert json.loads(session.get_modelmeta().custom_metadata_map["preprocessing_contract"]) == contract
    probs = session.run(["probabilities"], {"pixels": preprocess(_contents(rows), contract)})[0]
    expected = np.stack(pyfunc_out["probabilities"].to_numpy())
    names = contract["output"]["class_names"]
    assert [names[i] for i in probs.argmax(1)] == list(pyfunc_out["label"])
    assert float(np.abs(probs - expected).max()) <= 1e-4

    client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
    logged = {Path(a.path).name for a in client.list_artifacts(pinned.run_id, "export/onnx")}
    assert logged == {"model.onnx", "contract.json"}
    assert client.get_model_version(NAME, pinned.version).tags["export_onnx"] == result["artifact_uri"]


@pytest.mark.timeout(600)
def test_torchscript_export_runs_without_the_pipeline_package(registered, rows, pyfunc_out, tmp_path):
    cfg, pinned = registered
    out = tmp_path / "ts"
    args = ["export", "--model", f"models:/{NAME}/{pinned.version}", "--format", "torchscript", "--out", str(out),
            "--conf", str(ROOT / "conf/local.yaml"), f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}",
            f"mlflow.experiment={cfg.mlflow.experiment}"]
    result = _run(cli(*args), timeout=180)
    assert result["format"] == "torchscript" and Path(result["path"]).is_file()
    images = tmp_path / "images"
    images.mkdir()
    n = 200
    for i, content in enumerate(_contents(rows, n)):
        (images / f"{i:04d}.img").write_bytes(content)
    script = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")).lower()
                            and "editable" not in type(f).__module__.lower()]
        try:
            import pipeline
            raise SystemExit("pipeline importable: " + str(pipeline.__file__))
        except ImportError:
            pass
        import io, json, os
        import numpy as np, torch
        from PIL import Image
        extra = {{"contract.json": ""}}  # the contract travels inside the TorchScript file
        module = torch.jit.load({str(out / "model.pt")!r}, _extra_files=extra)
        c = json.loads(extra["contract.json"])["input"]
        batch = []
        for name in sorted(os.listdir({str(images)!r})):
            img = Image.open(os.path.join({str(images)!r}, name)).convert(c["color_mode"])
            if img.size != (c["width"], c["height"]):
                img = img.resize((c["width"], c["height"]), Image.BILINEAR)
            a = np.asarray(img, dtype=np.uint8)
            a = a[None] if c["channels"] == 1 else a.transpose(2, 0, 1)
            mean = np.asarray(c["mean"], np.float32).reshape(-1, 1, 1)
            std = np.asarray(c["std"], np.float32).reshape(-1, 1, 1)
            batch.append((a.astype(np.float32) * np.float32(c["scale"]) - mean) / std)
        with torch.no_grad():
            probs = module(torch.from_numpy(np.stack(batch))).numpy()
        np.save({str(tmp_path / "probs.npy")!r}, probs)
        print(json.dumps({{"modules": sorted(m for m in sys.modules if m.split(".")[0] == "pipeline")}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["modules"] == []
    probs = np.load(tmp_path / "probs.npy")
    expected = np.stack(pyfunc_out["probabilities"].to_numpy()[:n])
    assert list(probs.argmax(1)) == list(pyfunc_out["label_index"][:n])
    assert float(np.abs(probs - expected).max()) <= 1e-4
    client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
    assert {Path(a.path).name for a in client.list_artifacts(pinned.run_id, "export/torchscript")} == {
        "model.pt", "contract.json"}


# --- the promotion gate and what the registry shows about a version ------------------------------------------------

def _register(cfg, name, network, meta, content, table, logged_val_acc):
    """Log `network` as a pyfunc in a new run (val_acc metric `logged_val_acc`) and register it with lineage tags."""
    from pipeline.tracking.pyfunc import log_model
    from pipeline.tracking.registry import register_model
    from pipeline.tracking.runs import configure, experiment_id_of

    client = configure(cfg.mlflow)
    run_id = client.create_run(experiment_id_of(client, cfg.mlflow.experiment)).info.run_id
    client.log_metric(run_id, "val_acc", logged_val_acc)
    uri = log_model(network, meta, input_example_content=content, run_id=run_id)
    client.set_terminated(run_id)
    return register_model(client, uri, name, run_id, {"delta_table": str(table), "delta_version": "0",
                                                      "val_acc": str(logged_val_acc)})


@pytest.mark.timeout(600)
def test_gate_scores_both_on_the_same_val_rows_and_a_tie_keeps_the_champion(registered, rows, pyfunc_out,
                                                                             digits_table):
    """Logged val_acc says the opposite of the same-rows scores: the gate follows the same-rows scores."""
    import dataclasses

    import torch

    from mlflow.types import DataType

    from pipeline.lakehouse.split import is_validation
    from pipeline.model.nets import build_network
    from pipeline.serving.models import load_network
    from pipeline.workflow import promote_version

    cfg, pinned = registered
    name = "gate_clf"
    # the first version is an untrained net: no chance floor here (it is tested in test_gate_chance.py)
    gcfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, registered_model=name, gate_margin=0.0,
                                                               gate_min_lift=None))
    client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
    good, meta = load_network(pinned)
    torch.manual_seed(1)
    untrained = build_network(meta["arch"], meta["channels"], len(meta["class_names"]), meta["width"]).eval()
    content = rows.column("content")[0].as_py()
    val = [is_validation(p, cfg.data.val_fraction) for p in rows.column("path").to_pylist()]
    truth = rows.column("label").to_pylist()
    good_acc = float(np.mean([t == p for t, p, v in zip(truth, pyfunc_out["label"], val) if v]))

    v1 = _register(gcfg, name, untrained, meta, content, digits_table, logged_val_acc=0.99)
    d1 = promote_version(gcfg, v1)
    assert d1["promoted"] and d1["champion_version"] is None, d1
    assert d1["rows"] == (f"val split of Delta table {digits_table} version 0 ({sum(val)} rows; held out by "
                          f"val_fraction {cfg.data.val_fraction:g} by path)")  # these runs record no data.split_key
    bad_acc = float(client.get_model_version(name, v1).tags["gate_val_acc"])
    assert bad_acc < 0.5 < good_acc

    v2 = _register(gcfg, name, good, meta, content, digits_table, logged_val_acc=0.5)  # logged: worse than 0.99
    d2 = promote_version(gcfg, v2)
    assert d2["promoted"] and d2["champion_version"] == v1, d2
    assert (d2["value"], d2["champion_value"]) == (pytest.approx(good_acc), pytest.approx(bad_acc, abs=1e-6))  # tag: 6 digits
    tags = client.get_model_version(name, v2).tags
    assert float(tags["gate_val_acc"]) == pytest.approx(good_acc, abs=1e-5)
    assert float(tags["gate_champion_val_acc"]) == pytest.approx(bad_acc, abs=1e-5)
    assert tags["gate_champion_version"] == v1 and tags["gate_decision"] == d2["reason"]

    v3 = _register(gcfg, name, good, meta, content, digits_table, logged_val_acc=1.0)  # logged: better; same rows: tie
    d3 = promote_version(gcfg, v3)
    assert not d3["promoted"] and d3["value"] == d3["champion_value"] == pytest.approx(good_acc), d3
    assert "champion kept" in d3["reason"]
    assert str(client.get_model_version_by_alias(name, "champion").version) == v2

    # the registry shows the data version, the metrics and how to call it; the signature is the served contract
    mv = client.get_model_version(name, v2)
    for needle in (f"Delta table `{digits_table}` pinned at version 0", "val_acc=0.5", f"models:/{name}/{v2}",
                   "lakehouse predict --model", "mlflow models serve -m", "curl -s", "dataframe_split",
                   "lakehouse export"):
        assert needle in mv.description, (needle, mv.description)
    info = mlflow.models.get_model_info(f"models:/{name}/{v2}")
    assert info.signature.inputs.input_names() == ["content"]
    assert info.signature.inputs.inputs[0].type == DataType.binary
    assert {p.name for p in info.signature.params} == {"on_error", "max_rows"}
    example = json.loads(Path(mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{name}/{v2}/serving_input_example.json")).read_text())
    assert example["dataframe_split"]["columns"] == ["content"]
    assert base64.b64decode(example["dataframe_split"]["data"][0][0]) == content  # a real image of the table


@pytest.mark.timeout(600)
def test_gate_keeps_a_champion_that_cannot_be_loaded_and_names_it(registered, rows, digits_table):
    import dataclasses

    from pipeline.serving.models import load_network
    from pipeline.tracking.registry import register_model
    from pipeline.workflow import promote_version

    cfg, pinned = registered
    name = "gate_broken_clf"
    gcfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, registered_model=name))
    client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
    run = client.create_run(client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id)
    client.set_terminated(run.info.run_id)
    empty = mlflow.initialize_logged_model(name="model", source_run_id=run.info.run_id,
                                           experiment_id=run.info.experiment_id)  # no model files at all
    client.finalize_logged_model(empty.model_id, "READY")  # READY yet without its files: PENDING is not registered
    v1 = register_model(client, f"models:/{empty.model_id}", name, run.info.run_id, {})
    client.set_registered_model_alias(name, "champion", v1)
    good, meta = load_network(pinned)
    v2 = _register(gcfg, name, good, meta, rows.column("content")[0].as_py(), digits_table, logged_val_acc=0.9)
    d = promote_version(gcfg, v2)
    assert not d["promoted"] and f"model {name!r} version {v1}" in d["error"], d
    assert f"champion version {v1} could not be scored" in d["reason"]
    assert str(client.get_model_version_by_alias(name, "champion").version) == v1
    assert client.get_model_version(name, v2).tags["gate_champion_val_acc"] == "error"
