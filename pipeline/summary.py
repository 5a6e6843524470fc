"""The demo's closing summary: what was trained on what, where it is registered, and how to look at it."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from pipeline.config import load_config


def render_summary(result: dict, tracking_uri: str, alias_version: Optional[str]) -> str:
    lines = [
        "",
        "== lakehouse demo ==",
        f"  Delta table     {result['delta_table']} @ version {result['delta_version']} "
        f"({result['rows_train']} train / {result['rows_val']} val rows)",
        f"  training        {result['backend']} on {result['world_size']} rank(s), {result['epochs']} epoch(s)"
        f"{' (stopped early)' if result['stopped_early'] else ''}",
        f"  validation      accuracy {result['val_acc']:.4f}, loss {result['val_loss']:.4f}",
        f"  MLflow run      {result['run_id']}",
        f"  registered      {result['model_name']} version {result['model_version']}",
        f"  champion alias  version {alias_version or '-'}"
        f"{' (this run)' if str(alias_version) == str(result['model_version']) else ''}",
        "",
        f"  open the MLflow UI on this store:  .venv/bin/mlflow ui --backend-store-uri {tracking_uri} --port 5000",
    ]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="print the demo summary from `lakehouse train` output")
    parser.add_argument("train_output")
    parser.add_argument("--conf", default="conf/local.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    with open(args.train_output) as fh:
        last = [line for line in fh.read().splitlines() if line.strip().startswith("{")][-1]
    result = json.loads(last)
    cfg = load_config(args.conf, args.overrides)
    from mlflow.tracking import MlflowClient

    uri = result.get("tracking_uri") or cfg.mlflow.tracking_uri
    try:
        alias = MlflowClient(uri).get_model_version_by_alias(result["model_name"], "champion").version
    except Exception:
        alias = None
    print(render_summary(result, uri, alias))
    return 0


if __name__ == "__main__":
    sys.exit(main())
