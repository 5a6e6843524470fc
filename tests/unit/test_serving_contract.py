"""Unit tests of pipeline.serving's pure parts and the pyfunc's per-row error handling (no Spark, no store)."""
from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.data.transforms import decode_batch
from pipeline.model.nets import build_network
from pipeline.serving.contract import check_contract, labels_of, preprocess, preprocessing_contract
from pipeline.serving.export import ExportError, export_network, run_exported
from pipeline.serving.models import ModelNotFound, parse_model_uri
from pipeline.tracking.pyfunc import ImageClassifierModel, InvalidModelInput

META = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": ["a", "b", "c"]}


def _png(seed: int, size: int = 20, mode: str = "L", fmt: str = "PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size, size) if mode == "L" else (size, size, 3)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("uri,expected", [
    ("models:/clf@champion", ("clf", "alias", "champion")),
    ("models:/clf/3", ("clf", "version", "3")),
    ("models:/clf/latest", ("clf", "latest", "latest")),
])
def test_parse_model_uri(uri, expected):
    assert parse_model_uri(uri) == expected


@pytest.mark.parametrize("uri", ["runs:/abc/model", "models:/clf", "models:/clf/three", "models:/a/b/c", ""])
def test_parse_model_uri_refuses(uri):
    with pytest.raises(ModelNotFound, match="--model"):
        parse_model_uri(uri)


@pytest.mark.parametrize("channels,mode", [(1, "L"), (3, "RGB")])
def test_contract_preprocess_matches_the_training_transform(channels, mode):
    meta = {**META, "channels": channels}
    contract = preprocessing_contract(meta)
    images = [_png(1, 20, mode), _png(2, 16, mode), _png(3, 24, "RGB", "JPEG"), _png(4, 16, "L")]
    got = preprocess(images, contract)
    np.testing.assert_allclose(got, decode_batch(images, 16, channels), atol=1e-6)
    assert got.shape == (4, channels, 16, 16) and got.dtype == np.float32
    assert contract["input"]["color_mode"] == mode and contract["output"]["class_names"] == ["a", "b", "c"]
    assert labels_of(np.array([[0.1, 0.7, 0.2]]), contract) == ["b"]


def test_contract_refuses_bad_rows_and_keys():
    contract = preprocessing_contract(META)
    with pytest.raises(ValueError, match="row 1: not a decodable image"):
        preprocess([_png(1), b"nope"], contract)
    broken = {**contract, "input": {k: v for k, v in contract["input"].items() if k != "std"}}
    with pytest.raises(ValueError, match="input.std"):
        check_contract(broken)


def test_the_reference_preprocess_refuses_by_key_a_contract_its_codec_cannot_follow():
    """preprocess decodes with pipeline.images.decode_image (square, 'L' or 'RGB'): an edited contract it cannot
    reproduce is refused naming the key, never decoded some other way."""
    contract = preprocessing_contract(META)
    wide = {**contract, "input": {**contract["input"], "width": 20}}
    with pytest.raises(ValueError, match=r"input.height=16 and input.width=20 differ"):
        preprocess([_png(1)], wide)
    for channels, mode in ((1, "RGB"), (3, "L"), (4, "RGBA")):
        odd = {**contract, "input": {**contract["input"], "channels": channels, "color_mode": mode,
                                     "mean": [0.5] * channels, "std": [0.5] * channels}}
        with pytest.raises(ValueError, match=rf"input.color_mode='{mode}' with input.channels={channels}"):
            preprocess([_png(1)], odd)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_network_reproduces_torch(tmp_path, fmt):
    torch.manual_seed(0)
    net = build_network("cnn", 1, 3, width=4).eval()
    result = export_network(net, META, fmt, tmp_path)
    assert result["max_abs_diff"] <= 1e-4
    x = preprocess([_png(i) for i in range(5)], preprocessing_contract(META))
    with torch.no_grad():
        expected = torch.softmax(net(torch.from_numpy(x)), 1).numpy()
    np.testing.assert_allclose(run_exported(fmt, tmp_path / ("model.onnx" if fmt == "onnx" else "model.pt"), x),
                               expected, atol=1e-5)
    with pytest.raises(ExportError, match="'tflite' is not one of"):
        export_network(net, META, "tflite", tmp_path)


def _model() -> ImageClassifierModel:
    torch.manual_seed(0)
    model = ImageClassifierModel()
    model.meta, model.class_names = dict(META), list(META["class_names"])
    model.network = build_network("cnn", 1, 3, width=4).eval()
    return model


def test_pyfunc_on_error_null_keeps_bad_rows_with_their_reason():
    model = _model()
    frame = pd.DataFrame({"content": [_png(1), b"not an image", None, _png(2)]})
    out = model.predict(None, frame, params={"on_error": "null"})
    assert len(out) == 4 and list(out.index) == list(frame.index)
    assert out["error"][0] is None and out["error"][3] is None
    assert "not a decodable image" in out["error"][1] and "got NoneType" in out["error"][2]
    assert out["label"][1] is None and pd.isna(out["probability"][2]) and out["probabilities"][1] is None
    assert pd.isna(out["label_index"][1]) and int(out["label_index"][0]) in (0, 1, 2)
    good = model.predict(None, frame.iloc[[0, 3]])
    assert list(out["label"][[0, 3]]) == list(good["label"])
    np.testing.assert_allclose(out["probability"][[0, 3]], good["probability"])
    assert "error" not in good.columns and good["label_index"].dtype == np.int64


def test_pyfunc_raise_names_the_row_as_a_400():
    from mlflow.exceptions import MlflowException

    model = _model()
    with pytest.raises(InvalidModelInput, match=r"row 1, column 'content'.*not a decodable image") as info:
        model.predict(None, pd.DataFrame({"content": [_png(1), b"junk"]}))
    assert isinstance(info.value, MlflowException) and isinstance(info.value, ValueError)
    assert info.value.get_http_status_code() == 400
    with pytest.raises(InvalidModelInput, match="param 'on_error'"):
        model.predict(None, pd.DataFrame({"content": [_png(1)]}), params={"on_error": "skip"})
    empty = model.predict(None, pd.DataFrame({"content": []}), params={"on_error": "null"})
    assert len(empty) == 0 and "error" in empty.columns


def test_pyfunc_refuses_a_call_over_its_row_limit_before_decoding_any_row(monkeypatch):
    import pipeline.tracking.pyfunc as pyfunc

    model = _model()
    decoded = []
    real = pyfunc.image_bytes
    monkeypatch.setattr(pyfunc, "image_bytes", lambda c: decoded.append(1) or real(c))
    three = pd.DataFrame({"content": [_png(1)] * 3})
    over = r"3 rows in one call, over the limit of 2 \(param 'max_rows'\)"
    with pytest.raises(InvalidModelInput, match=over) as info:
        model.predict(None, three, params={"max_rows": 2})
    assert info.value.get_http_status_code() == 400 and decoded == []
    monkeypatch.setattr(pyfunc, "MAX_ROWS_PER_CALL", 2)  # the default limit applies without the param
    with pytest.raises(InvalidModelInput, match=r"3 rows in one call, over the limit of 2 rows per call \(set by "
                                                r"pipeline\.tracking\.pyfunc\.MAX_ROWS_PER_CALL\)"):
        model.predict(None, three)
    for asked in (3, 2**62):  # a request may not raise the limit (the 2**62 scored 30,000 rows)
        for frame in (three, three.iloc[:1]):  # refused even where the rows would fit: it asked for more
            with pytest.raises(InvalidModelInput, match=rf"param 'max_rows': {asked:,} is over this model's limit of "
                                                        r"2 rows per call .*a request may lower it, never raise it"):
                model.predict(None, frame, params={"max_rows": asked})
    assert decoded == []
    with pytest.raises(InvalidModelInput, match=r"2 rows in one call, over the limit of 1 \(param 'max_rows'\)"):
        model.predict(None, three.iloc[:2], params={"max_rows": 1})  # it may lower it
    assert len(model.predict(None, three.iloc[:2], params={"max_rows": 2})) == 2
    assert len(model.predict(None, three.iloc[:2], params={"max_rows": None})) == 2  # none given (the signature's)
    for bad in (0, -1, "10", True, 1.5):
        with pytest.raises(InvalidModelInput, match="param 'max_rows': .* is not a positive whole number"):
            model.predict(None, three, params={"max_rows": bad})


def _loaded(tmp_path, model_config):
    """An ImageClassifierModel through its own load_context, with `model_config` as MLflow hands it over."""
    import json

    from mlflow.pyfunc.model import PythonModelContext

    (tmp_path / "meta.json").write_text(json.dumps(META))
    torch.save(build_network("cnn", 1, 3, width=4).state_dict(), tmp_path / "weights.pt")
    model = ImageClassifierModel()
    model.load_context(PythonModelContext({"meta": str(tmp_path / "meta.json"),
                                           "weights": str(tmp_path / "weights.pt")}, model_config))
    return model


def test_the_row_limit_is_the_model_configs_or_the_servers_environments(tmp_path, monkeypatch):
    import pipeline.tracking.pyfunc as pyfunc

    monkeypatch.delenv(pyfunc.MAX_ROWS_ENV, raising=False)
    assert pyfunc.MAX_ROWS_ENV == "LAKEHOUSE_SERVING_MAX_ROWS"
    rows = lambda n: pd.DataFrame({"content": [_png(1)] * n})  # noqa: E731
    logged = _loaded(tmp_path, {"max_rows_per_call": 300})  # what log_model(max_rows_per_call=300) records
    with pytest.raises(InvalidModelInput, match=r"301 rows in one call, over the limit of 300 rows per call \(set "
                                                r"by the model's config max_rows_per_call\)"):
        logged.predict(None, rows(301))
    with pytest.raises(InvalidModelInput, match="param 'max_rows': 301 is over this model's limit of 300"):
        logged.predict(None, rows(1), params={"max_rows": 301})
    assert len(logged.predict(None, rows(300), params={"max_rows": 300, "on_error": "null"})) == 300

    monkeypatch.setenv(pyfunc.MAX_ROWS_ENV, "2")  # the server's environment, read when the model loads
    served = _loaded(tmp_path, {"max_rows_per_call": 300})
    with pytest.raises(InvalidModelInput, match=r"3 rows in one call, over the limit of 2 rows per call \(set by "
                                                r"LAKEHOUSE_SERVING_MAX_ROWS\)"):
        served.predict(None, rows(3))
    with pytest.raises(InvalidModelInput, match=r"param 'max_rows': 300 is over this model's limit of 2 rows per "
                                                r"call \(set by LAKEHOUSE_SERVING_MAX_ROWS\)"):
        served.predict(None, rows(1), params={"max_rows": 300})
    assert len(served.predict(None, rows(2))) == 2
    # a model logged before the limit was recorded: 10,000, and its signature's default max_rows (10,000, filled in by
    # MLflow when a request gives none) counts as none given
    legacy = _loaded(tmp_path, None)
    assert len(legacy.predict(None, rows(2), params={"max_rows": pyfunc.MAX_ROWS_PER_CALL})) == 2
    with pytest.raises(InvalidModelInput, match="3 rows in one call, over the limit of 2 rows per call"):
        legacy.predict(None, rows(3), params={"max_rows": pyfunc.MAX_ROWS_PER_CALL})
    monkeypatch.delenv(pyfunc.MAX_ROWS_ENV)
    with pytest.raises(InvalidModelInput, match="10,001 rows in one call, over the limit of 10,000 rows per call"):
        _loaded(tmp_path, {}).predict(None, rows(10_001))

    monkeypatch.setenv(pyfunc.MAX_ROWS_ENV, " ")  # set but empty: as if unset
    assert _loaded(tmp_path, {"max_rows_per_call": 300}).max_rows[:2] == (300, "set by the model's config "
                                                                          "max_rows_per_call")
    for bad in ("0", "-5", "lots", "1e9", "2.5"):
        monkeypatch.setenv(pyfunc.MAX_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=rf"LAKEHOUSE_SERVING_MAX_ROWS={bad!r} is not a positive whole number"):
            _loaded(tmp_path, None)
    monkeypatch.delenv(pyfunc.MAX_ROWS_ENV)
    for bad in (0, "300", True, 2.5):
        with pytest.raises(ValueError, match=r"model config key 'max_rows_per_call': .* is not a positive whole"):
            _loaded(tmp_path, {"max_rows_per_call": bad})


def test_log_model_refuses_a_limit_the_gate_and_batch_scoring_could_not_call_under():
    from pipeline.tracking.pyfunc import PREDICT_BATCH_SIZE, log_model

    net = build_network("cnn", 1, 3, width=4)
    for bad in (PREDICT_BATCH_SIZE - 1, 0, True, "10000"):
        with pytest.raises(ValueError, match=rf"max_rows_per_call={bad!r}: .*at least {PREDICT_BATCH_SIZE}"):
            log_model(net, META, max_rows_per_call=bad, run_id="never-looked-up")


def test_pyfunc_takes_base64_text_as_a_server_sends_it():
    import base64

    model = _model()
    png = _png(3)
    raw = model.predict(None, pd.DataFrame({"content": [png]}))
    for form in (base64.b64encode(png), base64.b64encode(png).decode(), base64.encodebytes(png)):
        out = model.predict(None, pd.DataFrame({"content": [form]}))
        np.testing.assert_allclose(out["probabilities"][0], raw["probabilities"][0])
    out = model.predict(None, pd.DataFrame({"content": ["abc", "%%%", 7]}), params={"on_error": "null"})
    assert "not valid base64" in out["error"][0] and "not base64" in out["error"][1]
    assert "got int" in out["error"][2] and out["label"].isna().all()
    with pytest.raises(InvalidModelInput, match=r"row 'b', column 'content': a string not valid base64"):
        model.predict(None, pd.DataFrame({"content": [base64.b64encode(png).decode(), "abc"]}, index=["a", "b"]))


@pytest.mark.parametrize("job,command", [("predict.py", "predict"), ("export.py", "export")])
def test_job_script_is_the_cli_subcommand(job, command):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "jobs" / job
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: lakehouse {command} "), done.stdout


def test_served_code_alone_builds_and_runs_the_model(tmp_path):
    """The modules shipped with a logged model (code_paths) are enough: in a fresh interpreter that cannot import the
    installed `pipeline`, the copied subset (under its own name) imports the pyfunc and builds every non-timm
    network."""
    import json
    import subprocess
    import sys
    import textwrap

    from pipeline.tracking.pyfunc import copy_served_code

    name = copy_served_code(tmp_path / "code").name
    script = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                            and "editable" not in str(getattr(f, "__module__", "")).lower()]
        sys.path.insert(0, {str(tmp_path / "code")!r})
        import json, torch
        from {name}.tracking.pyfunc import ImageClassifierModel
        from {name}.model.nets import ARCHS, build_network
        import {name} as served
        shapes = {{a: list(build_network(a, 1, 3, 4)(torch.zeros(2, 1, 32, 32)).shape) for a in ARCHS}}
        print(json.dumps({{"served": served.__file__, "shapes": shapes, "pipeline": "pipeline" in sys.modules}}))
    """)
    res = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["served"].startswith(str(tmp_path / "code" / name)) and name.startswith("lakehouse_model_")
    assert not out["pipeline"]  # the served subset never names itself `pipeline` (see served_package_name)
    assert out["shapes"] and all(shape == [2, 3] for shape in out["shapes"].values()), out


def test_scoring_partitions_one_task_per_core_in_local_mode():
    from pipeline.serving.predict import scoring_partitions

    assert scoring_partitions(1, 2, local=True) == 2  # a one-file table still uses both cores
    assert scoring_partitions(57, 2, local=True) == 2  # local: one model load per task, one wave
    assert scoring_partitions(2, 2, local=True) == 2
    assert scoring_partitions(1, 8, local=False) == 8
    assert scoring_partitions(40, 8, local=False) == 40  # a cluster caches the model per worker process


def test_session_conf_puts_the_sessions_values_back():
    from pipeline.serving.predict import session_conf

    class Conf:
        def __init__(self, values):
            self.values = dict(values)

        def get(self, key, default=None):
            return self.values.get(key, default)

        def set(self, key, value):
            self.values[key] = value

        def unset(self, key):
            self.values.pop(key, None)

    class Session:
        conf = Conf({"a": "1"})

    spark = Session()
    with pytest.raises(RuntimeError):
        with session_conf(spark, {"a": "2", "b": "3"}):
            assert spark.conf.values == {"a": "2", "b": "3"}
            raise RuntimeError("the write failed")
    assert spark.conf.values == {"a": "1"}  # a's value back, b unset again


def test_a_model_whose_ranks_decoded_its_rows_is_served_and_described_with_its_validation_crop(tmp_path):
    """data.decode=cpu|gpu|auto: validation saw the central crop of each image; the served model (and so the gate,
    which scores through it) and the preprocessing contract take that crop, not the whole image resized."""
    import json

    from PIL import Image

    from pipeline.data.decode import Decoder, EncodedBatch
    from pipeline.data.transforms import pixels_to_float
    from pipeline.model.module import network_meta
    from pipeline.config import ModelConfig
    from mlflow.pyfunc.model import PythonModelContext

    rng = np.random.default_rng(0)
    contents = []
    for w, h in ((60, 40), (33, 50)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        contents.append(buf.getvalue())
    meta = network_meta(ModelConfig(arch="cnn", width=4), 3, 16, ["a", "b", "c"], center_crop=True)
    assert meta["center_crop"] == 0.875 and network_meta(ModelConfig(), 3, 16, ["a"]).get("center_crop") is None
    torch.manual_seed(0)
    net = build_network("cnn", 3, 3, width=4).eval()
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    torch.save(net.state_dict(), tmp_path / "weights.pt")
    model = ImageClassifierModel()
    model.load_context(PythonModelContext({"meta": str(tmp_path / "meta.json"),
                                           "weights": str(tmp_path / "weights.pt")}, {}))
    served = np.stack(model.predict(None, pd.DataFrame({"content": contents}))["probabilities"].to_list())
    rows = np.empty((2, 2), dtype=object)
    rows[:, 0], rows[:, 1] = contents, ["/a.png", "/b.png"]
    val = pixels_to_float(Decoder(16, 3, train=False, seed=0).decode(EncodedBatch(rows, 0)).numpy())
    with torch.no_grad():
        expected = torch.softmax(net(torch.from_numpy(val)), 1).numpy()
    assert np.allclose(served, expected, atol=1e-5)
    contract = preprocessing_contract(meta)
    assert contract["input"]["center_crop"] == 0.875
    assert np.allclose(preprocess(contents, contract), val, atol=1e-6)
    whole = preprocess(contents, preprocessing_contract({k: v for k, v in meta.items() if k != "center_crop"}))
    assert not np.allclose(whole, val, atol=1e-2)  # the crop matters on these images
    with pytest.raises(ValueError, match="input.center_crop=0.5"):
        preprocess(contents, {**contract, "input": {**contract["input"], "center_crop": 0.5}})


def test_every_pipeline_import_of_the_served_code_is_served_too():
    """A logged model ships SERVED_MODULES only: a `pipeline` import in one of them (at module level or inside a
    function) of a module not shipped fails the model's load wherever it is served (seen: log.py began to import
    redact.py, and every log_model failed with "No module named 'lakehouse_model_....redact'")."""
    import ast
    from pathlib import Path

    from pipeline.tracking.served_code import SERVED_MODULES

    root = Path(__file__).resolve().parents[2]
    missing = []
    for rel in SERVED_MODULES:
        for node in ast.walk(ast.parse((root / rel).read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                if name == "pipeline" or not name.startswith("pipeline."):
                    continue
                path = name.replace(".", "/")
                if f"{path}.py" not in SERVED_MODULES and not (root / path).is_dir():
                    missing.append(f"{rel} imports {name}")
    assert not missing, missing
