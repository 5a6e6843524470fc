"""The demo's closing summary: what was trained on what, where it is registered, and how to look at it."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List, Optional

from pipeline.config import load_config


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def render_summary(result: dict, tracking_uri: str, alias_version: Optional[str]) -> str:
    """The summary of `lakehouse train`'s JSON line; a key the line lacks (an older line, a run left offline) or
    holds null shows as '-'."""
    def get(key: str) -> Any:
        value = result.get(key)
        return "-" if value is None else value

    version = result.get("model_version")
    if version is None:
        registered = f"{get('model_name')}: not registered"
    else:
        registered = f"{get('model_name')} version {version}"
    lines = [
        "",
        "== lakehouse demo ==",
        f"  Delta table     {get('delta_table')} @ version {get('delta_version')} "
        f"({get('rows_train')} train / {get('rows_val')} val rows)",
        f"  training        {get('backend')} on {get('world_size')} rank(s), {get('epochs')} epoch(s)"
        f"{' (stopped early)' if result.get('stopped_early') else ''}",
        f"  validation      accuracy {_number(result.get('val_acc'))}, loss {_number(result.get('val_loss'))}",
        f"  MLflow run      {get('run_id')}",
        f"  registered      {registered}",
        f"  champion alias  version {alias_version or '-'}"
        f"{' (this run)' if version is not None and str(alias_version) == str(version) else ''}",
    ]
    if result.get("offline_run"):  # MLflow never came back: the run waits in its folder
        lines.append(f"  left offline    upload and register it with: lakehouse sync-run {result['offline_run']}")
    lines += [
        "",
        f"  open the MLflow UI on this store:  .venv/bin/mlflow ui --backend-store-uri {tracking_uri} --port 5000",
    ]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m pipeline.summary TRAIN_OUTPUT [--conf F] [key=value ...]`, the overrides anywhere after the file:
    intermixed parsing takes them between options too, where argparse would give the positional overrides only the
    block next to the file (`FILE --conf F a=1` was refused)."""
    parser = argparse.ArgumentParser(description="print the demo summary from `lakehouse train` output")
    parser.add_argument("train_output")
    parser.add_argument("--conf", default="conf/local.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, as given to `lakehouse train`")
    args = parser.parse_intermixed_args(argv)
    with open(args.train_output) as fh:
        last = [line for line in fh.read().splitlines() if line.strip().startswith("{")][-1]
    result = json.loads(last)
    cfg = load_config(args.conf, args.overrides)
    from mlflow.tracking import MlflowClient

    uri = result.get("tracking_uri") or cfg.mlflow.tracking_uri
    try:
        alias = MlflowClient(uri).get_model_version_by_alias(result.get("model_name"), "champion").version
    except Exception:
        alias = None
    print(render_summary(result, uri, alias))
    return 0


if __name__ == "__main__":
    sys.exit(main())
