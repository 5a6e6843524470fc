"""What the ranks' processes get of the driver's environment: their own settings (threads, Horovod's stall and Gloo
timeouts), MLflow's bounded HTTP retries, a Databricks workspace's credentials for the rank that logs, on Spark
executors only the prefixes ranks need, never a variable named like a secret, and on a launcher's command line no
secret at all."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from pipeline.config import Config
from pipeline.log import get_logger
from pipeline.redact import TRACKING_CREDENTIALS, WORKSPACE_CREDENTIALS, is_secret, is_secret_key

log = get_logger(__name__)


def rank_env(config: Config) -> dict:
    """The settings every rank of a job with `config` runs with: threads, Horovod's stall and Gloo timeouts,
    progress output."""
    cfg = config.train
    env = {}
    # train.threads_per_rank, else 1 when several ranks share this machine (train.np < -1); otherwise each rank
    # picks its own in train() (threads_for_rank), since only it knows how many ranks share its host
    threads = cfg.threads_per_rank if cfg.threads_per_rank is not None else (1 if cfg.np < -1 else None)
    if threads is not None:
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return {
        **env,
        # A rank that stops taking part in collectives (dead peer, divergent code path) makes Horovod
        # shut the job down after this many seconds instead of hanging. Horovod shuts nothing down when the
        # shutdown time is below the check time, so the check comes at most every half of it. (A gloo CPU build
        # was not seen to shut down at all: the driver's own watchdog bounds a stuck rank, distributed/progress.py)
        **horovod_stall_env(cfg.stall_timeout_s),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(cfg.start_timeout_s),
        "LAKEHOUSE_PROGRESS": os.environ.get("LAKEHOUSE_PROGRESS", "1"),
        "PYTHONUNBUFFERED": "1",
    }


def horovod_stall_env(stall_timeout_s: int) -> Dict[str, str]:
    """Horovod's stall inspector for `train.stall_timeout_s`: a check every half of it (1 s to 60 s) and the shutdown
    at the bound itself, never before the first check (Horovod then disables the shutdown)."""
    stall = int(stall_timeout_s)
    check = max(1, min(60, stall // 2))
    return {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(check),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(max(stall, check))}


@contextmanager
def rank_environment(cfg: Config) -> Iterator[None]:
    """The ranks' settings (a job with `cfg`) in this process's environment (inherited by local rank processes) while
    they run; the driver's environment (a notebook's, say) is exactly as before afterwards."""
    wanted = rank_env(cfg)
    wanted.update(workspace_credentials(cfg.mlflow.tracking_uri, os.environ))
    # MLflow's own HTTP retries take minutes against a dead server; bound them by `mlflow.retries`
    # unless the user set them (rank 0 then fails at model logging and the run registers nothing).
    for key, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(cfg.mlflow.retries)),
                       ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")):
        wanted.setdefault(key, os.environ.get(key, value))
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# What Spark executors running ranks get of the driver's environment: the ranks' own settings and these prefixes
# (tracking, Horovod, CUDA/NCCL, Python paths); never the rest (tokens, credentials, a notebook's variables).
EXECUTOR_ENV_PREFIXES = ("LAKEHOUSE_", "MLFLOW_", "HOROVOD_", "NCCL_", "CUDA_", "OMP_", "MKL_", "PYTHON",
                         "DATABRICKS_RUNTIME_VERSION")


def workspace_credentials(tracking_uri: Optional[str], environ,
                          resolve: Optional[Callable[[str], dict]] = None) -> Dict[str, str]:
    """DATABRICKS_HOST / DATABRICKS_TOKEN for the ranks when MLflow tracks to a Databricks workspace (`databricks`,
    `databricks://<profile>`) and this driver's environment lacks them: a rank on a worker has no notebook context,
    profile or token of its own (HorovodRunner's tasks get the driver's environment only as far as `executor_env`,
    TorchDistributor's none: `with_env`), so rank 0 could not log there. Resolved on the driver the way MLflow hands
    them to its own child processes (`resolve`: mlflow.utils.databricks_utils.get_databricks_env_vars: the notebook's
    context, a profile, the environment); exactly those two names, only the missing ones, {} for any other tracking
    URI. They travel in the ranks' environment only (pipeline.redact.TRACKING_CREDENTIALS: ranks but 0 drop them),
    never in a param, tag, log line or the job; a failure to resolve is logged with the names, never values."""
    if not tracks_to_databricks(tracking_uri):
        return {}
    missing = [k for k in WORKSPACE_CREDENTIALS if not environ.get(k)]
    if not missing:
        return {}
    if resolve is None:
        from mlflow.utils.databricks_utils import get_databricks_env_vars as resolve
    try:
        found = resolve(tracking_uri) or {}
    except Exception as exc:  # no workspace credentials on this driver: ranks on workers may fail to log
        log.warning("MLflow tracks to %s but %s are not set and could not be resolved on the driver (%s): rank 0 "
                    "on a worker may not reach the tracking server", tracking_uri, " and ".join(missing),
                    type(exc).__name__)
        return {}
    out = {k: str(found[k]) for k in missing if found.get(k)}
    if out:
        log.info("forwarding %s to the ranks (rank 0 reaches %s; the others drop them)", ", ".join(out), tracking_uri)
    return out


def tracks_to_databricks(tracking_uri: Optional[str]) -> bool:
    """Whether MLflow's tracking URI is a Databricks workspace (`databricks`, `databricks://<profile>`)."""
    from mlflow.utils.uri import is_databricks_uri

    return bool(tracking_uri) and is_databricks_uri(tracking_uri)


def executor_env(environ: dict, tracking_uri: Optional[str] = None) -> dict:
    """The part of `environ` handed to ranks on Spark executors (train.np=N): the prefixes above, less every variable
    named like a secret (pipeline.redact.is_secret_key: `LAKEHOUSE_API_TOKEN`, `HOROVOD_SECRET_KEY`, ...) except
    MLflow's tracking credentials, and DATABRICKS_HOST / DATABRICKS_TOKEN when `tracking_uri` is a Databricks
    workspace (`workspace_credentials`). Rank 0 writes to MLflow and needs those, and Horovod on Spark gives every
    task the same environment (which task becomes rank 0 is known only there): the other ranks drop them as they start
    (`rank_process.rank_record`, pipeline.redact.TRACKING_CREDENTIALS). Withheld names are logged, never values."""
    wanted = {k: v for k, v in environ.items() if k.startswith(EXECUTOR_ENV_PREFIXES)}
    withheld = sorted(k for k in wanted if is_secret_key(k) and k not in TRACKING_CREDENTIALS)
    if withheld:
        log.info("not forwarded to the executors (named like secrets): %s", ", ".join(withheld))
    out = {k: v for k, v in wanted.items() if k not in withheld}
    if tracks_to_databricks(tracking_uri):  # rank 0 reaches the workspace's tracking server with these
        out.update({k: environ[k] for k in WORKSPACE_CREDENTIALS if environ.get(k)})
    return out


def command_line_env(environ: Mapping[str, str], inherited: Mapping[str, str]) -> Tuple[Dict[str, str], List[str]]:
    """What a launcher that writes the ranks' environment `environ` onto their command line (Horovod's Gloo launcher on
    this machine: backends.horovod.secrets_off_the_command_line), where every user of the machine reads it (`ps`,
    /proc/<pid>/cmdline), may write there: only the variables the ranks do not inherit as they are (`inherited`: the
    environment of the process that starts them; for Horovod its own settings), never a secret. The rest reach the
    ranks through that inherited environment, which only this user reads. Returns those variables, and the names
    (sorted) of the secrets of `environ` kept off the command line: every variable named like one
    (pipeline.redact.is_secret_key: AWS_SECRET_ACCESS_KEY, DATABRICKS_TOKEN, ...), MLflow's credentials and tracking
    URI (pipeline.redact.TRACKING_CREDENTIALS: the URI may hold `user:password@`), and any other whose value holds a
    URL's credentials or a secret query parameter (pipeline.redact.redact_url changes it: a proxy's
    `http://user:password@host`). Leaving out what is inherited also keeps off a secret inside another variable's
    value, which no rule on names or URLs finds (`PYSPARK_SUBMIT_ARGS=--conf ...secret.key=...`)."""
    withheld = sorted(k for k, v in environ.items() if is_secret(k, v) or k in TRACKING_CREDENTIALS)
    return {k: v for k, v in environ.items() if inherited.get(k) != v and k not in withheld}, withheld
