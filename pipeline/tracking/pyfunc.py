"""The servable model: an MLflow pyfunc that maps encoded image bytes to class labels, and how it is logged."""
from __future__ import annotations

import base64
import contextlib
import binascii
import io
import json
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import mlflow
import mlflow.pyfunc
from mlflow.exceptions import MlflowException
import numpy as np
import pandas as pd
import torch

from pipeline.data.transforms import decode_batch
from pipeline.images import MAX_PIXELS, ImageDecodeError, jpeg_frame, opened
from pipeline.log import get_logger
from pipeline.model.nets import build_network
from pipeline.tracking.served_code import (MODEL_CODE, SERVED_MODULES, copy_served_code,  # noqa: F401
                                          pip_requirements, served_package_name)

log = get_logger(__name__)

_LOAD_LOCK = threading.Lock()


def load_pyfunc(model_uri: str, check_requirements: bool = True):
    """`mlflow.pyfunc.load_model(model_uri)` in a process that goes on working. `check_requirements=False`: without
    MLflow's warning about the model's pip requirements and this environment (0.7 s: it maps every installed
    distribution to its modules), for a caller that scores in the environment that trains (the promotion gate).

    MLflow prepends the model's code
    folder to sys.path for good, so processes spawned afterwards (Horovod ranks, the bench's controls) would search it
    first (a model logged before served_package_name holds a partial copy of `pipeline` there, which would hide the
    rest of the package). The modules the model needs are imported while it loads, so sys.path is put back once it
    has.

    One load at a time per process: a models-from-code model is handed over through a module global
    (`mlflow.models.set_model`), so two threads loading at once can both get the same model (seen: two promotion
    gates in one process scored two versions with one network); sys.path is process-wide too.

    The callers (the promotion gate, the registry review) score the project's own tables in calls of at most
    PREDICT_BATCH_SIZE rows: the served model's per-call pixel budget (pixel_budget, a guard for a server) is lifted
    to BATCH_MAX_PIXELS_PER_CALL, unless MAX_PIXELS_ENV is set where they run."""
    with _LOAD_LOCK, _sys_path_kept():
        model = mlflow.pyfunc.load_model(model_uri, suppress_warnings=not check_requirements)
    try:
        inner = model.unwrap_python_model()
    except Exception:  # not a python_function model of ours (another flavor): nothing to lift
        inner = None
    if isinstance(getattr(inner, "max_pixels", None), tuple) and not os.environ.get(MAX_PIXELS_ENV, "").strip():
        inner.max_pixels = (max(inner.max_pixels[0], BATCH_MAX_PIXELS_PER_CALL),
                            "lifted for batch scoring by pipeline.tracking.pyfunc.load_pyfunc")
    return model


CONTENT_COLUMN = "content"
OUTPUT_COLUMNS = ("label", "label_index", "probability", "probabilities")
ERROR_COLUMN = "error"
# params["on_error"]: "raise" (default: a bad row fails the call, naming the row) or "null" (a bad row
# gets null label/probabilities and its reason in an extra `error` column: batch scoring).
ON_ERROR_MODES = ("raise", "null")
META_KEYS = ("arch", "width", "channels", "image_size", "class_names")
PREDICT_BATCH_SIZE = 256
# The most rows one call scores (see row_limit: set when the model is logged or the server starts; a request's
# params["max_rows"] may lower it, never raise it): a served request over it is answered 400 before any row is decoded,
# so one request's time is bounded (every row's pixels are bounded by pipeline.images). Batch scoring and the gate
# call with PREDICT_BATCH_SIZE rows or fewer, so a logged limit is at least that.
MAX_ROWS_PER_CALL, MAX_ROWS_CONFIG_KEY, MAX_ROWS_ENV = 10_000, "max_rows_per_call", "LAKEHOUSE_SERVING_MAX_ROWS"
# The most pixels one call may decode, summed over its rows as their headers declare them (see pixel_budget: set like
# the row limit, when the model is logged or the server starts). Every row is bounded by pipeline.images.MAX_PIXELS,
# but a request of many small files that each declare a large image (a 2.6 KB Group-4 TIFF declaring 8000x8000 costs
# 0.15 s and 65 MB to decode) would cost minutes of CPU within the row limit; the headers are read first (microseconds
# a row, nothing decoded) and a request over the budget is refused before any row is decoded. 2,000,000,000: the
# default row limit (10,000) of ImageNet-sized photos (~500x375 = 187,500 pixels each, 1.9 G in all), or 31 images of
# the 64 MP bound (a few seconds of decoding). The project's batch callers (predict's spark_udf, the promotion gate
# through load_pyfunc) score their own tables in calls of PREDICT_BATCH_SIZE rows and lift it to
# BATCH_MAX_PIXELS_PER_CALL, what such a call declares at most (a row over MAX_PIXELS is never decoded).
MAX_PIXELS_PER_CALL, MAX_PIXELS_CONFIG_KEY = 2_000_000_000, "max_pixels_per_call"
MAX_PIXELS_ENV = "LAKEHOUSE_SERVING_MAX_PIXELS"
BATCH_MAX_PIXELS_PER_CALL = PREDICT_BATCH_SIZE * MAX_PIXELS


class InvalidModelInput(MlflowException, ValueError):
    """A request the model cannot score (bad row, missing column, bad param); the message names it.

    An MlflowException with INVALID_PARAMETER_VALUE, so `mlflow models serve` answers HTTP 400 with the
    message (no stack trace); also a ValueError for Python callers.

    MLflow's scoring server rewrites an MlflowException's message as `Failed to predict data '<the whole request>'.
    Error: <message>` before answering (mlflow/pyfunc/scoring_server `invocations`): a 400 for one bad row would echo
    every row of the request (megabytes of base64 images) into the response and the server's log. The `message`
    setter keeps the project's own message: a value that merely wraps it is dropped.
    """

    def __init__(self, message: str) -> None:
        from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._own_message

    @message.setter
    def message(self, value: str) -> None:
        value = str(value)
        own = getattr(self, "_own_message", None)
        if own is not None and value != own and own in value:  # the server's wrapping of it: the request's data
            return
        self._own_message = value


class InvalidImageField(ValueError):
    """A `content` value is neither image bytes nor a base64 string of them."""


_BASE64_TEXT = re.compile(rb"[A-Za-z0-9+/=\s]+")


def image_bytes(content: Any) -> bytes:
    """The encoded image in one `content` value: raw bytes, or base64 text (str, or bytes of base64 characters).

    Base64 text arrives as bytes when a server request uses `instances`/`inputs`: MLflow base64-decodes a
    binary column only in the `dataframe_split`/`dataframe_records` forms. Encoded images (PNG, JPEG, GIF,
    BMP, WebP) start with bytes outside the base64 alphabet, so the two cannot be confused.
    """
    if isinstance(content, (bytearray, memoryview)):
        content = bytes(content)
    if isinstance(content, str):
        given_str, content = True, content.encode("ascii", errors="replace")
        if not _BASE64_TEXT.fullmatch(content):
            raise InvalidImageField("a string that is not base64 (characters outside A-Z a-z 0-9 + / =)")
    elif isinstance(content, bytes):
        given_str = False
        if not content or _BASE64_TEXT.fullmatch(content) is None:
            return content  # raw image bytes (or junk, which the decoder names)
    else:
        raise InvalidImageField(f"expected encoded image bytes or a base64 string, got {type(content).__name__}")
    try:
        return base64.b64decode(re.sub(rb"\s+", b"", content), validate=True)
    except (binascii.Error, ValueError) as exc:
        what = "a string" if given_str else "not a decodable image, and"
        raise InvalidImageField(f"{what} not valid base64 ({exc})") from None


def check_meta(meta: Dict[str, Any]) -> Dict[str, Any]:
    """Validate the model metadata; raise ValueError naming the missing or bad key."""
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"model meta is missing key(s) {', '.join(missing)}; got keys {sorted(meta)}")
    names = meta["class_names"]
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError(f"model meta key 'class_names' must be a non-empty list, got {names!r}")
    for key in ("width", "channels", "image_size"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 1:
            raise ValueError(f"model meta key '{key}' must be a positive int, got {meta[key]!r}")
    crop = meta.get("center_crop")
    if crop is not None and (isinstance(crop, bool) or not isinstance(crop, (int, float)) or not 0 < crop <= 1):
        raise ValueError(f"model meta key 'center_crop' must be a share in (0, 1] or absent, got {crop!r}")
    out = dict(meta)
    out["class_names"] = [str(n) for n in names]
    return out


def _whole(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= 1


def _served_limit(model_config: Optional[Dict[str, Any]], key: str, env_name: str, default: int,
                  default_name: str) -> Tuple[int, str, bool]:
    """(value, what set it, whether the model records one) of one of the served model's per-call limits: `env_name`
    in the environment where the model loads (the server's), else the model config's `key` (what log_model recorded,
    or what a loader passed as model_config), else `default` (a model logged before it was recorded). ValueError
    names a bad one."""
    recorded = (model_config or {}).get(key)
    env = os.environ.get(env_name, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{env_name}={os.environ[env_name]!r} is not a positive whole number")
        return int(env), f"set by {env_name}", recorded is not None
    if recorded is None:
        return default, f"set by pipeline.tracking.pyfunc.{default_name}", False
    if not _whole(recorded):
        raise ValueError(f"model config key '{key}': {recorded!r} is not a positive whole number")
    return int(recorded), f"set by the model's config {key}", True


def row_limit(model_config: Optional[Dict[str, Any]]) -> Tuple[int, str, bool]:
    """(limit, what set it, whether the model records one): the most rows one call scores (`_served_limit`:
    MAX_ROWS_ENV, else the model config's MAX_ROWS_CONFIG_KEY, else MAX_ROWS_PER_CALL)."""
    return _served_limit(model_config, MAX_ROWS_CONFIG_KEY, MAX_ROWS_ENV, MAX_ROWS_PER_CALL, "MAX_ROWS_PER_CALL")


def pixel_budget(model_config: Optional[Dict[str, Any]]) -> Tuple[int, str]:
    """(budget, what set it): the most pixels one call decodes, as the rows' headers declare them (`_served_limit`:
    MAX_PIXELS_ENV, else the model config's MAX_PIXELS_CONFIG_KEY, else MAX_PIXELS_PER_CALL)."""
    return _served_limit(model_config, MAX_PIXELS_CONFIG_KEY, MAX_PIXELS_ENV, MAX_PIXELS_PER_CALL,
                         "MAX_PIXELS_PER_CALL")[:2]


def declared_pixels(content: bytes) -> int:
    """The pixels (width x height) an encoded image's header declares, nothing decoded: the JPEG frame header
    (microseconds), else PIL's open (the header only). 0 for a row that will not be decoded: its header unreadable,
    declaring more than pipeline.images.MAX_PIXELS, or a JPEG of more than pipeline.images.MAX_JPEG_SCANS scans
    (jpeg_frame answers None for it and `opened` refuses it: the decoder refuses it unread, naming it)."""
    frame = jpeg_frame(content)
    if frame is not None:
        pixels = frame[0] * frame[1]
        return pixels if pixels <= MAX_PIXELS else 0
    try:
        with opened(content) as img:
            return int(img.width) * int(img.height)
    except ImageDecodeError:
        return 0


def _image_bytes_or_none(content: Any) -> Optional[bytes]:
    try:
        return image_bytes(content)
    except InvalidImageField:
        return None  # named by the decode, row by row


def check_pixel_budget(encoded: Iterable[Optional[bytes]], index: List[Any], budget: int, source: str) -> None:
    """Refuse a call whose rows' headers declare more than `budget` pixels in all, before any row is decoded.
    `encoded`: each row's image bytes, or None for a row that is not image bytes (the decoder names it later), in
    the order of `index`.

    Raises:
        InvalidModelInput: naming the budget (and what set it), the rows' total and the row where it ran out.
    """
    total, ran_out = 0, None
    for i, content in enumerate(encoded):
        if content is None:
            continue
        total += declared_pixels(content)
        if ran_out is None and total > budget:
            ran_out = i
    if ran_out is not None:
        raise InvalidModelInput(f"the {len(index):,} rows' headers declare {total:,} pixels in all, over this "
                                f"model's budget of {budget:,} pixels per call ({source}); it ran out at model input "
                                f"row {index[ran_out]!r}, column '{CONTENT_COLUMN}'; nothing was decoded: send "
                                f"fewer or smaller images per request")


class ImageClassifierModel(mlflow.pyfunc.PythonModel):
    """Classify encoded images (PNG/JPEG bytes in a `content` column) with the trained network."""

    def load_context(self, context: Any) -> None:
        """Rebuild the network from the `meta` artifact and load the `weights` state_dict; read the row limit."""
        self.max_rows = row_limit(context.model_config)
        self.max_pixels = pixel_budget(context.model_config)
        with open(context.artifacts["meta"]) as fh:
            self.meta = check_meta(json.load(fh))
        self.class_names: List[str] = self.meta["class_names"]
        net = build_network(self.meta["arch"], self.meta["channels"], len(self.class_names), self.meta["width"])
        state = torch.load(context.artifacts["weights"], map_location="cpu", weights_only=True)
        net.load_state_dict(state)
        net.eval()
        self.network = net

    def predict(self, context: Any, model_input: pd.DataFrame, params: Optional[Dict[str, Any]] = None) -> pd.DataFrame:
        """Return one row per input row: label, label_index, probability, probabilities (+ error when on_error=null)."""
        on_error = (params or {}).get("on_error") or "raise"
        if on_error not in ON_ERROR_MODES:
            raise InvalidModelInput(f"param 'on_error': {on_error!r} is not one of {', '.join(ON_ERROR_MODES)}")
        limit, source, recorded = getattr(self, "max_rows", None) or row_limit(None)
        max_rows = (params or {}).get("max_rows")
        if max_rows is not None and not _whole(max_rows):
            raise InvalidModelInput(f"param 'max_rows': {max_rows!r} is not a positive whole number")
        if max_rows == 10_000 and not recorded:  # a model logged before row_limit: MLflow filled in its signature's
            max_rows = None  # default, 10,000, where the request gave none
        if max_rows is not None and max_rows > limit:
            raise InvalidModelInput(f"param 'max_rows': {int(max_rows):,} is over this model's limit of {limit:,} "
                                    f"rows per call ({source}); a request may lower it, never raise it")
        if not isinstance(model_input, pd.DataFrame):
            raise InvalidModelInput(f"model input must be a pandas DataFrame with a '{CONTENT_COLUMN}' column, "
                                    f"got {type(model_input).__name__}")
        if CONTENT_COLUMN not in model_input.columns:
            raise InvalidModelInput(f"model input has no '{CONTENT_COLUMN}' column (encoded image bytes); "
                                    f"got columns {list(map(str, model_input.columns))}")
        if len(model_input) > (limit if max_rows is None else max_rows):
            bound = f"{limit:,} rows per call ({source})" if max_rows is None else f"{max_rows:,} (param 'max_rows')"
            raise InvalidModelInput(f"{len(model_input):,} rows in one call, over the limit of {bound}; send them in "
                                    f"smaller requests")
        contents = list(model_input[CONTENT_COLUMN])
        index = list(model_input.index)
        budget, budget_source = getattr(self, "max_pixels", None) or pixel_budget(None)
        # each row's bytes are made again in its chunk below: kept from here, they would double a large request's
        # memory (the request's base64 text is held until the call ends anyway)
        check_pixel_budget((_image_bytes_or_none(c) for c in contents), index, budget, budget_source)
        size, channels = self.meta["image_size"], self.meta["channels"]
        n_classes = len(self.class_names)
        probs = np.full((len(contents), n_classes), np.nan)
        errors: List[Optional[str]] = [None] * len(contents)
        with torch.no_grad():
            for start in range(0, len(contents), PREDICT_BATCH_SIZE):
                chunk = contents[start:start + PREDICT_BATCH_SIZE]
                pixels = np.empty((len(chunk), channels, size, size), dtype=np.float32)
                good: List[int] = []
                for i, content in enumerate(chunk):
                    try:
                        pixels[len(good)] = decode_batch([image_bytes(content)], size, channels,
                                                         center_crop=bool(self.meta.get("center_crop")))[0]
                        reason = None
                    except (ImageDecodeError, InvalidImageField) as exc:
                        reason = str(exc)
                    if reason is None:
                        good.append(start + i)
                    elif on_error == "raise":
                        raise InvalidModelInput(f"model input row {index[start + i]!r}, column "
                                                f"'{CONTENT_COLUMN}': {reason}")
                    else:
                        errors[start + i] = reason  # the output row is the input row: no index needed
                if good:
                    logits = self.network(torch.from_numpy(pixels[:len(good)]))
                    probs[good] = torch.softmax(logits, dim=1).cpu().numpy().astype(np.float64)
        ok = np.array([e is None for e in errors], dtype=bool)
        idx = np.where(np.isnan(probs), -1.0, probs).argmax(axis=1) if len(probs) else np.empty((0,), np.int64)
        idx = np.where(ok, idx, -1)
        rows = np.arange(len(idx))
        probability = probs[rows, np.maximum(idx, 0)] if len(idx) else np.empty((0,))
        out = pd.DataFrame({
            "label": [self.class_names[int(i)] if i >= 0 else None for i in idx],
            "label_index": idx.astype(np.int64) if ok.all() else pd.array(
                [int(i) if i >= 0 else None for i in idx], dtype="Int64"),
            # an error row's probability is a real null (pandas' nullable Float64, as label_index's Int64), not NaN:
            # MLflow's server writes NaN as the bare token NaN, which is not JSON (strict parsers refuse the answer)
            "probability": probability if ok.all() else pd.array(
                [float(p) if k else None for p, k in zip(probability, ok)], dtype="Float64"),
            "probabilities": [probs[r].tolist() if ok[r] else None for r in rows],
        }, index=model_input.index)
        if on_error == "null":
            out[ERROR_COLUMN] = errors
        return out


def model_signature() -> "mlflow.models.ModelSignature":
    """Input: a binary `content` column (base64 strings in JSON); output: label, label_index, probability,
    probabilities, and `error` (only with params on_error=null); params `on_error` (raise|null) and `max_rows` (none
    given: the model's limit, row_limit).

    The params keep their types (a string, a whole number): MLflow checks a request's params against these before the
    model runs, and MLflow 3.17 has no param type that passes any value (`string` refuses a number, `long` a string,
    `object` anything but a JSON object: mlflow.models.utils._enforce_param_datatype), so a value of another JSON type
    is MLflow's 400 (naming the param, after the request as MLflow prints it: short in the dataframe forms, whole in
    `inputs`/`instances`, which docs/registry-and-serving.md says not to send). Declared as strings, every client's
    `"max_rows": 500` would be refused that way instead. A value of the right type is checked in `predict`, which
    names the param in the model's own short message."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array

    inputs = Schema([ColSpec(DataType.binary, CONTENT_COLUMN)])
    outputs = Schema([
        ColSpec(DataType.string, "label"),
        ColSpec(DataType.long, "label_index"),
        ColSpec(DataType.double, "probability"),
        ColSpec(Array(DataType.double), "probabilities"),
        ColSpec(DataType.string, ERROR_COLUMN, required=False),
    ])
    params = ParamSchema([ParamSpec("on_error", DataType.string, "raise"),
                          ParamSpec("max_rows", DataType.long, None)])
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


def blank_png(size: int, channels: int) -> bytes:
    """A mid-grey PNG of the model's input size, used as the input example when none is given."""
    from PIL import Image

    img = Image.new("L" if channels == 1 else "RGB", (size, size), color=128 if channels == 1 else (128, 128, 128))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _check_weights_fit(state: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> None:
    """Fail at logging time, not at serving time, when the weights do not fit the network `meta` describes."""
    net = build_network(meta["arch"], meta["channels"], len(meta["class_names"]), meta["width"])
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"the network's weights do not fit meta (arch={meta['arch']!r}, width={meta['width']}, "
                         f"channels={meta['channels']}, {len(meta['class_names'])} classes): "
                         f"{str(exc).splitlines()[0]} (pass the plain nn.Module, not a wrapper)") from None


def log_model(network: torch.nn.Module, meta: Dict[str, Any], artifact_path: str = "model",
              input_example_content: Optional[bytes] = None, *, run_id: Optional[str] = None,
              step: int = 0, max_rows_per_call: int = MAX_ROWS_PER_CALL,
              max_pixels_per_call: int = MAX_PIXELS_PER_CALL) -> str:
    """Log `network` as an ImageClassifierModel into run `run_id` (default: the active run).

    The run's status is left as it is: the model is created as an MLflow 3 LoggedModel in the run's
    experiment with the run as its source, its artifacts uploaded, and linked to the run as an
    output, so both `models:/<model_id>` (returned) and `runs:/<run_id>/<artifact_path>` load it.
    Uses the current tracking URI (see `pipeline.tracking.runs.configure`). `max_rows_per_call`, the most rows one
    call scores, is recorded in the model's config (MAX_ROWS_CONFIG_KEY): a request may lower it, never raise it.
    `max_pixels_per_call`, the most pixels one call's rows may declare in all (pixel_budget), is recorded beside it
    (MAX_PIXELS_CONFIG_KEY).

    Returns:
        The model URI to register, `models:/<model_id>`.
    """
    from mlflow.models import Model

    if not _whole(max_rows_per_call) or max_rows_per_call < PREDICT_BATCH_SIZE:
        raise ValueError(f"max_rows_per_call={max_rows_per_call!r}: must be a whole number of at least "
                         f"{PREDICT_BATCH_SIZE} (the gate and batch scoring send up to {PREDICT_BATCH_SIZE} rows a "
                         f"call)")
    if not _whole(max_pixels_per_call) or max_pixels_per_call < MAX_PIXELS:
        raise ValueError(f"max_pixels_per_call={max_pixels_per_call!r}: must be a whole number of at least "
                         f"{MAX_PIXELS:,} (pipeline.images.MAX_PIXELS: one image of the largest size decoded)")
    meta = check_meta(meta)
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise ValueError("log_model needs run_id=... or an active MLflow run")
        run_id = active.info.run_id
    client = mlflow.MlflowClient()
    experiment_id = client.get_run(run_id).info.experiment_id
    example = input_example_content if input_example_content is not None else blank_png(meta["image_size"],
                                                                                         meta["channels"])
    with tempfile.TemporaryDirectory(prefix="lakehouse-model-") as tmp:
        tmp_path = Path(tmp)
        weights = tmp_path / "weights.pt"
        state = {k: v.detach().cpu() for k, v in network.state_dict().items()}
        _check_weights_fit(state, meta)
        torch.save(state, weights)
        meta_file = tmp_path / "meta.json"
        meta_file.write_text(json.dumps(meta, indent=2, sort_keys=True))
        code_pkg = copy_served_code(tmp_path / "code")
        # "Models from code": MLflow stores this file instead of a cloudpickle of the model object.
        model_code = tmp_path / "image_classifier.py"
        model_code.write_text(MODEL_CODE.format(package=code_pkg.name))
        # Created in the run's experiment with the run as source: mlflow.pyfunc.log_model alone
        # would put it in the fluent "current" experiment and, without an active run, link no run.
        logged = mlflow.initialize_logged_model(name=artifact_path, source_run_id=run_id, experiment_id=experiment_id,
                                                model_type="image-classifier")
        with _LOAD_LOCK, _sys_path_kept(first=code_pkg.parent):  # MLflow imports the model file while it logs
            info = Model.log(
                artifact_path=None,
                name=artifact_path,
                flavor=mlflow.pyfunc,
                run_id=run_id,
                model_id=logged.model_id,
                step=step,
                python_model=str(model_code),
                artifacts={"weights": str(weights), "meta": str(meta_file)},
                code_paths=[str(code_pkg)],
                signature=model_signature(),
                model_config={MAX_ROWS_CONFIG_KEY: int(max_rows_per_call),
                              MAX_PIXELS_CONFIG_KEY: int(max_pixels_per_call)},
                input_example=pd.DataFrame({CONTENT_COLUMN: [example]}),
                pip_requirements=pip_requirements(),
                metadata={"class_names": meta["class_names"], "image_size": meta["image_size"],
                          "channels": meta["channels"], "arch": meta["arch"]},
            )
    log.info("logged model %s into run %s (%s)", info.model_uri, run_id, artifact_path)
    return info.model_uri


@contextlib.contextmanager
def _sys_path_kept(first: Optional[Path] = None) -> Iterator[None]:
    """sys.path as it was after the block (MLflow prepends a model's code folder for good); `first`: put first on it
    for the block, as MLflow does where the model loads."""
    import sys

    path = list(sys.path)
    if first is not None:
        sys.path.insert(0, str(first))
    try:
        yield
    finally:
        sys.path[:] = path
