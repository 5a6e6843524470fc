"""Checkpoints own their layout: no module outside pipeline/distributed/checkpoints/ spells a checkpoint's file name or
the names of what is written beside one, and the one resolver of the restore point picks the right checkpoint."""
from __future__ import annotations

import ast
import os
import re

import pytest

from conftest import ROOT
from pipeline.config import ConfigError
from pipeline.distributed.checkpoints.layout import ASIDE, STAGED, resolve_restore_point, restore_path

PACKAGE = os.path.join(ROOT, "pipeline")
HOME = os.path.join(PACKAGE, "distributed", "checkpoints")
# a checkpoint file name or suffix ("last.ckpt", "best.ckpt", f"{name}.ckpt", ".ckpt"; not the key train.ckpt_restore),
# and the markers of a staged or set-aside sharded checkpoint
SPELLED = re.compile(r"\.ckpt\b|lakehouse-staged|lakehouse-aside")


def _docstrings(tree: ast.AST) -> set:
    """The string constants that are a module's, class's or function's docstring (prose, not a name in use)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelled_outside_home(root: str = PACKAGE, home: str = HOME) -> list:
    """`file:line: text` of every string in the code under `root` (not under `home`) that spells a checkpoint name:
    string literals and the literal parts of f-strings; comments and docstrings are prose and not looked at."""
    hits = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if os.path.join(folder, d) != home and d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), filename=path)
            prose = _docstrings(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                        and SPELLED.search(node.value)):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}")
    return hits


def test_no_module_outside_the_checkpoints_package_spells_a_checkpoint_name():
    hits = spelled_outside_home()
    assert not hits, ("checkpoint names are spelled outside pipeline/distributed/checkpoints/ (use its layout):\n"
                      + "\n".join(hits))


def test_the_scan_finds_a_name_spelled_in_code_and_says_where(tmp_path):
    """The check itself can fail: a literal, an f-string's part and a staged marker are found; prose is not."""
    pkg = tmp_path / "pkg"
    (pkg / "home").mkdir(parents=True)
    (pkg / "home" / "ok.py").write_text('LAST = "last.ckpt"\n')
    (pkg / "mod.py").write_text('"""Writes last.ckpt (prose)."""\n# best.ckpt in a comment\n'
                                'import os\n\n\ndef f(d, n):\n    """best.ckpt, prose."""\n'
                                '    return os.path.join(d, "last.ckpt"), f"{n}.ckpt", n + ".lakehouse-staged-"\n'
                                'KEY = "train.ckpt_restore"\n')
    hits = spelled_outside_home(str(pkg), str(pkg / "home"))
    assert [h.split(": ", 1)[0] for h in hits] == [os.path.relpath(str(pkg / "mod.py"), ROOT) + ":8"] * 3
    assert any("'last.ckpt'" in h for h in hits) and any("lakehouse-staged" in h for h in hits)


# ------------------------------------------------------------------------------------- the one resolver
@pytest.mark.parametrize("value, existing, expected", [
    (None, (), None),
    ("", (), None),
    ("last", (), "/ckpts/run1/last.ckpt"),
    ("best", (), "/ckpts/run1/best.ckpt"),
    ("run0/last", (), "/ckpts/run0/last.ckpt"),  # another run's, under train.checkpoint_dir
    ("run0/best", (), "/ckpts/run0/best.ckpt"),
    ("run0/last", ("run0/last",), "run0/last"),  # a path that exists as typed is that path
    ("a/run0/last", (), "a/run0/last"),  # not a run's name: a path
    ("run0/latest", (), "run0/latest"),
    ("/elsewhere/model.ckpt", (), "/elsewhere/model.ckpt"),
])
def test_the_restore_point_is_the_jobs_own_another_runs_or_a_path(value, existing, expected):
    assert restore_path(value, "/ckpts/run1", "/ckpts", exists=lambda p: p in existing) == expected


def test_without_a_checkpoint_root_a_run_scoped_name_is_a_path():
    assert restore_path("run0/last", "/ckpts/run1", None, exists=lambda p: False) == "run0/last"
    assert restore_path("last", "/ckpts/run1", None, exists=lambda p: False) == "/ckpts/run1/last.ckpt"


def test_the_resolver_settles_before_it_looks_and_refuses_only_when_required(tmp_path):
    run = tmp_path / "run1"
    run.mkdir()
    aside = run / f"last.ckpt{ASIDE}0123abcd"  # a swap cut between its renames: only the old folder is left
    aside.mkdir()
    (aside / "meta.pt").write_bytes(b"x")
    (run / f"last.ckpt{STAGED}7-89abcdef").mkdir()  # an incomplete write of the next one
    assert resolve_restore_point("last", str(run), str(tmp_path)) == str(run / "last.ckpt")
    assert sorted(os.listdir(run)) == ["last.ckpt"]
    assert resolve_restore_point("best", str(run), str(tmp_path), required=False) == str(run / "best.ckpt")
    with pytest.raises(ConfigError, match=r"train\.ckpt_restore.*run1/best\.ckpt does not exist"):
        resolve_restore_point("best", str(run), str(tmp_path))
