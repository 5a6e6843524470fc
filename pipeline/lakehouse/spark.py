"""The Spark session of the driver: the project's own (built from `spark.*` config) or the cluster's, left as it is."""
from __future__ import annotations

import os
import re
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

from pipeline.config import Config, ConfigError
from pipeline.log import get_logger
from pipeline.redact import is_secret, redact_url

log = get_logger(__name__)

# What the delta-spark engine needs in the session; the jars themselves come from spark.jars or
# spark.jars.packages in `spark.conf` (see docs/install.md, "Delta jars").
DELTA_SESSION_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}

HADOOP_PREFIX = "spark.hadoop."
# a value naming a remote file system (Hadoop's connectors): one Spark may open as it starts
_REMOTE_FS = re.compile(r"(?i)\b(s3a?|s3n|abfss?|wasbs?|gs|oss|adl)://")

# Settings the project gives a session it creates (laptop, CI). A session it did not create keeps its own.
OWN_SESSION_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.parquet.compression.codec": "snappy",
}


@dataclass(frozen=True)
class SessionPlan:
    """Whose session the pipeline runs in: `owned` = the project creates, configures and stops it."""

    owned: bool
    reason: str


def plan_session(active_session: bool, databricks_runtime: Optional[str]) -> SessionPlan:
    """Decide whether the project owns the session (pure: the facts are passed in).

    A session that already exists (a notebook, a job on a cluster, a caller's) or any Databricks runtime
    (DATABRICKS_RUNTIME_VERSION set) means the session belongs to someone else: use it, never stop it, never
    change its conf. Otherwise (the CLI on a laptop) the project creates it from `spark.*` and stops it after.
    """
    if databricks_runtime:
        return SessionPlan(False, f"Databricks Runtime {databricks_runtime}: the cluster's session is used as it is")
    if active_session:
        return SessionPlan(False, "a SparkSession is already active: it is used as it is, and not stopped")
    return SessionPlan(True, "no active SparkSession: the project creates one from spark.* and stops it after")


def wanted_conf(cfg: Config) -> Dict[str, str]:
    """The settings the pipeline needs from the session for this config (Delta's when delta.engine=spark, spark.conf)."""
    wanted: Dict[str, str] = {}
    if cfg.delta.engine == "spark":
        wanted.update(DELTA_SESSION_CONF)
    wanted.update({k: str(v) for k, v in cfg.spark.conf.items()})
    return wanted


def unapplied_settings(wanted: Mapping[str, str], current: Callable[[str], Optional[str]]) -> Dict[str, tuple]:
    """The wanted settings a foreign session does not have: {key: (wanted, what the session has or None)}.

    `current(key)` reads the session's value (None when unset). Used to warn, never to change the session.
    """
    out = {}
    for key, value in wanted.items():
        have = current(key)
        if have is None or str(have) != str(value):
            out[key] = (value, have)
    return out


def active_session():
    """The SparkSession this process already has (active in this thread, or the default one), else None."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is not None:
        return spark
    default = getattr(SparkSession, "_instantiatedSession", None)  # a session made in another thread
    if default is not None:
        try:
            if default.sparkContext._jsc is not None:
                return default
        except Exception:  # a Spark Connect session has no sparkContext: getActiveSession covers it
            return None
    return None


def _conf_reader(spark) -> Callable[[str], Optional[str]]:
    def read(key: str) -> Optional[str]:
        try:
            return spark.conf.get(key, None)
        except Exception:  # a static or unreadable key (Spark Connect): reported as unset
            return None
    return read


def _adopt(cfg: Config, reason: str):
    """The existing session as it is: nothing set on it; the settings it lacks are named in a warning."""
    from pyspark.sql import SparkSession

    from pipeline.redact import redact_value

    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        from pipeline.lakehouse.runtime import require_runtime

        require_runtime(cfg)  # fails naming what the runtime lacks (horovod, petastorm, ...) and what to do
    spark = active_session() or SparkSession.builder.getOrCreate()  # Databricks: the cluster's session
    missing = unapplied_settings(wanted_conf(cfg), _conf_reader(spark))
    log.info("%s", reason)
    if missing:
        log.warning("the session was not created by the pipeline and is not changed by it; it lacks %s",
                    ", ".join(f"{k}={redact_value(k, w)!r} (has {redact_value(k, h)!r})"
                              for k, (w, h) in sorted(missing.items())))
    return spark


def _create(cfg: Config):
    """The project's own session, as configured by `spark.*` (and Delta's settings for delta.engine=spark)."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder
    if cfg.spark.master != "databricks":  # on Databricks the cluster's own session is used as it is
        builder = builder.master(cfg.spark.master)
    builder = builder.appName(cfg.spark.app_name)
    for k, v in OWN_SESSION_CONF.items():
        builder = builder.config(k, v)
    if cfg.spark.master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    public, secret = split_secret_conf(wanted_conf(cfg))
    for k, v in public.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    hadoop = spark.sparkContext._jsc.hadoopConfiguration() if secret else None
    for k, v in secret.items():  # into the Hadoop configuration every query copies: the file systems' credentials
        hadoop.set(k[len(HADOOP_PREFIX):], v)
    if secret:
        log.info("given to the session once it started, not on its JVM's command line: %s", ", ".join(sorted(secret)))
    return spark


def split_secret_conf(conf: Mapping[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """`conf` as (the settings a session is started with, the Hadoop settings it is given once it runs).

    PySpark starts its JVM with `spark-submit --conf key=value` for every setting of the builder: a command line every
    user of the machine can read (`ps`, /proc/<pid>/cmdline). So a `spark.hadoop.*` setting named like a secret
    (pipeline.redact.is_secret_key: `spark.hadoop.fs.s3a.secret.key`, `...account.key...`) or whose value holds URL
    credentials is held back and set in the running session's Hadoop configuration, where the file systems read their
    credentials. Any other such setting may be one Spark reads only at start (`spark.authenticate.secret`,
    `spark.executorEnv.*`): it is given at start as before, and a warning names it (never its value). So are the
    Hadoop secrets when a setting given at start names a remote file system (`spark.eventLog.dir=s3a://...`,
    `spark.jars` on abfss://): Spark opens it as it starts, and Hadoop caches that file system, keyless, for the
    queries after."""
    public: Dict[str, str] = {}
    secret: Dict[str, str] = {}
    for k, v in conf.items():
        if not is_secret(k, v):
            public[k] = str(v)
        elif k.startswith(HADOOP_PREFIX):
            secret[k] = str(v)
        else:
            public[k] = str(v)
            log.warning("spark.conf %s looks like a secret and is given to Spark as its JVM starts, on a command line "
                        "every user of this machine can read; put it in spark-defaults.conf or the environment (a "
                        "spark.hadoop.* secret is set after the start instead)", k)
    remote = sorted(k for k, v in public.items() if _REMOTE_FS.search(v))
    if secret and remote:
        log.warning("spark.conf %s name a remote file system Spark opens as it starts: the Hadoop secrets (%s) are "
                    "given at the start too, on a command line every user of this machine can read; put them in "
                    "spark-defaults.conf or the environment", ", ".join(remote), ", ".join(sorted(secret)))
        return {**public, **secret}, {}
    return public, secret


def submitted_master() -> Optional[str]:
    """The master spark-submit started this driver with (its `--master`, else spark-submit's own default `local[*]`);
    None when this process was not started by spark-submit (no JVM handed over) or runs on Databricks. Connects to the
    JVM spark-submit started; makes no session."""
    if not os.environ.get("PYSPARK_GATEWAY_PORT") or os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return None
    from pyspark import SparkConf, SparkContext

    try:
        SparkContext._ensure_initialized()  # the gateway to spark-submit's JVM, whose system properties hold its master
        return SparkConf().get("spark.master", None)
    except Exception as exc:  # noqa: BLE001 - a gateway port left in the environment with no JVM behind it
        log.warning("PYSPARK_GATEWAY_PORT is set but no spark-submit JVM answers there (%s: %s); the master "
                    "spark-submit gave, if any, is not checked", type(exc).__name__, exc)
        return None


def require_submitted_master(cfg: Config) -> None:
    """Refuse (ConfigError naming both) a job spark-submit started with a master other than `spark.master`: the
    session the project makes sets `spark.master` in code, which Spark lets win over `--master`, so the job would run
    silently on the config's master, not where it was submitted. Two local masters differ only in threads: a
    warning."""
    master = submitted_master() if cfg.spark.master != "databricks" else None
    if not master or master == cfg.spark.master:
        return
    if master.startswith("local") and cfg.spark.master.startswith("local"):  # this machine either way: its threads
        log.warning("spark-submit's master %r is not spark.master %r: the session runs %r (this machine either way)",
                    master, cfg.spark.master, cfg.spark.master)
        return
    given, ours = redact_url(master), redact_url(cfg.spark.master)  # a k8s://https://user:token@... URL
    raise ConfigError(f"spark-submit started this job with master {given!r} (its --master, or its default "
                      f"local[*]) but config key 'spark.master' is {ours!r}: the job would run on the config's; "
                      f"give spark.master={given} or submit with --master {ours}")


def _plan_here() -> SessionPlan:
    return plan_session(active_session() is not None, os.environ.get("DATABRICKS_RUNTIME_VERSION"))


def get_spark(cfg: Config):
    """The driver's SparkSession for this config: the one already there, unchanged, or a new one made from `spark.*`."""
    plan = _plan_here()
    return _create(cfg) if plan.owned else _adopt(cfg, plan.reason)


class SparkOnDemand:
    """The driver's SparkSession, started the first time a step asks for it (`spark()`): a job that needs no Spark
    work (its table pinned from the Delta log, its data converted already, its ranks started without Spark) starts no
    JVM, which is most of a job's start on a laptop. The session is the same one `spark_session` gives: the one
    already there, unchanged, or the project's own, stopped by `close` only if it was started here."""

    def __init__(self, cfg: Config):
        self._cfg = cfg
        self._lock = threading.Lock()
        self._spark = None
        self._owned = False

    def __call__(self):
        with self._lock:
            if self._spark is None:
                plan = _plan_here()
                self._spark = _create(self._cfg) if plan.owned else _adopt(self._cfg, plan.reason)
                self._owned = plan.owned
            return self._spark

    @property
    def started(self) -> bool:
        return self._spark is not None

    def start_soon(self) -> None:
        """Start the session on a thread now, for a step that will need it, while this thread goes on; a failure is
        left to the next `spark()`, which tries again and raises it where the session is needed."""
        def start() -> None:
            try:
                self()
            except Exception as exc:  # raised again by the caller's own spark()
                log.debug("starting the Spark session ahead failed: %s", exc)
        threading.Thread(target=start, name="spark-start", daemon=True).start()

    def close(self) -> None:
        with self._lock:  # after a start under way has finished
            if self._spark is not None and self._owned:
                self._spark.stop()
            self._spark = None


def session_of(spark):
    """The SparkSession behind `spark`: a session as it is, or a `SparkOnDemand`'s (started now if it was not)."""
    return spark() if isinstance(spark, SparkOnDemand) else spark


@contextmanager
def spark_on_demand(cfg: Config) -> Iterator[SparkOnDemand]:
    """A `SparkOnDemand` for a block; the session, if one was started, is stopped when the block ends only if the
    pipeline created it."""
    spark = SparkOnDemand(cfg)
    try:
        yield spark
    finally:
        spark.close()


@contextmanager
def spark_session(cfg: Config) -> Iterator:
    """A SparkSession for a block: stopped when the block ends only if the pipeline created it."""
    plan = _plan_here()
    spark = _create(cfg) if plan.owned else _adopt(cfg, plan.reason)
    try:
        yield spark
    finally:
        if plan.owned:
            spark.stop()
