"""What both Delta engines share: the errors, the pinned table, table names and URIs, schema differences, the record
every commit carries (writer, claim) and the claims it is checked against, and the engine interface."""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

from pipeline.config_parse import ConfigError
from pipeline.log import get_logger

log = get_logger(__name__)

# Reader features whose files can be read as plain Parquet without changing a row.
SAFE_READER_FEATURES = {"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "checkpointProtection"}


class DeltaError(RuntimeError):
    """A Delta table cannot be read or written as asked; the message names the table and the reason."""


class NoSuchTableError(DeltaError, ConfigError):
    """The table, or the version of it, that the job was given is not there. A configuration error, so the CLI exits
    2 as for any other wrong setting (nothing was read or run), and a DeltaError still, so callers that catch one go
    on doing so.

    `table` and `version` are what was asked for, `latest` the table's latest version (None: the table itself is
    missing), `names` what gave the table and the version: the config keys by default. A caller that took them from
    elsewhere (`lakehouse predict`'s --table and --version) re-raises the error with `named_by`, so the message
    points at what the user typed."""

    CONFIG_KEYS = ("config key 'delta.table'", "config key 'delta.version'")

    def __init__(self, table: str, version: Optional[int] = None, latest: Optional[int] = None,
                 names: Tuple[str, str] = CONFIG_KEYS):
        self.table, self.version, self.latest, self.names = table, version, latest, tuple(names)
        if latest is None:
            message = f"Delta table {table} does not exist ({self.names[0]})"
        else:
            message = (f"Delta table {table} has no version {version} ({self.names[1]}); versions run from 0 to "
                       f"{latest}")
        super().__init__(message)

    def __reduce__(self):
        # the arguments, not the message: an exception is pickled as its class and args, and these are not the message
        return type(self), (self.table, self.version, self.latest, self.names)

    def named_by(self, table_name: str, version_name: str, table: Optional[str] = None) -> "NoSuchTableError":
        """The same error naming `table_name` / `version_name` (e.g. '--table', '--version') as what gave the
        values, and the table as `table` where given (as the user typed it, not the location the engine read)."""
        return NoSuchTableError(self.table if table is None else table, self.version, self.latest,
                                (table_name, version_name))


class SchemaMismatchError(DeltaError):
    """An append's schema differs from the table's; the message names the differing columns."""


class ConcurrentWriteError(DeltaError):
    """A conditional write lost a race: another writer's commit that claims the same key landed after the version
    this write was derived from. `committed` is None when nothing was committed (the caller may re-read and retry),
    or this write's own version when the engine could only detect the race after committing (delta.engine=spark)."""

    def __init__(self, message: str, winners: Sequence[int] = (), committed: Optional[int] = None):
        super().__init__(message)
        self.winners = list(winners)
        self.committed = committed


# The key under which every commit this project writes records who wrote it (inside `userMetadata`, as JSON):
# {"writer": a uuid per write, "claim": the claim of a conditional write, "read_version": what it was derived from}.
COMMIT_KEY = "lakehouse.commit"
# Commits of one conditional write's files after conflicts with commits that do not carry its claim (delta-rs).
COMMIT_RETRIES = 5


def _commit_record(entry: dict) -> dict:
    text = entry.get("userMetadata")
    if not text:
        return {}
    try:
        meta = json.loads(text)
    except (TypeError, ValueError):
        return {}
    record = meta.get(COMMIT_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) else {}


def own_commit(history: Sequence[dict], writer: str) -> Optional[int]:
    """The version of the commit `writer` made, found in `history` (entries as DeltaTable.history gives them)."""
    for entry in history:
        if _commit_record(entry).get("writer") == writer and entry.get("version") is not None:
            return int(entry["version"])
    return None


def claims_after(history: Sequence[dict], claim: str, read_version: Optional[int], before: Optional[int] = None,
                 writer: Optional[str] = None) -> List[int]:
    """Versions after `read_version` (None: the table did not exist, so every version) and before `before` whose
    commit carries `claim` and was not made by `writer`, oldest first: the commits a write derived from
    `read_version` lost its race to."""
    floor = -1 if read_version is None else read_version
    out = []
    for entry in history:
        version = entry.get("version")
        if version is None or version <= floor or (before is not None and version >= before):
            continue
        record = _commit_record(entry)
        if record.get("claim") == claim and record.get("writer") != writer:
            out.append(int(version))
    return sorted(out)


def _lost_race(table: str, claim: str, read_version: Optional[int], winners: Sequence[int],
               committed: Optional[int] = None) -> ConcurrentWriteError:
    read = f"version {read_version}" if read_version is not None else "the table's absence (it did not exist)"
    won = (f"version{'s' if len(winners) > 1 else ''} {', '.join(map(str, winners))}" if winners
           else "a commit made meanwhile")
    done = (f"this write was committed as version {committed} before the race could be seen (delta.engine=spark)"
            if committed is not None else "nothing was committed")
    return ConcurrentWriteError(f"Delta table {table}: a write derived from {read} lost the race to {won}, "
                                f"committed meanwhile by another writer claiming {claim!r}; {done}",
                                winners=winners, committed=committed)


def _user_metadata(commit_metadata: Optional[Dict[str, Any]], writer: str, claim: Optional[str],
                   read_version: Optional[int]) -> str:
    record: Dict[str, Any] = {"writer": writer}
    if claim is not None:
        record.update(claim=claim, read_version=read_version)
    return json.dumps({**(commit_metadata or {}), COMMIT_KEY: record})


@dataclass(frozen=True)
class PinnedTable:
    """A Delta table resolved at one version: what every later step records. `table` is the table's location
    (`table_location`), whatever spelling it was given in: the same table from any working directory."""

    table: str
    version: int
    num_files: int
    num_rows: Optional[int]
    # the SHA-256 of its data files' URIs, sorted, one per line, where the engine reads them from the log alone
    # (delta-rs): what the converted-data cache keys on, known without a Spark job; None: the DataFrame's inputFiles
    files_digest: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.table, str) and self.table:
            object.__setattr__(self, "table", table_location(self.table))


def files_digest(files: Sequence[str]) -> str:
    """The SHA-256 of a version's data-file URIs, sorted, one per line: `PinnedTable.files_digest`."""
    return hashlib.sha256("\n".join(sorted(files)).encode()).hexdigest()


def local_path(table: str) -> Optional[str]:
    """The local filesystem path of a table URI, or None when it lives elsewhere (s3://, dbfs:/, a catalog name)."""
    if catalog_name(table):
        return None
    parsed = urlparse(table)
    if parsed.scheme in ("", "file"):
        return os.path.abspath(parsed.path if parsed.scheme else table)
    return None


_NAME_PART = r"(?:[A-Za-z_][A-Za-z0-9_]*|`[^`]+`)"
_CATALOG_NAME = re.compile(rf"^({_NAME_PART})\.({_NAME_PART})\.({_NAME_PART})$")


def catalog_name(table: str) -> Optional[str]:
    """`table` when it is a three-level catalog name (`catalog.schema.table`, Unity Catalog) rather than a path:
    no scheme, no slash, three identifiers, and no such folder here."""
    if "/" in table or urlparse(table).scheme or not _CATALOG_NAME.match(table) or os.path.exists(table):
        return None
    return table


# What delta-rs (deltalake 1.6) does not round-trip in a local table path: it writes the table at the path as given,
# but reads it as a URL, so what it commits there it cannot read back (found by tests/unit/test_delta_rs_hostile_paths).
_UNSAFE_LOCAL = [
    (re.compile(r"%[0-9A-Fa-f]{2}"), "a percent escape, which delta-rs decodes when it reads a table but not when it "
                                     "writes one (a commit's files are looked for in another folder)"),
    (re.compile(r"[?#]"), "which delta-rs reads as the start of a URL query or fragment (a commit's history, what "
                          "every write checks, is not read back)"),
    (re.compile(r"\\"), "which delta-rs reads as a folder separator (the table is looked for in another folder)"),
]


def refuse_unsafe_local_path(table: str) -> None:
    """Refuse a local table path that delta-rs writes but cannot read back: one holding a percent escape
    (`my tables %20/digits`), `?`, `#` or a backslash. Such a write's commit lands, then is not found, and its
    files were removed as those of a failed write."""
    path = local_path(table)
    for pattern, why in _UNSAFE_LOCAL if path is not None else ():
        match = pattern.search(path)
        if match:
            raise DeltaError(f"Delta table path {path!r} holds {match.group(0)!r}, {why}: the delta-rs engine "
                             f"refuses it before writing anything; choose another path (config key 'delta.table')")


def table_uri(table: str) -> str:
    """Where delta-rs opens `table`: a local path made absolute (one delta-rs cannot read back is refused, see
    refuse_unsafe_local_path), any other URI as written."""
    path = local_path(table)
    if path is not None:
        refuse_unsafe_local_path(table)
    return path if path is not None else table


def table_location(table: str) -> str:
    """Where a Delta table is, in the one spelling every record of a pinned table stores (run params and tags, a
    version's tags, a checkpoint's lineage, the train summary) and every comparison of two tables compares:

    - a local path (relative, with `.` or `..`, through a symbolic link, a `file:` URI, a trailing slash): its
      absolute real path (os.path.realpath), a relative one resolved against the working directory, so the record
      names the same table from wherever it is read;
    - any other URI (s3://bucket/x/, abfss://..., dbfs:/...): as written, its scheme lower-cased and its trailing
      slashes removed (`s3://bucket/x`);
    - a catalog name (catalog.schema.table): the name, as written.

    Idempotent. A record made before locations were stored holds the spelling as typed: reading it through this
    function resolves a relative path against the working directory, as before."""
    if not table or catalog_name(table):
        return table
    path = local_path(table)
    if path is not None:
        return os.path.realpath(path)
    scheme = urlparse(table).scheme
    body = table[len(scheme) + 1:]  # after "scheme:"
    trimmed = body.rstrip("/")
    if not trimmed.strip("/"):  # the root itself (`dbfs:/`, `s3://`) keeps its slashes
        trimmed = "//" if body.startswith("//") else body[:1]
    return f"{scheme.lower()}:{trimmed}"


def same_table(a: str, b: str) -> bool:
    """Whether `a` and `b` name one table: two catalog names part by part, without case and without their backticks
    (Unity Catalog and Spark's catalog compare identifiers so: `main.ml.digits` is Main.ML.`digits`); anything else
    by location (`table_location`)."""
    if catalog_name(a) or catalog_name(b):
        return _catalog_key(a) is not None and _catalog_key(a) == _catalog_key(b)
    return table_location(a) == table_location(b)


def _catalog_key(table: str) -> Optional[Tuple[str, ...]]:
    match = _CATALOG_NAME.match(table) if catalog_name(table) else None
    return tuple(part.strip("`").lower() for part in match.groups()) if match else None


def describe_schema_diff(existing: Dict[str, str], incoming: Dict[str, str]) -> List[str]:
    """Human-readable differences between two {column: type} schemas (empty when equal)."""
    diffs = []
    for name in incoming:
        if name not in existing:
            diffs.append(f"new column '{name}' ({incoming[name]})")
        elif existing[name] != incoming[name]:
            diffs.append(f"column '{name}' is {incoming[name]}, the table has {existing[name]}")
    for name in existing:
        if name not in incoming:
            diffs.append(f"missing column '{name}' ({existing[name]})")
    return diffs


def _spark_types(schema) -> Dict[str, str]:
    return {f.name: f.dataType.simpleString() for f in schema.fields}


class DeltaEngine:
    """The interface both engines implement."""

    name = "?"

    def exists(self, spark, table: str) -> bool:
        raise NotImplementedError

    def latest_version(self, spark, table: str) -> int:
        raise NotImplementedError

    def read(self, spark, table: str, version: Optional[int] = None) -> Tuple["DataFrame", PinnedTable]:
        """A DataFrame of the table at `version` (latest when None) and the version it is pinned to."""
        raise NotImplementedError

    def pin(self, table: str, version: Optional[int] = None) -> Optional[PinnedTable]:
        """The table resolved at `version` (latest when None) from its log alone, with `files_digest`, and no Spark
        work; None when this engine needs Spark to resolve it (a job then reads the table first)."""
        return None

    def write(self, df, table: str, mode: str, partition_by: Sequence[str] = (),
              commit_metadata: Optional[Dict[str, Any]] = None, read_version: Optional[int] = None,
              claim: Optional[str] = None) -> int:
        """Write `df` in one atomic commit (`mode` append|overwrite); return the version of THIS commit.

        The version is this writer's own (found by a writer id recorded with the commit), never just the latest:
        another writer may commit right after. `commit_metadata` is recorded, as JSON, in the commit's
        `userMetadata` (what DESCRIBE HISTORY shows), beside `lakehouse.commit` (writer id, claim).

        A conditional write: with `claim`, `df` was derived from the table at `read_version` (None: the table did
        not exist), and the write must not land after another commit that carries the same `claim` and was made
        after `read_version`. Blind appends never conflict in Delta, so the claim is what makes two such writers
        conflict. Raises ConcurrentWriteError naming the winner's version.
        """
        raise NotImplementedError

    def history(self, spark, table: str) -> List[dict]:
        raise NotImplementedError

    def claimed_versions(self, spark, table: str, claim: str) -> List[int]:
        """The versions whose commit carries `claim` (a conditional write's), oldest first; [] when none does or the
        table does not exist. How a writer that claims its own identity (predict) finds that it already committed."""
        if not self.exists(spark, table):
            return []
        return claims_after(self.history(spark, table), claim, None)

    def commit_metadata(self, spark, table: str, version: Optional[int] = None) -> Dict[str, Any]:
        """The `commit_metadata` written with `version` (latest when None); {} when the commit has none, or has
        another writer's `userMetadata` that is not a JSON object (plain text: none of ours)."""
        version = self.latest_version(spark, table) if version is None else version
        for entry in self.history(spark, table):
            if entry.get("version") == version:
                text = entry.get("userMetadata")
                try:
                    meta = json.loads(text) if text else {}
                except (TypeError, ValueError):
                    return {}
                return meta if isinstance(meta, dict) else {}
        raise DeltaError(f"Delta table {table} has no commit {version} in its history")

    def check_location(self, table: str) -> None:
        """Refuse, before anything is read or written, a `delta.table` this engine cannot both write and read back
        (DeltaError naming it and why); nothing to refuse by default."""

    def check_append_schema(self, spark, table: str, df) -> None:
        if not self.exists(spark, table):
            return
        existing, _ = self.read(spark, table)
        diffs = describe_schema_diff(_spark_types(existing.schema), _spark_types(df.schema))
        if diffs:
            raise SchemaMismatchError(f"append to Delta table {table} refused, the schema differs: {'; '.join(diffs)}. "
                                      f"The table was left at version {self.latest_version(spark, table)}.")


def refuse_catalog_name(table: str, engine: str) -> None:
    if catalog_name(table):
        raise DeltaError(f"config key 'delta.table': {table!r} is a catalog table name (catalog.schema.table), which "
                         f"delta.engine={engine} cannot resolve; use delta.engine=spark (the catalog's own Spark "
                         f"session, e.g. on Databricks) or give the table's path (e.g. /Volumes/<catalog>/<schema>/...)")
