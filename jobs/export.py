"""spark-submit / Databricks entry for `lakehouse export`: a registered model version -> ONNX or TorchScript + contract, logged to its run.

Usage: python jobs/export.py --model models:/NAME@champion --format onnx|torchscript [--out DIR] --conf conf/local.yaml key=value ...
The arguments are those of `lakehouse export`; the last stdout line is its JSON result.
"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
