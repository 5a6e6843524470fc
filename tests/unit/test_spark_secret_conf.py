"""Which spark.conf settings the project's session is started with (PySpark's `spark-submit --conf`, a command line
every user of the machine reads) and which it is given once it runs (lakehouse.spark.split_secret_conf): a
spark.hadoop.* secret waits, unless a setting given at start names a remote file system Spark opens then (Hadoop would
cache it keyless); any other secret-looking setting is given at start, with a warning naming it, never its value."""
import logging

from pipeline.lakehouse.spark import split_secret_conf

KEY = "spark.hadoop.fs.s3a.secret.key"


def test_a_hadoop_secret_waits_for_the_running_session_and_the_rest_starts_it():
    public, secret = split_secret_conf({KEY: "S3CRET", "spark.sql.shuffle.partitions": "4",
                                        "spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9000",
                                        "spark.hadoop.javax.jdo.option.ConnectionURL": "jdbc:mysql://u:pw@db/x"})
    assert public == {"spark.sql.shuffle.partitions": "4", "spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9000"}
    assert secret == {KEY: "S3CRET", "spark.hadoop.javax.jdo.option.ConnectionURL": "jdbc:mysql://u:pw@db/x"}


def test_a_remote_file_system_opened_at_start_keeps_the_hadoop_secrets_at_start_saying_so(caplog):
    caplog.set_level(logging.WARNING, logger="pipeline.lakehouse.spark")
    public, secret = split_secret_conf({KEY: "S3CRET", "spark.eventLog.dir": "s3a://bucket/logs"})
    assert secret == {} and public == {KEY: "S3CRET", "spark.eventLog.dir": "s3a://bucket/logs"}
    assert "spark.eventLog.dir" in caplog.text and KEY in caplog.text and "S3CRET" not in caplog.text


def test_a_start_time_secret_is_given_at_start_with_a_warning_naming_it(caplog):
    caplog.set_level(logging.WARNING, logger="pipeline.lakehouse.spark")
    public, secret = split_secret_conf({"spark.authenticate.secret": "T0KEN"})
    assert public == {"spark.authenticate.secret": "T0KEN"} and secret == {}
    assert "spark.authenticate.secret" in caplog.text and "T0KEN" not in caplog.text
