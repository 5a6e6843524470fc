"""What a logged model ships beside its weights: the modules of `pipeline` the served model imports, copied under a
content-named package of their own (`copy_served_code`), the model's entry file (MODEL_CODE) and its pip
requirements. Standard library only: it travels with the model too."""
from __future__ import annotations

import hashlib
import re
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import List, Sequence

# The modules the served model imports. Only these travel with the model (code_paths), so that it
# loads in a process that has mlflow, torch and pillow but neither the rest of `pipeline` nor its
# heavy dependencies (Spark, Petastorm, Horovod). Package __init__ files are shipped empty.
SERVED_MODULES = (
    "pipeline/log.py",
    "pipeline/redact.py",  # log.py formats every line through it
    "pipeline/data/transforms.py",
    "pipeline/data/crops.py",  # the center crop of a model whose ranks decoded its rows (meta center_crop)
    "pipeline/images.py",
    "pipeline/model/nets.py",
    "pipeline/model/timm_backbone.py",  # nets.build_network imports it (timm itself only for a timm/<name> arch)
    "pipeline/tracking/pyfunc.py",
    "pipeline/tracking/served_code.py",  # pyfunc imports it (what a logged model ships)
)


def _package_root() -> Path:
    return Path(__file__).resolve().parents[2]


def served_package_name(modules: Sequence[str] = SERVED_MODULES) -> str:
    """The top-level name the served code travels under: `lakehouse_model_` and a digest of its files. Not `pipeline`:
    a process that loads the model (a Spark Python worker scoring with spark_udf, the gate) may also run, or later
    run, the installed package, and MLflow puts the code folder first on its sys.path; a partial `pipeline` there
    would hide the rest of the package from it (seen: a worker that had scored then failed a training conversion with
    "No module named 'pipeline.data.convert'"). Named by content, two models whose code differs never share modules
    in one process, and a model always runs the code it was logged with."""
    root, digest = _package_root(), hashlib.sha256()
    for rel in modules:
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return f"lakehouse_model_{digest.hexdigest()[:12]}"


_PIPELINE_IMPORT = re.compile(r"^(\s*(?:from|import)\s+)pipeline(?=[.\s])", re.MULTILINE)


def copy_served_code(dest: Path, modules: Sequence[str] = SERVED_MODULES) -> Path:
    """Copy the modules the served model needs into `dest/<served_package_name()>/...` (their `pipeline` imports
    renamed to it, empty package __init__s). Returns the package folder."""
    root, name = _package_root(), served_package_name(modules)
    pkg = dest / name
    for rel in modules:
        src = root / rel
        if not src.is_file():
            raise FileNotFoundError(f"served module {rel} not found under {root}")
        target = pkg / Path(rel).relative_to("pipeline")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_PIPELINE_IMPORT.sub(lambda m: m.group(1) + name, src.read_text()))
    for folder in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text(f'"""Package {folder.relative_to(dest).as_posix().replace("/", ".")} (served subset)."""\n')
    return pkg


def _requirement(dist: str, fallback: str) -> str:
    try:
        version = importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return fallback
    return f"{dist}=={version.split('+')[0]}"


def pip_requirements() -> List[str]:
    """What a serving environment needs: mlflow, torch (CPU or CUDA build of the same version), pillow."""
    return [
        _requirement("mlflow", "mlflow"),
        _requirement("torch", "torch"),
        _requirement("pillow", "pillow"),
        _requirement("numpy", "numpy<2"),
        _requirement("pandas", "pandas"),
    ]


MODEL_CODE = '''"""The served model's entry point (MLflow models-from-code): the ImageClassifierModel shipped in code/."""
from mlflow.models import set_model

from {package}.tracking.pyfunc import ImageClassifierModel

set_model(ImageClassifierModel())
'''
