"""`lakehouse bench` runs the checkout's bench/ (beside the package, not in it) from any folder, or names what is missing."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench_import(cwd: Path, package_root: Path) -> subprocess.CompletedProcess:
    """In a fresh interpreter started in `cwd` with only the `pipeline` of `package_root` importable: the CLI's
    bench set-up, then `import bench` here and in a child process that inherits the environment."""
    code = ("import json, os, subprocess, sys\n"
            "from pipeline.cli import _checkout_bench\n"
            "missing = _checkout_bench()\n"
            "if missing: print(json.dumps({'missing': missing})); sys.exit(0)\n"
            "import bench\n"
            "child = subprocess.run([sys.executable, '-c', 'import bench; print(bench.__file__)'], "
            "capture_output=True, text=True, cwd='/')\n"
            "print(json.dumps({'here': bench.__file__, 'child': child.stdout.strip(), 'err': child.stderr}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(package_root)  # the package alone: what an install gives (this venv may map the checkout)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_bench_is_importable_from_another_folder_and_in_the_processes_it_starts(tmp_path):
    import json

    done = _bench_import(tmp_path, ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["here"]).resolve() == (ROOT / "bench" / "__init__.py").resolve(), out
    assert Path(out["child"]).resolve() == (ROOT / "bench" / "__init__.py").resolve(), out


def test_without_the_checkout_bench_says_what_is_missing(tmp_path):
    """A library-only install (the package folder with no bench/ beside it): the command names what it needs."""
    import json

    installed = tmp_path / "site"
    shutil.copytree(ROOT / "pipeline", installed / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    done = _bench_import(tmp_path, installed)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "bench/" in out["missing"] and str(installed) in out["missing"], out
