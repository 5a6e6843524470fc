"""Which Databricks target this runtime is, and whether it has what the config needs: a start-up check with clear messages.

Pure decisions (`recognize`, `read_constraints`, `problems`) take the facts as arguments; `runtime_facts` gathers them
on this machine and `require_runtime` raises `ConfigError` listing every problem. Importable without pyspark.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pipeline.config import Config, ConfigError
from pipeline.log import get_logger

log = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS_DIR = ROOT / "scripts" / "databricks"
INIT_SCRIPT = "scripts/databricks/init-lakehouse.sh (LAKEHOUSE_HOROVOD=1)"
# What a runtime provides and the project must never replace (its constraints file pins each).
RUNTIME_PACKAGES = ("pyspark", "pyarrow", "numpy", "pandas", "torch", "mlflow")


@dataclass(frozen=True)
class Target:
    """One supported Databricks runtime: its Spark and Python, and what the project does on it by default."""

    name: str
    runtime: str  # DATABRICKS_RUNTIME_VERSION's major.minor
    spark: str  # major.minor
    python: str  # major.minor
    reader: str
    backend: str
    preinstalled: Tuple[str, ...] = field(default_factory=tuple)  # beyond RUNTIME_PACKAGES

    @property
    def constraints(self) -> Path:
        return CONSTRAINTS_DIR / f"constraints-{self.name}.txt"


TARGETS = {
    t.name: t for t in (
        Target("dbr-15.4-ml", "15.4", "3.5", "3.11", "petastorm", "horovod", ("horovod", "petastorm")),
        Target("dbr-17.3-ml", "17.3", "4.0", "3.12", "arrow", "ddp", ()),
    )
}


def recognize(runtime_version: Optional[str]) -> Optional[Target]:
    """The target for a DATABRICKS_RUNTIME_VERSION value ('15.4', '17.3.x-cpu-ml-scala2.13', ...), or None."""
    if not runtime_version:
        return None
    m = re.match(r"\s*(\d+)\.(\d+)", runtime_version)
    if not m:
        return None
    mm = f"{m.group(1)}.{m.group(2)}"
    return next((t for t in TARGETS.values() if t.runtime == mm), None)


def read_constraints(path: Path) -> Dict[str, str]:
    """`name==version` lines of a pip constraints file (comments and blank lines ignored), names lower-cased.

    Raises:
        ConfigError: naming the file and line of anything that is not an exact pin.
    """
    pins: Dict[str, str] = {}
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)", line)
        if not m:
            raise ConfigError(f"{path}:{n}: {raw.strip()!r} is not an exact pin (name==version)")
        name = m.group(1).lower().replace("_", "-")
        if name in pins:
            raise ConfigError(f"{path}:{n}: {name} is pinned twice")
        pins[name] = m.group(2)
    return pins


def _mm(version: Optional[str]) -> Optional[str]:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _base(version: str) -> str:
    return version.split("+", 1)[0]  # torch 2.3.1+cu121 is the runtime's 2.3.1


def problems(cfg: Config, target: Optional[Target], python: str, versions: Dict[str, Optional[str]],
             pins: Optional[Dict[str, str]] = None) -> List[str]:
    """What this runtime lacks for `cfg` (pure). `versions`: installed version per package, None when absent;
    `pins`: the target's constraints. Each message says what to do."""
    out: List[str] = []
    where = f"Databricks Runtime {target.runtime} ML ({target.name})" if target else "this runtime"
    if target and _mm(python) != target.python:
        out.append(f"{where} runs Python {target.python}, this is Python {python}: the wrong target for this cluster")
    spark = versions.get("pyspark")
    if target and spark and _mm(spark) != target.spark:
        out.append(f"pyspark {spark} is not the runtime's Spark {target.spark}: the project's install replaced it; "
                   f"reinstall with `pip install --no-deps` and -c {target.constraints.name} "
                   f"(conf/databricks/README.md)")
    if cfg.train.backend == "horovod" and not versions.get("horovod"):
        out.append(f"train.backend=horovod but horovod is not installed on {where} (Databricks Runtime 16.0 ML and "
                   f"later do not ship it): add the cluster init script {INIT_SCRIPT}, which builds and installs the "
                   f"project's Horovod wheel, or set train.backend=ddp (TorchDistributor)")
    if cfg.train.backend == "ddp" and spark and _mm(spark) and tuple(map(int, _mm(spark).split("."))) < (3, 4):
        out.append(f"train.backend=ddp needs Spark >= 3.4 (pyspark.ml.torch.distributor.TorchDistributor); "
                   f"this is pyspark {spark}")
    if cfg.train.backend == "ddp" and not spark:
        out.append("train.backend=ddp launches through Spark's TorchDistributor, and pyspark is not importable")
    if cfg.data.reader == "petastorm" and not versions.get("petastorm"):
        out.append(f"data.reader=petastorm but petastorm is not installed on {where} (deprecated from Databricks "
                   f"Runtime 16.0 ML on): set data.reader=arrow")
    for required in ("torch", "pyarrow", "pytorch_lightning", "deltalake"):
        if not versions.get(required):
            out.append(f"{required} is not installed: install the packages the runtime lacks with "
                       f"-c {target.constraints.name if target else 'the target constraints'} (conf/databricks/README.md)")
    mlflow = versions.get("mlflow")
    if mlflow and int(mlflow.split(".")[0]) < 3:
        out.append(f"mlflow {mlflow} is older than 3 (the project logs MLflow 3 LoggedModels): on "
                   f"{where} install mlflow 3 for the job (see conf/databricks/README.md, 'What is replaced')")
    for name, pinned in sorted((pins or {}).items()):
        have = versions.get(name)
        if have and name in RUNTIME_PACKAGES and _mm(_base(have)) != _mm(pinned):
            out.append(f"{name} {have} is not the {pinned} that {target.constraints.name if target else 'the constraints'} "
                       f"records for the runtime: the install replaced it (reinstall the project with --no-deps and "
                       f"the rest with -c, conf/databricks/README.md) or this is not that runtime")
    return out


def drift(versions: Dict[str, Optional[str]], pins: Dict[str, str]) -> Dict[str, Tuple[str, str]]:
    """Patch-level differences between the runtime and its recorded constraints (a note, not a problem):
    {name: (installed, recorded)}."""
    return {n: (versions[n], p) for n, p in pins.items()
            if versions.get(n) and _base(versions[n]) != p and _mm(_base(versions[n])) == _mm(p)}


def runtime_facts() -> Tuple[Optional[Target], str, Dict[str, Optional[str]]]:
    """The target from DATABRICKS_RUNTIME_VERSION, this Python, and the installed versions the check reads."""
    names = {"pyspark": "pyspark", "pyarrow": "pyarrow", "numpy": "numpy", "pandas": "pandas", "torch": "torch",
             "mlflow": "mlflow", "horovod": "horovod", "petastorm": "petastorm",
             "pytorch_lightning": "pytorch-lightning", "deltalake": "deltalake"}
    versions: Dict[str, Optional[str]] = {}
    for key, dist in names.items():
        try:
            versions[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = None
    if versions["pyspark"] is None:  # Databricks puts its Spark on sys.path, not as a pip distribution
        try:
            import pyspark

            versions["pyspark"] = pyspark.__version__
        except ImportError:
            pass
    if versions["mlflow"] is None:
        try:
            versions["mlflow"] = importlib.metadata.version("mlflow-skinny")
        except importlib.metadata.PackageNotFoundError:
            pass
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return recognize(os.environ.get("DATABRICKS_RUNTIME_VERSION")), py, versions


def describe() -> Dict[str, object]:
    """For `lakehouse doctor`: the recognized target (or None) and the versions read."""
    target, py, versions = runtime_facts()
    return {"databricks_runtime": os.environ.get("DATABRICKS_RUNTIME_VERSION"),
            "target": target.name if target else None, "python": py, "versions": versions}


def require_runtime(cfg: Config) -> Optional[Target]:
    """On a Databricks runtime: raise ConfigError listing everything the runtime lacks for `cfg`; else do nothing."""
    target, py, versions = runtime_facts()
    if not os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return None
    pins = read_constraints(target.constraints) if target and target.constraints.is_file() else None
    found = problems(cfg, target, py, versions, pins)
    for name, (have, rec) in sorted(drift(versions, pins or {}).items()):
        log.warning("%s %s on this runtime, %s recorded in %s: update the constraints file", name, have, rec,
                    target.constraints.name)
    if target is None:
        log.warning("Databricks Runtime %s is not one of the supported targets (%s)",
                    os.environ.get("DATABRICKS_RUNTIME_VERSION"), ", ".join(TARGETS))
    if found:
        raise ConfigError("this Databricks runtime cannot run the config:\n  - " + "\n  - ".join(found))
    log.info("Databricks target %s: the runtime has what the config needs", target.name if target else "unknown")
    return target
