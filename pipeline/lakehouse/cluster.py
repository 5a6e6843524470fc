"""What a job's ranks and executors on other hosts can reach: its paths and its MLflow address, checked up front.

On a cluster (any Spark master that is not this machine) executors and ranks run on other hosts, with their own disks
and their own 127.0.0.1. Whatever more than one host reads or writes must be cluster storage: a URL scheme (dbfs:/,
s3://, hdfs://, abfss://) or a local folder that every host mounts at the same path, listed in `spark.shared_paths`
(default /dbfs and /Volumes, the FUSE mounts on every Databricks node; NFS mounts are the user's to list).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple
from urllib.parse import urlparse

from pipeline.config import Config, ConfigError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def on_this_machine(master: str) -> bool:
    """Whether every executor of `master` runs on this machine (local[N], a standalone master on a loopback address)."""
    host = urlparse(master).hostname if "://" in master else None
    return master.startswith("local") or (host or "") in LOOPBACK_HOSTS


def local_path(value: str) -> Optional[str]:
    """`value` as an absolute path on this host when it names one (a path, file:, sqlite:), else None (cluster storage
    by URL, a catalog name, a tracking server)."""
    parsed = urlparse(value)
    if parsed.scheme == "sqlite":
        path = value[len("sqlite:///"):] if value.startswith("sqlite:///") else ""
        return os.path.abspath(path) if path and path != ":memory:" else None
    if parsed.scheme == "file":
        return os.path.abspath(parsed.path)
    if parsed.scheme or "/" not in value:  # a URL of cluster storage, or catalog.schema.table
        return None
    return os.path.abspath(value)


def is_shared(path: str, shared_paths: List[str]) -> bool:
    """Whether `path` lies under one of the folders every host mounts at the same path."""
    real = os.path.realpath(path)
    for folder in shared_paths:
        root = os.path.realpath(os.path.abspath(folder))
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def _checked(cfg: Config) -> List[Tuple[str, str]]:
    """(config key, value) of what other hosts read or write: the table and the cache (executors), the checkpoint and
    job folder (every rank, and the driver reads the ranks' reports there); with ranks on the cluster (train.np > 0),
    rank 0's MLflow store and artifacts too."""
    keys = [("delta.table", cfg.delta.table), ("data.cache_dir", cfg.data.cache_dir),
            ("train.checkpoint_dir", cfg.train.checkpoint_dir)]
    if cfg.train.np > 1:
        keys += [("mlflow.tracking_uri", cfg.mlflow.tracking_uri or ""),
                 ("mlflow.artifact_location", cfg.mlflow.artifact_location or "")]
    return [(k, v) for k, v in keys if v]


def cluster_problems(cfg: Config) -> List[str]:
    """Every path or address of `cfg` that a host other than this one could not reach, each naming its config key;
    empty when the master runs everything on this machine."""
    master = cfg.spark.master
    if on_this_machine(master):
        return []
    shared = list(cfg.spark.shared_paths)
    problems = []
    for key, value in _checked(cfg):
        path = local_path(value)
        if path is not None and not is_shared(path, shared):
            problems.append(
                f"config key '{key}' is {value!r}, a path on this host only ({path}), but spark.master {master!r} "
                f"runs executors and ranks on other hosts, which cannot see it: use cluster storage (dbfs:/, s3://, "
                f"hdfs://) or a folder every host mounts at the same path, listed in spark.shared_paths "
                f"(now {shared})")
        host = urlparse(value).hostname if urlparse(value).scheme in ("http", "https") else None
        if host in LOOPBACK_HOSTS:
            problems.append(
                f"config key '{key}' is {value!r}: rank 0 runs on an executor on another host, where {host} is that "
                f"host itself; use an address of the tracking server every host can reach")
    return problems


def require_reachable(cfg: Config) -> None:
    """Raise ConfigError listing `cluster_problems` (before any Spark work or rank starts)."""
    problems = cluster_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
