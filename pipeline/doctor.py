"""`lakehouse doctor`: the install profile, the stack, CUDA devices, Horovod's build and the combinations known to fail.

The checks are pure functions of descriptions (versions, a `GpuFacts`, a `HorovodBuild`, config values), so unit tests
feed them made-up machines; `run_doctor` gathers the facts of this one. On a Databricks runtime (a notebook or a job:
DATABRICKS_RUNTIME_VERSION is set) it names the target it recognizes and checks the runtime against it instead of
the local install profiles. Importable without pyspark or petastorm.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from pipeline.config import Config
from pipeline.distributed.backends import MachineFacts, get, name_of
from pipeline.redact import redact_url

PACKAGES = ["torch", "pytorch_lightning", "pyspark", "delta", "deltalake", "petastorm", "pyarrow", "numpy", "pandas",
            "mlflow", "horovod"]
DIST_NAMES = {"delta": "delta-spark", "pytorch_lightning": "pytorch-lightning"}
PROFILE_MARKER = "lakehouse-profile"  # written into the venv by scripts/setup.sh


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


def java_major(v: Optional[str]) -> int:
    """Java's major version from `java -version`'s text: '1.8.0_392' -> 8 (the old 1.x scheme), '17', '17.0.15',
    '21', '25-ea' -> 17, 17, 21, 25; 0 when there is no number."""
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", v or "")
    if not m:
        return 0
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major


def java_version() -> Optional[str]:
    if not shutil.which("java"):
        return None
    out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60).stderr
    m = re.search(r'version "([^"]+)"', out)
    return m.group(1) if m else out.strip().splitlines()[0] if out.strip() else None


@dataclass
class GpuFacts:
    """What torch sees: its version and CUDA build, the visible devices, and torch.distributed's NCCL."""

    torch: Optional[str] = None
    torch_cuda: Optional[str] = None  # torch.version.cuda; None for a CPU torch
    device_names: List[str] = field(default_factory=list)
    capabilities: List[Tuple[int, int]] = field(default_factory=list)
    dist_nccl: bool = False  # torch.distributed.is_nccl_available()

    @property
    def device_count(self) -> int:
        return len(self.device_names)


@dataclass
class HorovodBuild:
    installed: bool
    error: Optional[str] = None
    pytorch: bool = False
    gloo: bool = False
    mpi: bool = False
    nccl: bool = False


def detect_profile(versions: Dict[str, Optional[str]]) -> Tuple[str, str]:
    """(profile, why) from what is installed: classic = Petastorm on pyarrow 14; modern = no Petastorm, pyarrow >= 18;
    dbr-15.4 = Petastorm on pyarrow 14 with Spark 3.5."""
    pet, arrow, np_ = versions.get("petastorm"), versions.get("pyarrow"), versions.get("numpy")
    arrow_major, np_major = _major_minor(arrow)[0], _major_minor(np_)[0]
    spark = versions.get("pyspark")
    if pet and arrow and arrow_major < 15 and _major_minor(spark) == (3, 5):
        return "dbr-15.4", f"petastorm {pet} with pyarrow {arrow} on Spark {spark}"
    if pet and arrow and arrow_major < 15:
        return "classic", f"petastorm {pet} with pyarrow {arrow}"
    if not pet and arrow and arrow_major >= 18 and np_major >= 2:
        return "modern", f"no petastorm, pyarrow {arrow}, numpy {np_}"
    return "unknown", (f"petastorm {pet or 'absent'}, pyarrow {arrow or 'absent'}, numpy {np_ or 'absent'}: neither "
                       "profile (`make setup PROFILE=classic`, `PROFILE=modern` or `PROFILE=dbr-15.4`)")


def known_problems(versions: Dict[str, Optional[str]], java: Optional[str]) -> List[str]:
    """Package combinations measured not to work (see docs/install.md, "The stack"); empty when all is well."""
    problems = []
    pet, arrow, np_, spark, delta = (versions.get(k) for k in ("petastorm", "pyarrow", "numpy", "pyspark", "delta"))
    if pet and _major_minor(pet) >= (0, 13):
        problems.append(f"petastorm {pet}: 0.13.x can return an empty epoch from make_batch_reader; use 0.12.1")
    if pet and arrow and _major_minor(arrow) >= (15, 0):
        problems.append(f"pyarrow {arrow}: Petastorm 0.12 fails with pyarrow >= 15; use 14.0.2 (classic profile) or "
                        "uninstall petastorm and read with data.reader=arrow (modern profile)")
    if arrow and np_ and _major_minor(arrow)[0] < 15 and _major_minor(np_) >= (2, 0):
        problems.append(f"numpy {np_}: pyarrow {arrow} is built for numpy 1.x; use numpy < 2")
    if spark and delta and not _delta_matches(spark, delta):
        problems.append(f"delta-spark {delta} does not match Spark {spark} (delta-spark 4.0.x goes with Spark 4.0.x, "
                        "3.x with Spark 3.5)")
    if java is None:
        problems.append("java not found: Spark 4.0 needs Java 17")
    elif java_major(java) < 17:
        problems.append(f"java {java}: Spark 4.0 needs Java 17 or newer")
    for required in ("torch", "pyspark", "pyarrow", "mlflow", "pytorch_lightning"):
        if not versions.get(required):
            problems.append(f"{required} is not installed")
    return problems


def _delta_matches(spark: str, delta: str) -> bool:
    s, d = _major_minor(spark), _major_minor(delta)
    if s[0] == 3:
        return d[0] == 3  # Delta 3.0 to 3.3 are all built for Spark 3.5
    return s == d


def databricks_problems(cfg: Config, runtime_version: str, python: str,
                        versions: Dict[str, Optional[str]]) -> Tuple[Optional[str], List[str], List[str]]:
    """On a Databricks runtime: (the target recognized, or None; problems; notes). Pure but for reading the target's
    constraints file. The problems are the start-up check's (pipeline.lakehouse.runtime), so a notebook's doctor and
    a job's start say the same; a runtime that is no supported target, or a patch level that differs from the
    recorded one, is a note."""
    from pipeline.lakehouse import runtime

    target = runtime.recognize(runtime_version)
    pins = runtime.read_constraints(target.constraints) if target and target.constraints.is_file() else None
    found = runtime.problems(cfg, target, python, versions, pins)
    notes = [f"{name} {have} on this runtime, {rec} recorded in {target.constraints.name}"
             for name, (have, rec) in sorted(runtime.drift(versions, pins or {}).items())]
    if target is None:
        notes.append(f"Databricks Runtime {runtime_version} is not a supported target ("
                     + ", ".join(f"{t.name}: {t.runtime} LTS ML" for t in runtime.TARGETS.values())
                     + "): the checks below are the generic ones")
    return (target.name if target else None), found, notes


def reader_problems(reader: str, petastorm_version: Optional[str]) -> List[str]:
    if reader == "petastorm" and not petastorm_version:
        return ["config data.reader=petastorm but petastorm is not installed (the modern profile has none): install "
                "the classic profile (`make setup PROFILE=classic`), or set data.reader=arrow"]
    return []


def horovod_problems(hvd: HorovodBuild, gpu: GpuFacts) -> List[str]:
    """Horovod's build against this torch, whatever the backend (it is installed by every profile)."""
    problems = []
    if not hvd.installed:
        problems.append(f"horovod is not importable ({hvd.error}); run `make setup`")
        return problems
    if not hvd.gloo:
        problems.append("horovod was built without Gloo; CPU training needs it")
    if gpu.torch_cuda and gpu.device_count and not hvd.nccl:
        problems.append(f"CUDA torch {gpu.torch} beside a Horovod built without NCCL: GPU tensors would be all-reduced "
                        "by gloo through host memory; rebuild with `bash scripts/build_horovod.sh` (it builds NCCL "
                        "when torch has CUDA), or set LAKEHOUSE_HOROVOD_GLOO_ONLY=1 for it if that is meant")
    if hvd.nccl and not gpu.torch_cuda:
        problems.append(f"horovod was built with NCCL but torch {gpu.torch} has no CUDA: rebuild Horovod for this "
                        "torch")
    return problems


def gpu_problems(gpu: GpuFacts, np_: int) -> List[str]:
    """Ranks vs GPUs: each local rank pins a GPU of its own (`train.backend=single` is always `train.np=1`)."""
    local_ranks = -np_ if np_ < 0 else (1 if np_ == 1 else 0)  # N > 1: Spark tasks, placed elsewhere
    if gpu.device_count and local_ranks > gpu.device_count:
        return [f"config train.np={np_}: {local_ranks} local ranks but {gpu.device_count} visible GPU(s); "
                f"each rank pins its own GPU: use train.np=-{gpu.device_count} or fewer"]
    return []


def backend_problems(gpu: GpuFacts, hvd: Optional[HorovodBuild], backend: str, np_: int) -> List[str]:
    """What the backend named `backend` says keeps it from running `train.np=np_` ranks here (pipeline/distributed/
    backends: DDP's and FSDP's process group vs this torch.distributed, a missing Horovod). `hvd` None: Horovod's
    absence is not judged here (a Databricks runtime's own check names it)."""
    facts = MachineFacts(torch=gpu.torch, device_count=gpu.device_count, dist_nccl=gpu.dist_nccl,
                         gloo=_gloo_available(), horovod_installed=None if hvd is None else hvd.installed)
    return get(backend).problems(facts, np_)


def _gloo_available() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_gloo_available())
    except Exception:
        return False


def gpu_facts() -> GpuFacts:
    try:
        import torch
    except Exception:
        return GpuFacts()
    facts = GpuFacts(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if torch.version.cuda and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            facts.device_names.append(torch.cuda.get_device_name(i))
            facts.capabilities.append(tuple(torch.cuda.get_device_capability(i)))
    try:
        import torch.distributed as dist

        facts.dist_nccl = bool(dist.is_available() and dist.is_nccl_available())
    except Exception:
        pass
    return facts


def horovod_build() -> HorovodBuild:
    try:
        import horovod.torch as hvd
    except Exception as exc:
        return HorovodBuild(installed=False, error=f"{type(exc).__name__}: {exc}")
    return HorovodBuild(installed=True, pytorch=True, gloo=bool(hvd.gloo_built()), mpi=bool(hvd.mpi_built()),
                        nccl=bool(hvd.nccl_built()))


def _profile_marker() -> Optional[str]:
    path = os.path.join(sys.prefix, PROFILE_MARKER)
    try:
        with open(path) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def direct_path(cfg: Config) -> Tuple[bool, str]:
    """Whether data.source=direct can read the configured table (delta.table at delta.version), and why not: a table
    the library refuses (DeltaError: a catalog name, which delta-rs cannot resolve) is a "no" with its reason."""
    from pipeline.data.source import direct_readable  # local: numpy and pyarrow, out of `import pipeline.doctor`
    from pipeline.lakehouse.delta_common import DeltaError

    try:
        return direct_readable(cfg.delta.table, cfg.delta.version)
    except DeltaError as exc:
        return False, " ".join(str(exc).split())


def _say(line: str) -> None:
    """Print one line of the report with the project's redaction applied (pipeline.redact): the config's texts it
    names (delta.table and the reasons that quote it) keep no URL password, user token or signature."""
    print(redact_url(line))


def run_doctor(cfg: Config) -> int:
    """Print the report; exit status 1 when this install cannot run the pipeline as configured."""
    from pipeline.lakehouse.delta import usable_engines

    versions = {p: _version(p) for p in PACKAGES}
    java = java_version()
    hvd = horovod_build()
    gpu = gpu_facts()
    engines = usable_engines()
    profile, why = detect_profile(versions)
    marker = _profile_marker()
    reader = cfg.data.reader
    backend = name_of(cfg)
    dbr = os.environ.get("DATABRICKS_RUNTIME_VERSION")
    notes: List[str] = []

    if dbr:  # a notebook or job on Databricks: the runtime and its target, not the local install profiles
        from pipeline.lakehouse.runtime import TARGETS, runtime_facts

        _, py, runtime_versions = runtime_facts()
        target, problems, notes = databricks_problems(cfg, dbr, py, runtime_versions)
        if hvd.installed:
            problems += horovod_problems(hvd, gpu)
        problems += gpu_problems(gpu, cfg.train.np)
        problems += backend_problems(gpu, hvd if hvd.installed else None, backend, cfg.train.np)
        where = (f"target {target} (Spark {TARGETS[target].spark}, Python {TARGETS[target].python}, defaults "
                 f"data.reader={TARGETS[target].reader} train.backend={TARGETS[target].backend})" if target
                 else "no supported target")
    else:
        problems = known_problems(versions, java)
        problems += reader_problems(reader, versions.get("petastorm"))
        problems += horovod_problems(hvd, gpu)
        problems += backend_problems(gpu, hvd, backend, cfg.train.np)
        problems += gpu_problems(gpu, cfg.train.np)
        if marker and profile != "unknown" and marker != profile:
            problems.append(f"set up as the {marker} profile ({sys.prefix}/{PROFILE_MARKER}) but what is installed "
                            f"is {profile} ({why}); re-run `make setup PROFILE={marker}`")
        if cfg.delta.engine == "spark" and not any(k in cfg.spark.conf for k in ("spark.jars", "spark.jars.packages")):
            problems.append("config delta.engine=spark but spark.conf sets neither spark.jars nor spark.jars.packages "
                            "(the Delta jars); fine on Databricks, which ships them")
    direct_ok, direct_why = direct_path(cfg)
    if cfg.data.source == "direct" and not direct_ok:
        problems.append(f"config data.source=direct but the direct path cannot read delta.table: {direct_why}")
    if cfg.model.arch.startswith("timm/"):  # a timm backbone needs timm and a torchvision built for this torch
        from pipeline.model.timm_backbone import timm_problems

        problems += timm_problems()

    _say("lakehouse doctor")
    if dbr:
        _say(f"  {'databricks':<18} Databricks Runtime {dbr}: {where}")
    else:
        _say(f"  {'profile':<18} {profile} ({why}){f'; set up as {marker}' if marker else ''}")
    _say(f"  {'python':<18} {sys.version.split()[0]} ({sys.executable})")
    for p in PACKAGES:
        _say(f"  {DIST_NAMES.get(p, p):<18} {versions[p] or 'MISSING'}")
    _say(f"  {'java':<18} {java or 'MISSING'}")
    _say(f"  {'torch cuda':<18} {gpu.torch_cuda or 'none (CPU build)'}; torch.distributed nccl={gpu.dist_nccl}")
    if gpu.device_count:
        for i, (name, cap) in enumerate(zip(gpu.device_names, gpu.capabilities)):
            _say(f"  {'cuda device ' + str(i):<18} {name} (compute capability {cap[0]}.{cap[1]})")
    else:
        _say(f"  {'cuda devices':<18} 0")
    if hvd.installed:
        _say(f"  horovod build      pytorch={hvd.pytorch} gloo={hvd.gloo} nccl={hvd.nccl} mpi={hvd.mpi}")
    _say(f"  {'config':<18} train.backend={backend} train.np={cfg.train.np} data.reader={reader}")
    for name, state in engines.items():
        _say(f"  delta engine {name:<6} {state}")
    _say(f"  {'direct path':<18} {'yes' if direct_ok else 'no'}: {direct_why}")
    for note in notes:
        _say(f"  note: {note}")
    if problems:
        _say("problems:")
        for p in problems:
            _say(f"  - {p}")
        return 1
    _say("ok: this install can run the pipeline")
    return 0
