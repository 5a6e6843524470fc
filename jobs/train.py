"""spark-submit / Databricks entry for `lakehouse train`: pinned Delta table -> Horovod ranks -> MLflow run and model version.

Usage: spark-submit --master spark://HOST:7077 jobs/train.py --conf conf/cluster.yaml spark.master=spark://HOST:7077 \
       train.np=2 key=value ...
(spark-submit's --master and spark.master must agree: a job is refused where they name different places.)
The arguments are those of `lakehouse train`; the last stdout line is its JSON result.
"""
import sys

from pipeline.cli import main

# The guard matters: horovod.run / horovod.spark.run pickle functions and start fresh interpreters.
if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
