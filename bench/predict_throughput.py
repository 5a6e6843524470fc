"""Batch scoring throughput: rows/s of the product's `lakehouse predict` (predict_table) / rows/s of the same pyfunc
called directly in one process on the same rows."""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Tuple

import pandas as pd  # at module level: the pandas UDF's type hints (strings here) are resolved in this module

from bench.core import Result, Sizes, discarded, interleaved, load, median, ratio
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

BENCH_MODEL_SUFFIX = "-bench-predict"


def register_bench_model(cfg: Config, class_names: List[str]) -> str:
    """An untrained network of `model.arch` logged as the served pyfunc and registered; returns models:/<name>/<v>.

    The weights do not change the work per row (decode, forward, softmax), so no training is needed.
    """
    from pipeline.model.module import network_meta
    from pipeline.model.nets import build_network
    from pipeline.tracking.pyfunc import log_model
    from pipeline.tracking.registry import register_model
    from pipeline.tracking.runs import configure, experiment_id_of

    client = configure(cfg.mlflow)
    name = cfg.mlflow.registered_model + BENCH_MODEL_SUFFIX
    net = build_network(cfg.model.arch, cfg.data.channels, len(class_names), cfg.model.width).eval()
    run_id = client.create_run(experiment_id_of(client, cfg.mlflow.experiment),
                               tags={"bench": "predict_throughput"}).info.run_id
    uri = log_model(net, network_meta(cfg.model, cfg.data.channels, cfg.data.image_size, class_names), run_id=run_id)
    version = register_model(client, uri, name, run_id, {"bench": "predict_throughput"})
    client.set_terminated(run_id)
    return f"models:/{name}/{version}"


def _contents_and_classes(table: str) -> Tuple[List[bytes], List[str]]:
    from deltalake import DeltaTable

    from pipeline.lakehouse.delta import table_uri

    rows = DeltaTable(table_uri(table)).to_pyarrow_table(columns=["content", "label"])
    return rows.column("content").to_pylist(), sorted({str(v) for v in rows.column("label").to_pylist()})


def spark_job_floor(spark, cfg: Config, table: str, out: str) -> float:
    """Seconds of a Spark job with predict's shape that scores nothing: the pinned Delta read, `content` through an
    Arrow pandas UDF that returns its length (the same transfer to and from the Python workers, on the same tasks),
    and a Parquet write. What every `lakehouse predict` call pays whatever the model and however few the rows."""
    from pyspark.sql import functions as F
    from pyspark.sql.functions import pandas_udf

    from pipeline.lakehouse.delta import get_engine
    from pipeline.serving.predict import partitions_for_scoring

    @pandas_udf("long")
    def nothing(content: pd.Series) -> pd.Series:
        return content.str.len()

    t0 = time.perf_counter()
    df, _ = get_engine(cfg.delta.engine).read(spark, table)
    partitions_for_scoring(spark, df).select("path", nothing(F.col("content")).alias("n")) \
        .write.mode("overwrite").parquet(out)
    return time.perf_counter() - t0


def score_directly(model, frame: pd.DataFrame, max_rows: int) -> int:
    """Score `frame` with the pyfunc in calls of at most `max_rows` rows (the model's limit per call, as a client must
    send them); the rows scored."""
    scored = 0
    for start in range(0, len(frame), max_rows):
        scored += len(model.predict(frame.iloc[start:start + max_rows], params={"on_error": "null"}))
    return scored


def measure_predict_throughput(spark, cfg: Config, dataset: str, table: str, sizes: Sizes, work_dir: str) -> Result:
    """`repeats` interleaved pairs, after one untimed call of each: predict_table(table -> a scratch Delta table,
    overwrite) in `spark`, timed around the call (Delta read, spark_udf, write, commit, row check), and
    `pyfunc.predict` on every row of the table in this process (model loaded once, untimed).

    The untimed first predict_table is the cold start a fresh `lakehouse predict` process pays (Python workers
    importing torch and mlflow); it is reported as `cold_rows_per_s`, not in the ratio. `spark_job_floor_s` is the
    median of `repeats` runs of `spark_job_floor` on the same table: the part of a predict call no model can save.
    """
    from pipeline.tracking.pyfunc import MAX_ROWS_PER_CALL, load_pyfunc

    from pipeline.serving.predict import predict_table

    contents, classes = _contents_and_classes(table)
    frame = pd.DataFrame({"content": contents})
    scratch = os.path.join(work_dir, f"predict_{dataset}")
    out, floor_out = os.path.join(scratch, "out"), os.path.join(scratch, "floor")
    name = cfg.mlflow.registered_model + BENCH_MODEL_SUFFIX
    parts: Dict[str, Any] = {"rows": len(contents), "spark_master": cfg.spark.master,
                             "cores": spark.sparkContext.defaultParallelism, "load_before": load()}
    with discarded(scratch, cfg.mlflow, name):
        model_uri = register_bench_model(cfg, classes)
        model = load_pyfunc(model_uri)
        model.predict(frame.head(64), params={"on_error": "null"})  # warm-up: first-call allocations

        def direct() -> float:
            t0 = time.perf_counter()
            score_directly(model, frame, MAX_ROWS_PER_CALL)
            return len(frame) / (time.perf_counter() - t0)

        def product() -> float:
            t0 = time.perf_counter()
            result = predict_table(spark, cfg, model_uri, table, out, mode="overwrite")
            seconds = time.perf_counter() - t0
            if result["rows"] != len(frame):
                raise RuntimeError(f"predict wrote {result['rows']} rows for {len(frame)} input rows")
            return len(frame) / seconds

        parts["cold_rows_per_s"] = product()
        pyfunc_rates, predict_rates = interleaved(direct, product, sizes.repeats)
        spark_job_floor(spark, cfg, table, floor_out)  # warm-up
        floors = [spark_job_floor(spark, cfg, table, floor_out) for _ in range(sizes.repeats)]
    parts.update({"predict_rows_per_s": median(predict_rates), "pyfunc_rows_per_s": median(pyfunc_rates),
                  "predict_per_repeat": predict_rates, "pyfunc_per_repeat": pyfunc_rates, "load_after": load(),
                  "spark_job_floor_s": median(floors), "spark_job_floor_per_repeat": floors})
    parts["predict_s"] = len(frame) / parts["predict_rows_per_s"]
    parts["pyfunc_s"] = len(frame) / parts["pyfunc_rows_per_s"]
    per_repeat = [ratio(p, d) for p, d in zip(predict_rates, pyfunc_rates)]
    value = ratio(parts["predict_rows_per_s"], parts["pyfunc_rows_per_s"])
    log.info("predict throughput on %s (%d rows): lakehouse predict %.0f rows/s (cold %.0f), pyfunc %.0f rows/s, "
             "ratio %.2f", dataset, len(frame), parts["predict_rows_per_s"], parts["cold_rows_per_s"],
             parts["pyfunc_rows_per_s"], value)
    note = (f"a Spark job of predict's shape that scores nothing takes {parts['spark_job_floor_s']:.2f} s here, "
            f"against {parts['pyfunc_s']:.2f} s for the pyfunc on all {len(frame)} rows: a table this small does not "
            f"amortise it (predict {parts['predict_s']:.2f} s)")
    return Result("predict_throughput", dataset, value, parts, sizes.repeats, per_repeat, note=note)
