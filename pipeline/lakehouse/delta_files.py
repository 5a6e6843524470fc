"""A Delta version's own data files for the direct path: pinned by delta-rs from the log alone (no Spark, no JVM), with
each file's row count, a digest of the file list, the protocol's features, and a pyarrow filesystem to read them.

Row counts come from the log's add-action stats (`numRecords`), else from the file's Parquet footer (metadata only).
A table whose protocol needs a reader feature a plain Parquet read would get wrong (deletion vectors, column
mapping, any feature not known to be safe) is refused with a ConfigError naming the table and the feature: the
direct path never trains on the wrong set of rows.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import unquote, urlparse

from pipeline.config_parse import ConfigError
from pipeline.lakehouse.delta_common import (SAFE_READER_FEATURES, files_digest, local_path, refuse_catalog_name,
                                             table_location, table_uri)
from pipeline.log import get_logger

log = get_logger(__name__)

FOOTER_THREADS = 8  # Parquet footers read at once for files whose add action has no numRecords


@dataclass(frozen=True)
class DataFile:
    """One data file of a pinned version: its URI (what the digest hashes), its size and its row count."""

    uri: str
    size: int
    rows: int


@dataclass(frozen=True)
class DeltaFiles:
    """A Delta table pinned at one version, as the direct path reads it: the data files in the log's order of their
    URIs (sorted, so every process numbers them alike), the digest of that list (`PinnedTable.files_digest`'s rule),
    and the protocol. `storage_options` go to delta-rs and to the pyarrow filesystem; they are never printed."""

    table: str
    version: int
    files: Tuple[DataFile, ...]
    digest: str
    min_reader_version: int
    reader_features: Tuple[str, ...] = ()
    writer_features: Tuple[str, ...] = ()
    columns: Tuple[str, ...] = ()
    partition_columns: Tuple[str, ...] = ()
    storage_options: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return sum(f.rows for f in self.files)

    def filesystem(self, uri: str):
        """(pyarrow filesystem, path inside it) of one of this table's files."""
        return arrow_filesystem(uri, self.storage_options)


def _options(storage_options: Optional[Mapping[str, str]]) -> Dict[str, str]:
    return {str(k).lower(): str(v) for k, v in (storage_options or {}).items()}


def _first(opts: Dict[str, str], *keys: str) -> Optional[str]:
    for k in keys:
        if opts.get(k):
            return opts[k]
    return None


def _truthy(value: Optional[str]) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def arrow_filesystem(uri: str, storage_options: Optional[Mapping[str, str]] = None):
    """(pyarrow filesystem, path inside it) for a table or data-file URI: a local path or file://, s3://, gs:// (or
    gcs://), abfss:// (or abfs://, az://), with delta-rs's storage option names (case-insensitive) mapped onto the
    filesystem's arguments (s3: aws_access_key_id, aws_secret_access_key, aws_session_token, aws_region,
    aws_endpoint_url, aws_allow_http; gs: google_access_token, google_endpoint_url, google_anonymous; azure:
    azure_storage_account_name, azure_storage_account_key).

    Raises:
        ConfigError: a scheme no filesystem here reads, naming the URI.
    """
    import pyarrow.fs as pafs

    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    opts = _options(storage_options)
    if scheme in ("", "file"):
        return pafs.LocalFileSystem(), os.path.abspath(parsed.path if scheme else uri)
    body = f"{parsed.netloc}{parsed.path}"
    if scheme in ("s3", "s3a"):
        kwargs: Dict[str, Any] = {}
        for arg, keys in (("access_key", ("aws_access_key_id", "access_key_id")),
                          ("secret_key", ("aws_secret_access_key", "secret_access_key")),
                          ("session_token", ("aws_session_token", "session_token")),
                          ("region", ("aws_region", "region", "aws_default_region")),
                          ("endpoint_override", ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"))):
            value = _first(opts, *keys)
            if value is not None:
                kwargs[arg] = value
        if _truthy(opts.get("aws_allow_http") or opts.get("allow_http")):
            kwargs["scheme"] = "http"
        return pafs.S3FileSystem(**kwargs), body
    if scheme in ("gs", "gcs"):
        kwargs = {}
        token = _first(opts, "google_access_token", "access_token")
        if token is not None:
            import datetime

            kwargs["access_token"] = token
            kwargs["credential_token_expiration"] = (datetime.datetime.now(datetime.timezone.utc)
                                                     + datetime.timedelta(hours=1))
        endpoint = _first(opts, "google_endpoint_url", "endpoint_override")
        if endpoint is not None:
            kwargs["endpoint_override"] = endpoint
        if _truthy(opts.get("google_anonymous") or opts.get("anonymous")):
            kwargs["anonymous"] = True
        return pafs.GcsFileSystem(**kwargs), body
    if scheme in ("abfss", "abfs", "az", "azure"):
        # abfss://<container>@<account>.dfs.core.windows.net/<path>: the container and the path, the account from the
        # host unless the options name it
        container, _, host = parsed.netloc.partition("@")
        account = _first(opts, "azure_storage_account_name", "account_name") or (host.split(".")[0] if host else None)
        kwargs = {"account_name": account}
        key = _first(opts, "azure_storage_account_key", "azure_storage_access_key", "account_key", "access_key")
        if key is not None:
            kwargs["account_key"] = key
        azure = getattr(pafs, "AzureFileSystem", None)
        if azure is None:
            raise ConfigError(f"Delta table file {uri}: this pyarrow ({_pyarrow_version()}) has no AzureFileSystem "
                              f"(pyarrow >= 16 has); the direct path (data.source=direct) cannot read abfss:// here; "
                              f"use data.source=converted")
        return azure(**kwargs), f"{container}{parsed.path}"
    raise ConfigError(f"Delta table file {uri}: scheme {scheme!r} is not one the direct path (data.source=direct) "
                      f"reads (file, s3, gs, abfss)")


def log_file_uri(root: str, path: str) -> str:
    """The data file an add (or remove) action of the Delta log names, as the URI or local path it is at: the log's
    `path` is a URI (RFC 2396), relative to the table's `root` or absolute, so it is URL-decoded once (delta-rs's
    `file_uris()` does the same): a partition value "cam 1" is the folder `source=cam%201`, in the log
    `source=cam%25201`. A `file:` URI becomes its local path."""
    if path[:5].lower() == "file:":
        return unquote(urlparse(path).path)
    decoded = unquote(path)
    if "://" in path or os.path.isabs(decoded):
        return decoded
    return f"{root.rstrip('/')}/{decoded}"


def _pyarrow_version() -> str:
    import pyarrow

    return pyarrow.__version__


def unreadable_features(table: str, min_reader_version: int, reader_features, column_mapping_mode: Optional[str]) \
        -> List[str]:
    """What in a table's protocol the direct path cannot read correctly (empty: it can), in words."""
    features = set(reader_features or ())
    out = []
    if "deletionVectors" in features:
        out.append("deletionVectors (rows deleted by a deletion vector are still in the Parquet files; pyarrow does "
                   "not apply them)")
    if (column_mapping_mode or "none") != "none":  # the feature listed with mode none: names are the table's
        out.append(f"columnMapping (mode {column_mapping_mode or 'none'}: the Parquet files' column names are not "
                   f"the table's)")
    out += sorted(f for f in features - SAFE_READER_FEATURES - {"deletionVectors", "columnMapping"})
    if min_reader_version > 3:
        out.append(f"minReaderVersion {min_reader_version}")
    return out


def check_direct_readable(table: str, min_reader_version: int, reader_features, column_mapping_mode: Optional[str]) \
        -> None:
    """Refuse, naming the table and the feature(s), what the direct path would read wrongly.

    Raises:
        ConfigError: naming the table, the feature(s) and the way out (data.source=converted).
    """
    unsafe = unreadable_features(table, min_reader_version, reader_features, column_mapping_mode)
    if unsafe:
        raise ConfigError(f"config key 'data.source': Delta table {table} uses table feature(s) {'; '.join(unsafe)} "
                          f"that the direct path cannot read correctly; it is refused rather than trained on the "
                          f"wrong rows. Use data.source=converted (with delta.engine=spark where the Delta jars read "
                          f"the feature)")


def _footer_rows(uri: str, storage_options: Mapping[str, str]) -> int:
    import pyarrow.parquet as pq

    fs, path = arrow_filesystem(uri, storage_options)
    try:
        with fs.open_input_file(path) as fh:
            return pq.read_metadata(fh).num_rows
    except Exception as exc:
        raise ConfigError(f"Delta table data file {uri}: its Parquet footer cannot be read "
                          f"({type(exc).__name__}: {exc})") from None


def pin_files(table: str, version: Optional[int] = None,
              storage_options: Optional[Mapping[str, str]] = None) -> DeltaFiles:
    """Pin `table` at `version` (latest when None) with delta-rs and list its data files with their row counts.

    Raises:
        ConfigError: a catalog name, a table that is not there, a missing version, a feature the direct path cannot
            read (`check_direct_readable`), a data file the log lists but storage lacks, each named.
    """
    import pyarrow as pa
    from deltalake import DeltaTable

    refuse_catalog_name(table, "delta-rs")
    uri = table_uri(table)
    options = dict(storage_options or {})
    try:
        dt = DeltaTable(uri, version=version, storage_options=options or None)
    except Exception as exc:
        at = f" at version {version} (config key 'delta.version')" if version is not None else ""
        raise ConfigError(f"config key 'delta.table': Delta table {table} cannot be opened{at} by delta-rs "
                          f"({type(exc).__name__}: {exc})") from None
    proto = dt.protocol()
    meta = dt.metadata()
    mode = (meta.configuration or {}).get("delta.columnMapping.mode")
    check_direct_readable(table, proto.min_reader_version, proto.reader_features, mode)
    root = uri.rstrip("/")
    actions = pa.table(dt.get_add_actions(flatten=True)).select(["path", "size_bytes", "num_records"]).to_pylist()
    entries = []
    for act in actions:
        full = log_file_uri(root, act["path"])
        entries.append((full, int(act["size_bytes"]), act["num_records"]))
    entries.sort(key=lambda e: e[0])
    missing = [full for full, _, _ in entries
               if local_path(full) is not None and not os.path.exists(local_path(full))]
    if missing:
        raise ConfigError(f"Delta table {table} version {dt.version()} references {len(missing)} data file(s) that "
                          f"do not exist, e.g. {missing[0]}; restore them or time-travel to another version "
                          f"(config key 'delta.version')")
    unknown = [full for full, _, rows in entries if rows is None]
    footer: Dict[str, int] = {}
    if unknown:  # another writer left no stats: the footers, metadata only, a few at a time
        with ThreadPoolExecutor(min(FOOTER_THREADS, len(unknown))) as pool:
            footer = dict(zip(unknown, pool.map(lambda u: _footer_rows(u, options), unknown)))
        log.info("Delta table %s: %d of %d file(s) have no numRecords in the log; row counts read from their footers",
                 table, len(unknown), len(entries))
    files = tuple(DataFile(full, size, int(rows) if rows is not None else footer[full]) for full, size, rows in entries)
    pinned = DeltaFiles(table=table_location(table), version=dt.version(), files=files,
                        digest=files_digest([f.uri for f in files]), min_reader_version=proto.min_reader_version,
                        reader_features=tuple(proto.reader_features or ()),
                        writer_features=tuple(proto.writer_features or ()),
                        columns=tuple(pa.schema(dt.schema().to_arrow()).names),
                        partition_columns=tuple(meta.partition_columns or ()), storage_options=options)
    log.info("Delta table %s pinned at version %d for the direct path: %d file(s), %d rows", pinned.table,
             pinned.version, len(files), pinned.num_rows)
    return pinned
