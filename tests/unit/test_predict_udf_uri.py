"""`lakehouse predict`'s scoring UDF carries no tracking URI to the executors: mlflow.pyfunc.spark_udf reads
mlflow.get_tracking_uri() when it builds the UDF and ships it inside the UDF to every executor, so a tracking server's
credentials (http://user:password@host) reached each of them, which never needs it (env_manager=local: an executor
loads the copy of the model spark_udf ships). The UDF is now built from the downloaded version while the URI is
withheld (its redacted form): here the redaction is made to answer a URI no store has, so the test sees both that
spark_udf never saw the real one and that the executors score without it."""
import io
import os

import mlflow
import pytest

import pipeline.redact as redact

WITHHELD = "withheld://no-tracking-store-here"


def _png(value: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (20, 20), value).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture()
def registered(tmp_path):
    """A CNN logged with the project's pyfunc into a SQLite store and registered as `udf_clf` version 1; the
    process's tracking URI is that store's for the test and put back after it."""
    import torch
    from mlflow import MlflowClient

    from pipeline.model.nets import build_network
    from pipeline.serving.models import resolve
    from pipeline.tracking.pyfunc import log_model

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    # the process's own settings as they were (None where nothing was set: a registry URI read back and set again
    # would pin every later test's registry to this store's predecessor)
    before = (tracking_utils._tracking_uri, registry_utils._registry_uri, os.environ.get("MLFLOW_TRACKING_URI"),
              os.environ.get("MLFLOW_REGISTRY_URI"))  # set_registry_uri sets the variable too
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        client = MlflowClient(uri, uri)
        experiment = client.create_experiment("udf", artifact_location=str(tmp_path / "artifacts"))
        run_id = client.create_run(experiment).info.run_id
        torch.manual_seed(0)
        meta = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": ["a", "b", "c"]}
        model_uri = log_model(build_network("cnn", 1, 3, width=4).eval(), meta, run_id=run_id)
        client.create_registered_model("udf_clf")
        client.create_model_version("udf_clf", model_uri, run_id=run_id, model_id=model_uri.split("/")[-1])
        yield uri, resolve(client, "models:/udf_clf/1")
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri = before[0], before[1]
        for name, value in (("MLFLOW_TRACKING_URI", before[2]), ("MLFLOW_REGISTRY_URI", before[3])):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_the_scoring_udf_is_built_and_scores_without_the_tracking_uri(spark, registered, monkeypatch):
    from pyspark import cloudpickle

    from pipeline.serving.predict import scored_frame

    uri, pinned = registered
    real_redact, real_spark_udf = redact.redact_url, mlflow.pyfunc.spark_udf
    monkeypatch.setattr(redact, "redact_url", lambda text: WITHHELD if text == uri else real_redact(text))
    seen = {}

    def recording_spark_udf(*args, **kwargs):
        seen["uri"] = mlflow.get_tracking_uri()
        seen["udf"] = real_spark_udf(*args, **kwargs)
        return seen["udf"]

    monkeypatch.setattr(mlflow.pyfunc, "spark_udf", recording_spark_udf)
    df = spark.createDataFrame([(f"/p/{i}.png", bytearray(_png(40 * i))) for i in range(4)] + [("/p/bad", b"no")],
                               "path string, content binary")
    rows = {r["path"]: r for r in scored_frame(spark, df, pinned, "t", 0).collect()}
    assert seen["uri"] == WITHHELD, "spark_udf was built with the process's tracking URI"
    shipped = cloudpickle.dumps(seen["udf"].__wrapped__.func)  # what Spark sends each executor with a task
    assert uri.encode() not in shipped and WITHHELD.encode() in shipped
    # the executors set the withheld URI and score all the same: they never needed one
    assert all(rows[f"/p/{i}.png"]["label"] in ("a", "b", "c") for i in range(4)), rows
    assert rows["/p/bad"]["label"] is None and "not a decodable image" in rows["/p/bad"]["error"]
    assert mlflow.get_tracking_uri() == uri and os.environ.get("MLFLOW_TRACKING_URI") == uri  # put back


def test_the_withheld_uri_is_the_redacted_one_and_is_put_back(monkeypatch):
    from pipeline.serving.predict import tracking_uri_withheld

    secret_uri = "http://tester:SUPERSECRET321@127.0.0.1:5000"
    from mlflow.tracking._tracking_service import utils as tracking_utils

    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)  # put back as it was
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        mlflow.set_tracking_uri(secret_uri)
        os.environ.pop("MLFLOW_TRACKING_URI", None)  # set by set_tracking_uri: unset, as where none was exported
        with tracking_uri_withheld() as withheld:
            assert withheld == mlflow.get_tracking_uri() == "http://tester:***@127.0.0.1:5000"
        assert mlflow.get_tracking_uri() == secret_uri and "MLFLOW_TRACKING_URI" not in os.environ
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
