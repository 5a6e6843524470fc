"""Metrics to a run by id: one epoch's values as MLflow entities, sent synchronously or through MLflow's asynchronous
logging and watched with a bound (a server that accepts and never answers never blocks the caller)."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

from mlflow import MlflowClient
from mlflow.entities import Metric


def epoch_metrics(metrics: Dict[str, float], step: int, timestamp_ms: Optional[int] = None) -> List[Metric]:
    """One epoch's metrics as MLflow entities at `step` (NaN and inf are kept, so a divergence shows). A fixed
    `timestamp_ms` makes a value sent twice (a retry whose first answer was lost) one value on an SQL store."""
    ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
    items: List[Metric] = []
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} at step {step}: value {value!r} is not a number") from None
        items.append(Metric(str(key), number, ts, int(step)))
    return items


def log_epoch_metrics(client: MlflowClient, run_id: str, metrics: Dict[str, float], step: int,
                      timestamp_ms: Optional[int] = None) -> None:
    """Log one epoch's metrics at `step` in one batch, waiting for the server (see `send_metrics` for rank 0's way)."""
    items = epoch_metrics(metrics, step, timestamp_ms)
    for start in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[start:start + 1000], synchronous=True)


def http_call_bound_s(env: Optional[Mapping[str, str]] = None) -> float:
    """The longest one MLflow HTTP call can take under the environment's settings (`pipeline.tracking.runs.http_bounds` sets them from
    `mlflow.retries`; MLflow's defaults otherwise): every attempt's MLFLOW_HTTP_REQUEST_TIMEOUT, urllib3's backoff
    before each retry (MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR x 2^n, at most 120 s, plus MLflow's jitter) and 1 s slack."""
    env = os.environ if env is None else env

    def number(key: str, default: float) -> float:
        try:
            return max(0.0, float(env.get(key, default)))
        except (TypeError, ValueError):
            return default

    retries = int(min(number("MLFLOW_HTTP_REQUEST_MAX_RETRIES", 7), 10))  # MLflow refuses more than 10
    timeout = number("MLFLOW_HTTP_REQUEST_TIMEOUT", 120)
    factor = number("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", 2)
    jitter = number("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", 1.0)
    backoff = sum(min(120.0, factor * 2 ** n) + jitter for n in range(retries))
    return (retries + 1) * timeout + backoff + 1.0


class Sending:
    """An asynchronous MLflow logging call (`synchronous=False`: MLflow's own queue and worker threads send it),
    watched without blocking. MLflow's RunOperations offers only `wait()`, which blocks without a bound; its futures
    (`_operation_futures`, there since async logging came in 2.8) give `done`, `error` and a bounded `wait`. An
    MLflow without them: one daemon thread waits on `wait()` for us."""

    def __init__(self, operations: Any = None, error: Optional[BaseException] = None) -> None:
        from concurrent.futures import Future

        self.started = time.monotonic()
        if error is not None:  # the call failed before anything was queued
            failed: Future = Future()
            failed.set_exception(error)
            self.futures = [failed]
            return
        futures = getattr(operations, "_operation_futures", None) if operations is not None else []
        if isinstance(futures, list) and all(isinstance(f, Future) for f in futures):
            self.futures = list(futures)
            return
        waited: Future = Future()

        def _wait() -> None:
            try:
                operations.wait()
                waited.set_result(None)
            except BaseException as exc:  # delivered through the future
                waited.set_exception(exc)

        threading.Thread(target=_wait, name="lakehouse-mlflow-wait", daemon=True).start()
        self.futures = [waited]

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def error(self) -> Optional[BaseException]:
        """The first failure among the finished parts (None: none failed, or still under way)."""
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None

    def wait(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` seconds; whether every part has finished (taken or failed)."""
        from concurrent.futures import wait

        wait(self.futures, timeout=max(0.0, timeout_s))
        return self.done()


def send_metrics(client: MlflowClient, run_id: str, items: List[Metric]) -> Sending:
    """Hand `items` to MLflow's asynchronous logging (`log_batch(..., synchronous=False)`, chunked by MLflow) and
    return at once; a call that fails before queueing anything comes back as a failed `Sending`, never raises. A
    client that logs synchronously and returns nothing counts as done."""
    try:
        return Sending(client.log_batch(run_id, metrics=items, synchronous=False))
    except Exception as exc:
        return Sending(error=exc)
