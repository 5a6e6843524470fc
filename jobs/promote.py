"""spark-submit / Databricks entry for `lakehouse promote`: gate a model version against the champion.

Usage: spark-submit jobs/promote.py --conf conf/local.yaml [--version N] key=value ...
The arguments are those of `lakehouse promote`; the last stdout line is its JSON result.
"""
import sys

from pipeline.cli import main

# The guard matters: horovod.run / horovod.spark.run pickle functions and start fresh interpreters.
if __name__ == "__main__":
    sys.exit(main(["promote", *sys.argv[1:]]))
