"""The served model's answers and refusals as a client sees them (no Spark, no store): an error row's probability is
a JSON null, a refusal's message is the project's own however MLflow's server wraps it, and a request whose rows'
headers declare more pixels than the per-call budget is refused before any row is decoded (real images by Pillow)."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pandas as pd
import pytest
import torch

import pipeline.tracking.pyfunc as pyfunc
from pipeline.model.nets import build_network
from pipeline.tracking.pyfunc import ImageClassifierModel, InvalidModelInput

META = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": ["a", "b", "c"]}


def _png(value: int = 128, size: int = 20) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height), 90).save(buf, format="JPEG", quality=50)
    return buf.getvalue()


def _tiff(side: int) -> bytes:
    """A Group-4 TIFF of one colour: a few KB that declare side x side pixels (the reviewer's 8000x8000: 2.6 KB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (side, side), 0).save(buf, format="TIFF", compression="group4")
    return buf.getvalue()


def _loaded(tmp_path, model_config) -> ImageClassifierModel:
    """An ImageClassifierModel through its own load_context, with `model_config` as MLflow hands it over."""
    from mlflow.pyfunc.model import PythonModelContext

    (tmp_path / "meta.json").write_text(json.dumps(META))
    torch.manual_seed(0)
    torch.save(build_network("cnn", 1, 3, width=4).state_dict(), tmp_path / "weights.pt")
    model = ImageClassifierModel()
    model.load_context(PythonModelContext({"meta": str(tmp_path / "meta.json"),
                                           "weights": str(tmp_path / "weights.pt")}, model_config))
    return model


def _strict_json(text: str):
    def refuse(token):
        raise ValueError(f"not JSON: the bare token {token}")

    return json.loads(text, parse_constant=refuse)


def test_an_error_rows_probability_is_a_json_null_in_the_servers_answer(tmp_path, monkeypatch):
    """With on_error=null a bad row's probability was np.nan, which MLflow's server writes as the bare token NaN (not
    JSON: JavaScript's JSON.parse, Go, Jackson refuse the whole answer)."""
    from mlflow.pyfunc.scoring_server import predictions_to_json

    monkeypatch.delenv("LAKEHOUSE_SERVING_MAX_PIXELS", raising=False)
    model = _loaded(tmp_path, None)
    frame = pd.DataFrame({"content": [_png(0), b"not an image", base64.b64encode(_png(255)).decode(), "!!"]})
    out = model.predict(None, frame, params={"on_error": "null"})
    buf = io.StringIO()
    predictions_to_json(out, buf)
    answer = _strict_json(buf.getvalue())["predictions"]
    assert [p["probability"] is None for p in answer] == [False, True, False, True], answer
    assert [p["label_index"] is None for p in answer] == [False, True, False, True]
    assert 0 < answer[0]["probability"] <= 1 and answer[1]["error"] and answer[3]["error"]
    good = model.predict(None, frame.iloc[[0, 2]])  # no error row: plain float64, as before
    assert good["probability"].dtype == np.float64
    np.testing.assert_allclose(out["probability"][[0, 2]].astype(float), good["probability"])


def test_a_refusals_message_stays_the_projects_own_when_the_server_wraps_it():
    """MLflow's scoring server sets `e.message = f"Failed to predict data '{data}'. \\nError: {e.message}"` on any
    MlflowException: the 400 for one bad row echoed the whole request (megabytes of images) to the client and the
    log. The end-to-end check, through `mlflow models serve`, is in tests/integration/test_serving.py."""
    exc = InvalidModelInput("model input row 1, column 'content': not a decodable image")
    data = pd.DataFrame({"content": [b"A" * 5000] * 3})
    exc.message = f"Failed to predict data '{data}'. \nError: {exc.message}"  # what invocations() does
    assert exc.message == "model input row 1, column 'content': not a decodable image"
    body = json.loads(exc.serialize_as_json())
    assert body["message"] == exc.message and body["error_code"] == "INVALID_PARAMETER_VALUE"
    assert str(exc) == exc.message and exc.get_http_status_code() == 400
    exc.message = "another message"  # a message that does not wrap it replaces it
    assert exc.message == "another message"


def test_a_request_over_the_pixel_budget_is_refused_from_its_headers_before_any_row_is_decoded(tmp_path,
                                                                                             monkeypatch):
    monkeypatch.delenv(pyfunc.MAX_PIXELS_ENV, raising=False)
    decoded = []
    real = pyfunc.decode_batch
    monkeypatch.setattr(pyfunc, "decode_batch", lambda c, *a, **k: decoded.append(len(c)) or real(c, *a, **k))
    tiff = _tiff(8000)  # 64,000,000 pixels declared
    assert len(tiff) < 10_000
    model = _loaded(tmp_path, {"max_pixels_per_call": 100_000_000})  # what log_model(max_pixels_per_call=...) records
    assert model.max_pixels == (100_000_000, "set by the model's config max_pixels_per_call")
    frame = pd.DataFrame({"content": [_png(1), tiff, base64.b64encode(tiff).decode(), _png(2)]})
    for on_error in ("raise", "null"):  # the request is refused whatever the per-row error mode
        with pytest.raises(InvalidModelInput) as info:
            model.predict(None, frame, params={"on_error": on_error})
        assert info.value.get_http_status_code() == 400
        message = str(info.value)
        for needle in ("the 4 rows' headers declare 128,000,800 pixels in all", "budget of 100,000,000 pixels per "
                       "call (set by the model's config max_pixels_per_call)", "ran out at model input row 2, "
                       "column 'content'", "nothing was decoded"):
            assert needle in message, (needle, message)
    assert decoded == []
    # a JPEG counts from its frame header; rows that will not be decoded count nothing (junk, bad base64, and an
    # image over pipeline.images.MAX_PIXELS: the decoder refuses that row unread)
    jpeg = _jpeg(6000, 5000)
    over_bound = _tiff(9000)  # 81,000,000 > MAX_PIXELS
    ok = pd.DataFrame({"content": [jpeg, b"junk", "!!", over_bound, tiff, _png(3)]})
    out = model.predict(None, ok, params={"on_error": "null"})
    assert [e is None for e in out["error"]] == [True, False, False, False, True, True], list(out["error"])
    assert "too many pixels" in out["error"][3]
    with pytest.raises(InvalidModelInput, match=r"the 3 rows' headers declare 90,000,000 pixels in all, over .* "
                                                r"ran out at model input row 'c'"):
        _loaded(tmp_path, {"max_pixels_per_call": 64_000_000}).predict(
            None, pd.DataFrame({"content": [jpeg] * 3}, index=["a", "b", "c"]))

    # the default budget, and the server's environment over the model's config
    assert pyfunc.MAX_PIXELS_PER_CALL == 2_000_000_000 and pyfunc.MAX_PIXELS_ENV == "LAKEHOUSE_SERVING_MAX_PIXELS"
    assert _loaded(tmp_path, {"max_rows_per_call": 300}).max_pixels == (
        2_000_000_000, "set by pipeline.tracking.pyfunc.MAX_PIXELS_PER_CALL")
    monkeypatch.setenv(pyfunc.MAX_PIXELS_ENV, "70000000")
    served = _loaded(tmp_path, {"max_pixels_per_call": 10**12})
    with pytest.raises(InvalidModelInput, match=r"budget of 70,000,000 pixels per call \(set by "
                                                r"LAKEHOUSE_SERVING_MAX_PIXELS\); it ran out at model input row 1"):
        served.predict(None, pd.DataFrame({"content": [tiff, tiff]}), params={"on_error": "null"})
    assert len(served.predict(None, pd.DataFrame({"content": [tiff, _png(4)]}))) == 2
    for bad in ("0", "-1", "lots", "2e9"):
        monkeypatch.setenv(pyfunc.MAX_PIXELS_ENV, bad)
        with pytest.raises(ValueError, match=rf"LAKEHOUSE_SERVING_MAX_PIXELS={bad!r} is not a positive whole"):
            _loaded(tmp_path, None)
    monkeypatch.delenv(pyfunc.MAX_PIXELS_ENV)
    for bad in (0, "10", True, 2.5):
        with pytest.raises(ValueError, match=r"model config key 'max_pixels_per_call': .* is not a positive whole"):
            _loaded(tmp_path, {"max_pixels_per_call": bad})


def test_log_model_refuses_a_pixel_budget_under_one_image_of_the_bound():
    from pipeline.images import MAX_PIXELS

    net = build_network("cnn", 1, 3, width=4)
    for bad in (MAX_PIXELS - 1, 0, True, "2000000000"):
        with pytest.raises(ValueError, match=rf"max_pixels_per_call={bad!r}: .*at least {MAX_PIXELS:,}"):
            pyfunc.log_model(net, META, max_pixels_per_call=bad, run_id="never-looked-up")


def test_load_pyfunc_lifts_the_budget_for_the_projects_batch_callers(tmp_path, monkeypatch):
    """The gate scores its own table in calls of PREDICT_BATCH_SIZE rows through load_pyfunc: never refused by the
    served model's budget (256 photos of 24 MP declare 6.1 G pixels), unless the environment sets one."""
    import mlflow.pyfunc

    monkeypatch.delenv(pyfunc.MAX_PIXELS_ENV, raising=False)
    inner = _loaded(tmp_path, None)

    class Loaded:
        def unwrap_python_model(self):
            return inner

    monkeypatch.setattr(mlflow.pyfunc, "load_model", lambda uri, suppress_warnings=False: Loaded())
    pyfunc.load_pyfunc("models:/m/1")
    assert inner.max_pixels[0] == pyfunc.PREDICT_BATCH_SIZE * 64_000_000
    monkeypatch.setenv(pyfunc.MAX_PIXELS_ENV, "70000000")
    inner.max_pixels = (70_000_000, "set by LAKEHOUSE_SERVING_MAX_PIXELS")
    pyfunc.load_pyfunc("models:/m/1")
    assert inner.max_pixels[0] == 70_000_000


@pytest.mark.filterwarnings("ignore:.*input example was not provided")
def test_a_badly_typed_param_is_refused_by_name_and_only_the_dataframe_forms_keep_the_answer_short(tmp_path):
    """Through MLflow's scoring server code (`invocations`, as `mlflow models serve` runs it) with the project's
    signature. A param value of the right type that the model does not take is the model's own short 400. A value of
    another JSON type is refused by MLflow's signature check before the model runs (MLflow 3.17 has no param type
    that takes any value): the answer names the param, and MLflow puts the parsed request in front of it, which pandas
    shortens in the dataframe forms (the documented ones) and numpy does not in `inputs` (a 4 MB answer for a 4 MB
    row: docs/registry-and-serving.md says to send only the dataframe forms; this test notices if MLflow changes)."""
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    (tmp_path / "meta.json").write_text(json.dumps(META))
    torch.manual_seed(0)
    torch.save(build_network("cnn", 1, 3, width=4).state_dict(), tmp_path / "weights.pt")
    mlflow.pyfunc.save_model(str(tmp_path / "model"), python_model=ImageClassifierModel(),
                             artifacts={"meta": str(tmp_path / "meta.json"), "weights": str(tmp_path / "weights.pt")},
                             signature=pyfunc.model_signature())
    model = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    big = base64.b64encode(np.random.default_rng(0).bytes(3_000_000)).decode()  # a 4 MB row

    def answer(body):
        try:
            scoring_server.invocations(json.dumps(body), "application/json", model, model.metadata.get_input_schema())
        except MlflowException as exc:
            return exc.get_http_status_code(), exc.message
        return 200, ""

    for form in ({"dataframe_split": {"columns": ["content"], "data": [[big]]}},
                 {"dataframe_records": [{"content": big}]}):
        for params, needle in (({"max_rows": 0}, "param 'max_rows': 0 is not a positive whole number"),
                               ({"on_error": "ignore"}, "param 'on_error': 'ignore' is not one of raise, null")):
            assert answer({**form, "params": params}) == (400, needle)
        for params, name in (({"max_rows": "x"}, "max_rows"), ({"on_error": 5}, "on_error")):
            status, message = answer({**form, "params": params})
            assert status == 400 and "Invalid parameters found" in message and f"'{name}'" in message, message[:300]
            assert len(message) < 2_000, len(message)
    status, message = answer({"inputs": {"content": [big]}, "params": {"max_rows": "x"}})
    assert status == 400 and len(message) > 4_000_000  # MLflow's limitation, documented: send the dataframe forms
