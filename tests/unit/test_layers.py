"""The package's layers and the absence of import cycles, as `lint-imports` checks them (.importlinter)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: install the dev extra (pip install -e .[dev], import-linter)")
    # --no-cache: nothing written into the checkout; lint-imports puts its working directory first on sys.path, so
    # the package analysed is the one under `cwd`
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_package_keeps_its_layers_and_has_no_cycles():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout


def _copy(tmp_path: Path) -> Path:
    for package in ("pipeline", "bench"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def _add_function_import(path: Path, statement: str) -> None:
    """A function-local import at the end of `path`: import-linter must see these too."""
    with open(path, "a") as fh:
        fh.write(f"\n\ndef _added_by_the_test():\n    {statement}\n")


@pytest.mark.parametrize("module, statement, broken, edge", [
    # ground reaching up into the jobs
    ("config.py", "import pipeline.workflow", "Layers run one way", "pipeline.config -> pipeline.workflow"),
    # a lower layer reaching up one step (the lakehouse decoding through data/ instead of pipeline.images)
    ("lakehouse/ingest.py", "from pipeline.data.transforms import decode_batch", "Layers run one way",
     "pipeline.lakehouse.ingest -> pipeline.data.transforms"),
    # a cycle inside one layer: data/cache.py already imports data/shards.py
    ("data/shards.py", "from pipeline.data.cache import remove_entry", "No cycles are allowed in pipeline.data",
     ".shards -> .cache"),
    # the library reaching into the bench, which sits beside it (only pipeline.cli launches it)
    ("lakehouse/ingest.py", "from bench.core import median", "The library never imports the bench",
     "pipeline.lakehouse.ingest -> bench.core"),
])
def test_a_forbidden_import_in_a_copy_is_caught_and_named(tmp_path, module, statement, broken, edge):
    copy = _copy(tmp_path)
    assert _lint(copy).returncode == 0  # the copy as it is passes, so the failure below is the added import's
    _add_function_import(copy / "pipeline" / module, statement)
    out = _lint(copy)
    assert out.returncode != 0
    assert f"{broken}" in out.stdout and "BROKEN" in out.stdout, out.stdout[-4000:]
    assert edge in out.stdout, out.stdout[-4000:]
