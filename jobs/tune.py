"""spark-submit / Databricks entry for `lakehouse tune`: an Optuna sweep, each trial a train in an MLflow child run.

Usage: spark-submit --master spark://HOST:7077 jobs/tune.py --conf conf/cluster.yaml --space conf/search/demo.yaml \
       [--trials N] [--resume STUDY] spark.master=spark://HOST:7077
(spark-submit's --master and spark.master must agree: a job is refused where they name different places.)
The arguments are those of `lakehouse tune`; the last stdout line is its JSON result.
"""
import sys

from pipeline.cli import main

# The guard matters: horovod.run / horovod.spark.run pickle functions and start fresh interpreters.
if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
