"""What a `model.arch` needs installed, checked without importing it: the driver of a Horovod job loads no torch before
the promotion gate (docs/PERFORMANCE.md, "A Horovod job's driver without torch until the gate"), so the packages are
found (importlib.util.find_spec), never imported. Standard library only, apart from the config's error: nets.py and
timm_backbone.py, which build the networks, import torch, and only they travel with a served model."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import List

from pipeline.config import ConfigError

# timm_backbone.PREFIX; repeated here because that module imports torch
TIMM_PREFIX = "timm/"
# what `import timm` needs beyond torch: timm imports torchvision as it loads
TIMM_PACKAGES = ("timm", "torchvision")


def missing_packages(arch: str) -> List[str]:
    """The packages `arch` needs that this interpreter cannot find; none for the project's own networks."""
    if not isinstance(arch, str) or not arch.startswith(TIMM_PREFIX):
        return []
    return [name for name in TIMM_PACKAGES if importlib.util.find_spec(name) is None]


def require_arch_packages(arch: str) -> None:
    """Fail with what to install when `arch` needs a package this interpreter lacks.

    Only a missing package is seen here: a torchvision built for another torch fails only when imported, which the
    ranks do (timm_backbone.import_timm names it then) and `lakehouse doctor` does.

    Raises:
        ConfigError: naming `model.arch`, the missing packages and how to install them.
    """
    missing = missing_packages(arch)
    if not missing:
        return
    try:  # the installed torch's release, read from its metadata: importing torch is what this check avoids
        torch_release = importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        torch_release = "the installed torch"
    raise ConfigError(
        f"config key 'model.arch': {arch!r} needs the timm package and a torchvision built for this torch, but "
        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in {sys.prefix}. Install them "
        f"with `pip install timm torchvision==<the release matching torch {torch_release}>` (a GPU image or a "
        f"Databricks ML runtime has a matching torchvision already; on this project's CPU setup run "
        f"scripts/setup_vision.sh for .venv-vision), or train a project network (model.arch=cnn or resnet); "
        f"`lakehouse doctor` checks the install")
