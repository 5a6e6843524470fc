"""The config a job hands its ranks (workflow.for_the_ranks) holds no secret only the driver uses: spark.conf's secret
values (the driver's Spark session) and tune.storage's password (the sweep's study) are redacted, as the tracking
URI's credentials were; every other setting is the driver's. The job travels through the ranks' launcher (horovod.run's
key-value store is plain HTTP on the driver's interfaces) and, for ranks started early, through a file."""
import pickle

from pipeline.config import load_config
from pipeline.workflow import for_the_ranks


def test_the_ranks_config_keeps_no_driver_secret_and_everything_else():
    azure = "spark.conf.spark.hadoop.fs.azure.account.key.a.dfs.core.windows.net"
    cfg = load_config("conf/local.yaml", ["spark.conf.spark.hadoop.fs.s3a.secret.key=S3SECRET", f"{azure}=AZSECRET",
                                          "spark.conf.spark.sql.shuffle.partitions=4",
                                          "tune.storage=postgresql://optuna:DBSECRET@db.example.com/optuna",
                                          "train.np=-2", "data.batch_size=16"])
    ranks, uri = for_the_ranks(cfg, "sqlite:///x.db")
    blob = pickle.dumps(ranks)
    for secret in (b"S3SECRET", b"DBSECRET", b"AZSECRET"):
        assert secret not in blob
    assert ranks.spark.conf["spark.sql.shuffle.partitions"] == "4"
    assert ranks.spark.conf["spark.hadoop.fs.s3a.secret.key"] == "***redacted***"
    assert ranks.tune.storage == "postgresql://optuna:***@db.example.com/optuna"
    assert (ranks.train, ranks.data, ranks.model, ranks.delta) == (cfg.train, cfg.data, cfg.model, cfg.delta)
    assert uri == "sqlite:///x.db"
    assert cfg.spark.conf["spark.hadoop.fs.s3a.secret.key"] == "S3SECRET"  # the driver's own config is unchanged
