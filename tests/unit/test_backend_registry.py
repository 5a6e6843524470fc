"""`train.backend` has one home: the backends registry (pipeline/distributed/backends/) answers for each name, and no
other module of the package reads the key to branch on it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.distributed import backends

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline"
# Where the key may be read: the registry, and config validation (pipeline/config.py). The Databricks start-up check
# validates the config against the runtime in the lakehouse layer, below the backends (it runs when a job adopts the
# cluster's Spark session, before any backend is imported), so it reads the name itself.
ALLOWED = ("distributed/backends/", "config.py", "lakehouse/runtime.py")


def backend_reads(source: str) -> list:
    """Line numbers where `source` reads a config's backend: `<x>.train.backend`, `train.backend` on a name,
    `getattr(<x>, "backend")`. String literals (messages naming the key) are not reads."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "backend":
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "train") or (
                    isinstance(owner, ast.Name) and owner.id == "train"):
                lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "backend"):
            lines.append(node.lineno)
    return lines


def test_the_grep_finds_attribute_reads_and_not_messages():
    assert backend_reads("if cfg.train.backend == 'ddp': pass") == [1]
    assert backend_reads("x = 1\ntrain = cfg.train\ny = train.backend") == [3]
    assert backend_reads("b = getattr(cfg.train, 'backend')") == [1]
    assert backend_reads("raise ConfigError(\"config key 'train.backend': horovod\")") == []
    assert backend_reads("t = TARGETS['x'].backend") == []  # a runtime target's default, not the config's key


def test_no_module_outside_the_backends_and_config_validation_reads_train_backend():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED):
            continue
        lines = backend_reads(path.read_text())
        if lines:
            found[rel] = lines
    assert found == {}, f"train.backend read outside pipeline/distributed/backends/ (ask the registry): {found}"


def test_every_configurable_backend_has_a_registered_pair():
    from pipeline.config import CHOICES

    assert set(CHOICES["train.backend"]) == set(backends.BACKENDS)
    for name, backend in backends.BACKENDS.items():
        assert backend.name == name and backends.get(name) is backend


def test_an_unknown_name_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.backend.*'mpi' is not horovod, ddp, fsdp, single"):
        backends.get("mpi")


@pytest.mark.parametrize("name, np_, spark", [("horovod", -2, False), ("horovod", 2, True), ("ddp", -2, False),
                                              ("fsdp", 2, True), ("ddp", 1, False), ("single", 1, False)])
def test_each_backend_says_whether_its_launch_needs_spark(name, np_, spark):
    cfg = load_config(str(ROOT / "conf/local.yaml"), [f"train.backend={name}", f"train.np={np_}"])
    assert backends.name_of(cfg) == name
    assert backends.backend_of(cfg).needs_spark(cfg) is spark
