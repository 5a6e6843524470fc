"""From a pinned Delta DataFrame to Petastorm converters: split, decode once, repartition, cache as Parquet, plan."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple
from urllib.parse import urlparse

import pandas as pd

from pipeline.config import Config
from pipeline.lakehouse.partition import SPLIT_BUCKETS, ShardPlan, num_partitions, plan_split
from pipeline.log import get_logger, quiet_third_party_warnings

quiet_third_party_warnings()
log = get_logger(__name__)


class ConversionError(RuntimeError):
    """Converted data cannot be read; the message names the file."""


@dataclass
class ConvertedData:
    """What crosses from the driver into the training processes: picklable, no Spark inside."""

    train: "object"  # petastorm SparkDatasetConverter
    val: "object"
    plan: ShardPlan
    class_names: List[str]
    image_size: int
    channels: int

    @property
    def rows(self) -> Tuple[int, int]:
        return self.plan.train.total_rows, self.plan.val.total_rows

    def delete(self) -> None:
        """Remove the cached Parquet of both converters."""
        for conv in (self.train, self.val):
            try:
                conv.delete()
            except Exception as exc:  # already gone, or a remote store that refuses
                log.warning("could not delete converter cache %s: %s", getattr(conv, "cache_dir_url", "?"), exc)


def split_frame(df, val_fraction: float):
    """(train, val) by the CRC-32 bucket of `path`, the same rule as `partition.is_validation`."""
    from pyspark.sql import functions as F

    bucket = F.pmod(F.crc32(F.col("path").cast("binary")), F.lit(SPLIT_BUCKETS))
    threshold = round(val_fraction * SPLIT_BUCKETS)
    return df.filter(bucket >= threshold), df.filter(bucket < threshold)


def _decode_udf(image_size: int, channels: int):
    from pyspark.sql.functions import pandas_udf

    from pipeline.data.transforms import decode_image

    @pandas_udf("binary")
    def decode(content: pd.Series) -> pd.Series:
        return pd.Series([decode_image(bytes(b), image_size, channels).tobytes() for b in content])

    return decode


def prepare_split(df, cfg: Config, world_size: int):
    """Decode each image once (Spark executors), keep pixels + label, repartition for the ranks."""
    from pyspark.sql import functions as F

    parts = num_partitions(cfg.data.partitions_per_worker, world_size)
    decode = _decode_udf(cfg.data.image_size, cfg.data.channels)
    return (df.select(decode(F.col("content")).alias("pixels"), F.col("label_index").cast("int").alias("label_index"))
            .repartition(parts))


def cache_dir_url(cache_dir: str) -> str:
    parsed = urlparse(cache_dir)
    if parsed.scheme in ("", "file"):
        path = os.path.abspath(parsed.path if parsed.scheme else cache_dir)
        os.makedirs(path, exist_ok=True)
        return "file://" + path
    return cache_dir


_CONVERTERS: dict = {}  # cache_dir_url -> converter made in this process (local caches)


def make_converter(spark, df, cache_dir: str):
    """`make_spark_converter` with the cache under `data.cache_dir` (a cache hit for the same plan).

    For a local cache the same Petastorm cache is used, but the file list and row count come from the
    Parquet footers instead of a Spark read + count job, and a cache hit returns the converter made before
    without any Spark job (petastorm 0.12.1 runs both on every call; `lakehouse bench` measured the hit
    at 10-20 % of a first conversion). Other stores go through `make_spark_converter` unchanged.
    """
    import glob

    import pyarrow.parquet as pq
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from petastorm.spark import spark_dataset_converter as sdc

    parent = cache_dir_url(cache_dir)
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, parent)
    if urlparse(parent).scheme != "file":
        return make_spark_converter(df)
    # The arguments make_spark_converter(df) uses by default, so both paths share one cache entry.
    url = sdc._cache_df_or_retrieve_cache_data_url(df, sdc._get_parent_cache_dir_url(), sdc.DEFAULT_ROW_GROUP_SIZE_BYTES,
                                                   "uncompressed", "float32")
    path = urlparse(url).path
    conv = _CONVERTERS.get(url)
    if conv is None or not os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "*.parquet")))
        rows = sum(pq.read_metadata(f).num_rows for f in files)
        conv = SparkDatasetConverter(url, ["file://" + f for f in files], rows)
        _CONVERTERS[url] = conv
    return conv


def row_group_rows(converter) -> List[int]:
    """Rows in each row group, in the order Petastorm's reader numbers them (shard = index % count).

    Reads only Parquet footers, the same way `make_batch_reader` lists row groups.

    Raises:
        ConversionError: a cached file is missing or unreadable (e.g. truncated), named.
    """
    import pyarrow.parquet as pq
    from petastorm.etl import dataset_metadata
    from petastorm.fs_utils import get_filesystem_and_path_or_paths
    from petastorm.reader import normalize_dataset_url_or_urls

    urls = normalize_dataset_url_or_urls(converter.file_urls)
    fs, paths = get_filesystem_and_path_or_paths(urls)
    for url, path in zip(urls, paths):
        try:
            pq.read_metadata(fs.open(path))
        except Exception as exc:
            raise ConversionError(f"converted Parquet file {url} is unreadable ({type(exc).__name__}: {exc}); "
                                  f"delete the cache folder {converter.cache_dir_url} to convert again") from None
    dataset = pq.ParquetDataset(paths, filesystem=fs, validate_schema=False, metadata_nthreads=10)
    pieces = dataset_metadata.load_row_groups(dataset)
    return [piece.get_metadata().row_group(piece.row_group).num_rows for piece in pieces]


def convert_for_training(spark, df, cfg: Config, world_size: int, class_names: List[str]) -> ConvertedData:
    """Split, prepare and convert the pinned DataFrame, then plan the shards before any rank starts.

    Raises:
        PlanError: a rank would get no data (with rows, row groups, ranks).
    """
    train_df, val_df = split_frame(df, cfg.data.val_fraction)
    train_conv = make_converter(spark, prepare_split(train_df, cfg, world_size), cfg.data.cache_dir)
    val_conv = make_converter(spark, prepare_split(val_df, cfg, world_size), cfg.data.cache_dir)
    plan = ShardPlan(
        train=plan_split("train", row_group_rows(train_conv), world_size, cfg.data.batch_size),
        val=plan_split("val", row_group_rows(val_conv), world_size, cfg.data.batch_size),
    )
    log.info("shard plan for %d rank(s): %s", world_size, plan.describe())
    return ConvertedData(train=train_conv, val=val_conv, plan=plan, class_names=class_names,
                         image_size=cfg.data.image_size, channels=cfg.data.channels)


def class_names_of(df) -> List[str]:
    """Class names ordered by label_index (a gap gets a placeholder name)."""
    pairs = {int(r["label_index"]): r["label"] for r in df.select("label", "label_index").distinct().collect()}
    if not pairs:
        return []
    return [pairs.get(i, f"class_{i}") for i in range(max(pairs) + 1)]


def check_cache_visible(cache_dir: str, spark_master: str) -> Optional[str]:
    """A reason the converter cache cannot serve a cluster's executors, or None.

    A local path works when every process runs on this machine (local[N], a standalone cluster on
    127.0.0.1); on a real cluster it must be storage every executor mounts (dbfs:/, s3://, hdfs://,
    or a shared file system mount).
    """
    scheme = urlparse(cache_dir).scheme
    is_local_master = spark_master.startswith("local") or "127.0.0.1" in spark_master or "localhost" in spark_master
    if scheme in ("", "file") and not is_local_master and not os.environ.get("LAKEHOUSE_SHARED_FS"):
        return (f"config key 'data.cache_dir' is {cache_dir!r}, a local path, but spark.master {spark_master!r} "
                f"runs executors on other machines that cannot see it; point it at shared storage "
                f"(dbfs:/..., s3://..., hdfs://...) or set LAKEHOUSE_SHARED_FS=1 if it is a shared mount")
    return None
