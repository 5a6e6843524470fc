"""spark-submit / Databricks entry for `lakehouse ingest`: image folder -> one Delta commit.

Usage: spark-submit jobs/ingest.py --source DIR --mode overwrite --conf conf/local.yaml key=value ...
The arguments are those of `lakehouse ingest`; the last stdout line is its JSON result.
"""
import sys

from pipeline.cli import main

# The guard matters: horovod.run / horovod.spark.run pickle functions and start fresh interpreters.
if __name__ == "__main__":
    sys.exit(main(["ingest", *sys.argv[1:]]))
