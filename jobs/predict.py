"""spark-submit / Databricks entry for `lakehouse predict`: a pinned Delta table scored by a registered model -> one Delta commit.

Usage: spark-submit jobs/predict.py --model models:/NAME@champion --table IN --out OUT [--version N] --conf conf/local.yaml key=value ...
The arguments are those of `lakehouse predict`; the last stdout line is its JSON result.
"""
import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["predict", *sys.argv[1:]]))
