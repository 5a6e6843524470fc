"""`lakehouse doctor`: the installed stack, Java, Horovod's build, usable Delta engines and known-bad combinations."""
from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

from pipeline.config import Config

PACKAGES = ["torch", "pytorch_lightning", "pyspark", "delta", "deltalake", "petastorm", "pyarrow", "numpy", "pandas",
            "mlflow", "horovod"]
DIST_NAMES = {"delta": "delta-spark", "pytorch_lightning": "pytorch-lightning"}


def _version(module: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(DIST_NAMES.get(module, module))
    except metadata.PackageNotFoundError:
        try:
            return getattr(importlib.import_module(module), "__version__", "?")
        except Exception:
            return None


def _major_minor(v: Optional[str]) -> Tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def java_version() -> Optional[str]:
    if not shutil.which("java"):
        return None
    out = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "([^"]+)"', out)
    return m.group(1) if m else out.strip().splitlines()[0] if out.strip() else None


def known_problems(versions: Dict[str, Optional[str]], java: Optional[str]) -> List[str]:
    """Combinations measured not to work (see the README's Stack section); empty when all is well."""
    problems = []
    pet, arrow, np_, spark, delta = (versions.get(k) for k in ("petastorm", "pyarrow", "numpy", "pyspark", "delta"))
    if pet and _major_minor(pet) >= (0, 13):
        problems.append(f"petastorm {pet}: 0.13.x can return an empty epoch from make_batch_reader; use 0.12.1")
    if arrow and _major_minor(arrow) >= (15, 0):
        problems.append(f"pyarrow {arrow}: Petastorm 0.12 fails with pyarrow >= 15; use 14.0.2")
    if np_ and _major_minor(np_) >= (2, 0):
        problems.append(f"numpy {np_}: pyarrow 14 is built for numpy 1.x; use numpy < 2")
    if spark and delta and _major_minor(spark)[0] != _major_minor(delta)[0]:
        problems.append(f"delta-spark {delta} does not match Spark {spark} (delta-spark 4.0.x goes with Spark 4.0.x)")
    elif spark and delta and _major_minor(spark) != _major_minor(delta):
        problems.append(f"delta-spark {delta} does not match Spark {spark} (delta-spark 4.0.x goes with Spark 4.0.x)")
    if java is None:
        problems.append("java not found: Spark 4.0 needs Java 17")
    elif _major_minor(java)[0] < 17:
        problems.append(f"java {java}: Spark 4.0 needs Java 17 or newer")
    for required in ("torch", "pyspark", "petastorm", "pyarrow", "mlflow", "pytorch_lightning"):
        if not versions.get(required):
            problems.append(f"{required} is not installed")
    return problems


def horovod_build() -> Dict[str, object]:
    try:
        import horovod.torch as hvd
    except Exception as exc:
        return {"installed": False, "error": str(exc)}
    return {"installed": True, "pytorch": True, "gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built()),
            "nccl": bool(hvd.nccl_built())}


def run_doctor(cfg: Config) -> int:
    """Print the report; exit status 1 when this install cannot run the pipeline."""
    from pipeline.lakehouse.delta import usable_engines

    versions = {p: _version(p) for p in PACKAGES}
    java = java_version()
    hvd = horovod_build()
    engines = usable_engines()
    problems = known_problems(versions, java)
    if not hvd.get("installed"):
        problems.append(f"horovod is not importable ({hvd.get('error')}); run `make setup`")
    elif not hvd.get("gloo"):
        problems.append("horovod was built without Gloo; CPU training needs it")
    if cfg.train.backend == "horovod" and not hvd.get("installed"):
        problems.append("config train.backend=horovod but horovod is missing")
    if cfg.delta.engine == "spark" and not any(k in cfg.spark.conf for k in ("spark.jars", "spark.jars.packages")):
        problems.append("config delta.engine=spark but spark.conf sets neither spark.jars nor spark.jars.packages "
                        "(the Delta jars); fine on Databricks, which ships them")

    print("lakehouse doctor")
    for p in PACKAGES:
        print(f"  {DIST_NAMES.get(p, p):<18} {versions[p] or 'MISSING'}")
    print(f"  {'java':<18} {java or 'MISSING'}")
    if hvd.get("installed"):
        print(f"  horovod build      pytorch={hvd['pytorch']} gloo={hvd['gloo']} nccl={hvd['nccl']} mpi={hvd['mpi']}")
    for name, state in engines.items():
        print(f"  delta engine {name:<6} {state}")
    if problems:
        print("problems:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("ok: this install can run the pipeline")
    return 0
