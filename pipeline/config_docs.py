"""conf/base.yaml and docs/configuration.md, generated from the config dataclasses (the only home of the defaults).

`python -m pipeline.config_docs` rewrites both; `python -m pipeline.config_docs --check` fails when either drifted
from the code (tests/unit/test_config_docs.py runs the check). A key's meaning is its comment in pipeline/config.py:
the comment lines right above the field and the one at the end of its line.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml

from pipeline import config as config_module
from pipeline.config import Config

ROOT = Path(__file__).resolve().parent.parent
BASE_YAML = ROOT / "conf" / "base.yaml"
CONFIG_MD = ROOT / "docs" / "configuration.md"
HEADER = ("# GENERATED from pipeline/config.py by `python -m pipeline.config_docs`: do not edit (a test fails when it\n"
          "# drifts). Every key with its default. Profiles (local.yaml, cluster.yaml, databricks.yaml) override some;\n"
          "# any key can be overridden on the command line: `lakehouse train --conf conf/local.yaml train.np=-2`.\n")


def field_comments() -> Dict[Tuple[str, str], str]:
    """{(dataclass name, field name): its comment} read from pipeline/config.py's source."""
    source = Path(config_module.__file__).read_text()
    lines = source.splitlines()
    comments: Dict[int, str] = {}  # line number (1-based) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out: Dict[Tuple[str, str], str] = {}
    cls = None
    for i, line in enumerate(lines, start=1):
        if line.startswith("class "):
            cls = line[len("class "):].split("(")[0].split(":")[0].strip()
            continue
        stripped = line.strip()
        if cls is None or not line.startswith("    ") or line.startswith("     ") or ":" not in stripped \
                or stripped.startswith(("#", "def ", "@", '"""')):
            continue
        name = stripped.split(":")[0].strip()
        if not name.isidentifier():
            continue
        above: List[str] = []
        j = i - 1
        while j >= 1 and lines[j - 1].strip().startswith("#"):
            above.insert(0, comments.get(j, ""))
            j -= 1
        text = " ".join(above + ([comments[i]] if i in comments and not stripped.startswith("#") else []))
        out[(cls, name)] = text.strip()
    return out


def _scalar(value: Any) -> str:
    """A default as YAML writes it on one line (null, true, 0.0001, [.png, .jpg], {})."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def _keys(cls: type = Config, prefix: str = "") -> List[Tuple[str, type, bool, Any]]:
    """(dotted key, the dataclass declaring it, whether it is a section, its default) for every key, in declaration
    order, a section before its keys."""
    out = []
    defaults = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.append((key, cls, True, None))
            out.extend(_keys(hints[f.name], key))
        else:
            out.append((key, cls, False, getattr(defaults, f.name)))
    return out


def base_yaml() -> str:
    comments = field_comments()
    buf = [HEADER]
    for key, owner, section, default in _keys():
        name = key.rsplit(".", 1)[-1]
        indent = "  " * key.count(".")
        note = comments.get((owner.__name__, name), "")
        if section:
            buf.append(f"{indent + name + ':':<40} # {note}\n" if note else f"{indent}{name}:\n")
            continue
        line = f"{indent}{name}: {_scalar(default)}"
        buf.append(f"{line:<40} # {note}\n" if note else line + "\n")
    return "".join(buf)


def configuration_md() -> str:
    comments = field_comments()
    out = ["# Configuration\n\n",
           "GENERATED from `pipeline/config.py` by `python -m pipeline.config_docs` (a test fails when it drifts): "
           "every key, its default and its meaning. Profiles in `conf/` override some keys; any key can be set on the "
           "command line as `key=value` (`lakehouse train --conf conf/local.yaml train.np=-2 model.lr=0.05`). "
           "`spark.conf` takes Spark's own keys: `spark.conf.spark.sql.shuffle.partitions=8`.\n",
           "\n## Profiles\n\n"
           "A command reads the profile its `--conf` names; without `--conf`, the one the `LAKEHOUSE_CONF` environment "
           "variable names, else `conf/local.yaml`. That default and the default paths (`work/...` and "
           "`sqlite:///work/mlflow.db`: the table, the cache, the checkpoints, the MLflow store) are relative to the "
           "working directory, not to the project: run the commands from the project root, or give absolute paths "
           "(started elsewhere, a command fails with `config file conf/local.yaml does not exist`, or, given an "
           "absolute `--conf`, reads and writes a `work/` of its own there).\n\n"
           "The profile is merged over `base.yaml` in the profile's own folder, where there is one. A profile with "
           "`extends: FILE` is merged over FILE instead, a path relative to the profile's folder (or absolute), and a "
           "FILE that does not exist is an error, since the keys it holds would silently keep their defaults. It is "
           "one level: FILE's own `extends:` is not followed, and the `base.yaml` beside the profile is not read "
           "(`conf/databricks/*.yaml` say `extends: ../base.yaml`, their folder having none). A key in neither file "
           "keeps the code's default (the one `conf/base.yaml` lists), and `key=value` overrides on the command line "
           "come last. A key no section has is refused, naming the key and, in a profile, its file.\n"]
    for key, owner, section, default in _keys():
        name = key.rsplit(".", 1)[-1]
        if section:
            note = comments.get((owner.__name__, name), "")
            out.append(f"\n## `{key}`\n\n{note + chr(10) + chr(10) if note else ''}"
                       "| key | default | meaning |\n| --- | --- | --- |\n")
            continue
        note = comments.get((owner.__name__, name), "").replace("|", "\\|")
        out.append(f"| `{key}` | `{_scalar(default)}` | {note} |\n")
    return "".join(out)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.config_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated file differs from the code")
    args = parser.parse_args(argv)
    drifted = []
    for path, text in ((BASE_YAML, base_yaml()), (CONFIG_MD, configuration_md())):
        if args.check:
            if not path.exists() or path.read_text() != text:
                drifted.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if drifted:
        print(f"{', '.join(drifted)} drifted from pipeline/config.py: run `python -m pipeline.config_docs`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
