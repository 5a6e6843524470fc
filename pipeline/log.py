"""Rank-aware logging and the one rank-zero check every side effect goes through."""
from __future__ import annotations

import logging
import os
import sys
import warnings

from pipeline.redact import redact_url

_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK", "PMI_RANK")


def current_rank() -> int:
    """The global rank of this process (0 outside any distributed job).

    Asks Horovod or torch.distributed only when this process already imported them: logging must
    never pay for importing torch.
    """
    if "horovod.torch" in sys.modules:
        try:
            hvd = sys.modules["horovod.torch"]
            if hvd.is_initialized():
                return hvd.rank()
        except Exception:  # not initialised
            pass
    if "torch.distributed" in sys.modules:
        try:
            dist = sys.modules["torch.distributed"]
            if dist.is_available() and dist.is_initialized():
                return dist.get_rank()
        except Exception:
            pass
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def is_rank_zero() -> bool:
    return current_rank() == 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        # py4j reports at INFO, with a traceback, that a forked launcher process closed its inherited
        # copy of the gateway socket; the session is unaffected (seen with horovod.run and spark.stop()).
        if record.levelno <= logging.INFO and str(record.msg).startswith("Exception while sending command"):
            return False
        return True


class _RedactingFormatter(logging.Formatter):
    """The line as formatted, traceback included, with every URL's password and secret query values hidden
    (`redact_url`): a library's error quotes the URL it failed on (MLflow's `API request to http://user:pw@host/...
    failed`), and a log line is written outward like a tag."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_url(super().format(record))


def setup_logging(level: str = None) -> None:
    """Configure the root logger once: `time level [rank N] logger: message` on stderr."""
    level = level or os.environ.get("LAKEHOUSE_LOG_LEVEL", "INFO")
    root = logging.getLogger()
    if any(getattr(h, "_lakehouse", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._lakehouse = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter())
    handler.setFormatter(_RedactingFormatter("%(asctime)s %(levelname)s [rank %(rank)s] %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    # MLflow's own output bypasses this handler: at import it gives its loggers a handler of their own that does not
    # propagate, and a REST client prints "View run at <tracking URI>", credentials and all, to stdout when a run ends.
    # Its loggers propagate to this handler instead (where MLflow is imported after this), and the print is off.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    for noisy in ("py4j", "urllib3", "alembic", "mlflow.store", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Petastorm warns about small Parquet files and float64 -> float32 on every conversion; the
    # project sizes its files per rank on purpose, so only its errors are shown.
    logging.getLogger("petastorm").setLevel(logging.ERROR)
    quiet_third_party_warnings()


def quiet_third_party_warnings() -> None:
    """Hide the known, harmless warning noise of the pinned stack (Petastorm on pyarrow 14, Lightning hints)."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*pyarrow.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"petastorm(\.|$)")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*Your `IterableDataset` has `__len__` defined.*")
    warnings.filterwarnings("ignore", message=r".*The number of training batches.*is smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=r".*`isinstance\(treespec, LeafSpec\)` is deprecated.*")


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def flush_and_exit(code: int) -> None:
    """Flush the log handlers and the standard streams, then end the process with `code` at once, without the
    interpreter's teardown (its exit handlers and module clean-up): for a process whose work is done or lost."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
