"""Ingest: an image folder (one sub-folder per class) read by Spark, validated, written as one Delta commit that accounts for every file."""
from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import pandas as pd

from pipeline.config import Config
from pipeline.lakehouse.delta import get_engine
from pipeline.log import get_logger

log = get_logger(__name__)

TABLE_COLUMNS = ["path", "label", "label_index", "width", "height", "mode", "content"]

# Why a file under the source was not ingested: every file is either a row or one of these, with its path.
SKIP_REASONS = {
    "hidden_name": "its name, or a folder's on its path, starts with '_' or '.' (metadata by convention; "
                   "Spark's binaryFile never reads these)",
    "symlink_outside": "a symbolic link to something outside the source",
    "broken_symlink": "a symbolic link whose target does not exist",
    "symlinked_folder": "a symbolic link to a folder inside the source (its files are accounted at their own paths)",
    "not_a_file": "not a regular file (a FIFO, socket or device)",
    "unsupported_extension": "its extension is not in ingest.extensions",
    "zero_byte": "an empty file",
    "too_large": "larger than 2 GiB, the most Spark's binaryFile reads",
    "unreadable": "it cannot be opened or listed (permissions, or it vanished)",
    "no_label": "too few folders between the source and the file to give a label (ingest.label_depth)",
    "undecodable": "not an image that Pillow can decode",
    "duplicate": "the same bytes (SHA-256) as a file that was ingested",
    "not_read": "listed here but not returned by Spark's binaryFile (changed while ingesting?)",
}
_MAX_BINARY_FILE = 2**31 - 1
_LOGGED_SKIPS = 20
_COMMIT_SKIPS = 10_000  # skipped files listed in the commit (the counts are always complete): the log stays small


class IngestError(RuntimeError):
    """The ingest cannot proceed; nothing was written."""


class SkippedFile(NamedTuple):
    path: str
    reason: str  # a key of SKIP_REASONS
    detail: str


@dataclass
class SourceListing:
    """What a walk of the source found: the files to read with their labels, and those skipped before reading."""

    root: str
    candidates: List[Tuple[str, str, bool]] = field(default_factory=list)  # (path, label, is_symlink)
    skipped: List[SkippedFile] = field(default_factory=list)

    @property
    def files_found(self) -> int:
        return len(self.candidates) + len(self.skipped)


@dataclass
class IngestResult:
    table: str
    version: int
    rows_written: int
    skipped: List[SkippedFile] = field(default_factory=list)
    classes: Dict[str, int] = field(default_factory=dict)  # label -> label_index
    files_found: int = 0
    label_rule: str = ""

    def skipped_counts(self) -> Dict[str, int]:
        return skipped_counts(self.skipped)

    def summary(self) -> dict:
        return {"delta_table": self.table, "delta_version": self.version, "rows_written": self.rows_written,
                "files_found": self.files_found, "skipped": len(self.skipped),
                "skipped_counts": self.skipped_counts(), "skipped_files": [s.path for s in self.skipped],
                "skipped_detail": [s._asdict() for s in self.skipped], "label_rule": self.label_rule,
                "classes": self.classes}


def skipped_counts(skipped: Sequence[SkippedFile]) -> Dict[str, int]:
    """{reason: number of files}, in the order of SKIP_REASONS."""
    counts = Counter(s.reason for s in skipped)
    return {r: counts[r] for r in SKIP_REASONS if counts[r]}


def _counts_text(skipped: Sequence[SkippedFile]) -> str:
    return ", ".join(f"{r}={n}" for r, n in skipped_counts(skipped).items()) or "none"


def label_rule(depth: int) -> str:
    """The label rule of `ingest.label_depth`, in words (logged and recorded with the commit)."""
    if depth > 0:
        shape = "/".join(["SOURCE"] + ["*"] * (depth - 1) + ["<label>", "...", "<file>"])
        return f"the label is folder {depth} under the source ({shape}; ingest.label_depth={depth})"
    shape = "/".join(["SOURCE", "...", "<label>"] + ["*"] * (-depth - 1) + ["<file>"])
    return f"the label is folder {-depth} above the file ({shape}; ingest.label_depth={depth})"


def extension_glob(extensions: Sequence[str]) -> str:
    """A Hadoop glob matching file names that end with any of `extensions`, in any case ('*{.[pP][nN][gG]}')."""
    def anycase(ext: str) -> str:
        return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else ("\\" + c if c in "{}[]*?\\,^" else c)
                       for c in ext)

    return "*{" + ",".join(anycase(e) for e in extensions) + "}"


def _hidden(name: str) -> bool:
    return name.startswith("_") or name.startswith(".")


def _inside(path: str, real_root: str) -> bool:
    return os.path.commonpath([path, real_root]) == real_root


def list_source(root: str, extensions: Sequence[str], label_depth: int) -> SourceListing:
    """Walk `root` (symbolic links not followed) and sort every entry into a file to read or a skipped file.

    Spark's binaryFile listing silently drops zero-byte files and names starting with '_' or '.', so the
    accounting is done here, not from what Spark returns.
    """
    root = os.path.abspath(root)
    real_root = os.path.realpath(root)
    exts = tuple(e.lower() for e in extensions)
    out = SourceListing(root=root)

    def skip(path: str, reason: str, detail: str) -> None:
        out.skipped.append(SkippedFile(path, reason, detail))

    def unlistable(exc: OSError) -> None:
        skip(exc.filename or root, "unreadable", f"folder cannot be listed: {exc.strerror or exc}")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        folders = [] if rel_dir == "." else rel_dir.split(os.sep)
        for name in dirnames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                continue
            target = os.path.realpath(full)
            if not os.path.exists(full):
                skip(full, "broken_symlink", f"symbolic link to missing {os.readlink(full)}")
            elif not _inside(target, real_root):
                skip(full, "symlink_outside", f"symbolic link to folder {target}, outside {real_root}")
            else:
                skip(full, "symlinked_folder", f"symbolic link to folder {target}, not followed")
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            hidden = [p for p in folders + [name] if _hidden(p)]
            is_link = os.path.islink(full)
            if is_link:
                target = os.path.realpath(full)
                if not os.path.exists(full):
                    skip(full, "broken_symlink", f"symbolic link to missing {os.readlink(full)}")
                    continue
                if not _inside(target, real_root):
                    skip(full, "symlink_outside", f"symbolic link to {target}, outside {real_root}")
                    continue
            if hidden:
                skip(full, "hidden_name", f"'{hidden[0]}' starts with '{hidden[0][0]}'")
                continue
            try:
                st = os.stat(full)
            except OSError as exc:
                skip(full, "unreadable", f"cannot stat: {exc.strerror or exc}")
                continue
            if not stat.S_ISREG(st.st_mode):
                skip(full, "not_a_file", "not a regular file")
                continue
            if not name.lower().endswith(exts):
                ext = os.path.splitext(name)[1] or "(no extension)"
                skip(full, "unsupported_extension", f"{ext} is not one of ingest.extensions ({', '.join(exts)})")
                continue
            if st.st_size == 0:
                skip(full, "zero_byte", "0 bytes")
                continue
            if st.st_size > _MAX_BINARY_FILE:
                skip(full, "too_large", f"{st.st_size} bytes")
                continue
            if not os.access(full, os.R_OK):
                skip(full, "unreadable", "no read permission")
                continue
            if len(folders) < abs(label_depth):
                skip(full, "no_label", f"{len(folders)} folder(s) between the source and the file; "
                                       f"ingest.label_depth={label_depth} needs {abs(label_depth)}")
                continue
            label = folders[label_depth - 1] if label_depth > 0 else folders[label_depth]
            out.candidates.append((full, label, is_link))
    out.skipped.sort(key=lambda s: s.path)
    return out


def _validate_udf():
    from pyspark.sql.functions import pandas_udf

    from pipeline.data.transforms import ImageDecodeError, inspect_image

    @pandas_udf("width int, height int, mode string, error string")
    def validate(content: pd.Series) -> pd.DataFrame:
        rows = []
        for blob in content:
            if blob is None:  # a listed file Spark did not return; reported as not_read
                rows.append((None, None, None, None))
                continue
            try:
                w, h, m = inspect_image(bytes(blob))
                rows.append((w, h, m, None))
            except ImageDecodeError as exc:
                rows.append((None, None, None, str(exc)))
        return pd.DataFrame(rows, columns=["width", "height", "mode", "error"])

    return validate


def _existing_classes(engine, spark, table: str) -> Dict[str, int]:
    if not engine.exists(spark, table):
        return {}
    df, _ = engine.read(spark, table)
    if "label" not in df.columns or "label_index" not in df.columns:
        return {}
    return {r["label"]: int(r["label_index"]) for r in df.select("label", "label_index").distinct().collect()}


def is_strict(cfg: Config) -> bool:
    """`ingest.strict`, or its older spelling `ingest.on_bad_file=fail`."""
    return bool(cfg.ingest.strict) or cfg.ingest.on_bad_file == "fail"


def _log_skipped(skipped: Sequence[SkippedFile]) -> None:
    for s in skipped[:_LOGGED_SKIPS]:
        log.warning("skipped %s: %s (%s)", s.path, s.reason, s.detail)
    if len(skipped) > _LOGGED_SKIPS:
        log.warning("... and %d more skipped file(s), all listed in the ingest report", len(skipped) - _LOGGED_SKIPS)


def ingest_folder(spark, cfg: Config, source: str, mode: str = "append") -> IngestResult:
    """Read `source/<class>/.../<image>` with Spark, validate every image and write one Delta commit.

    Every file under the source is either written as a row or listed, with its path and a reason (see
    SKIP_REASONS), in the result and in the commit's `userMetadata`. With `ingest.strict` (or the older
    `ingest.on_bad_file=fail`) any skipped file fails the ingest before anything is written. An append
    keeps the table's existing label indices and gives new classes the next free ones.

    Raises:
        IngestError: the folder is missing or has nothing to ingest, or a file is skipped under strict.
        SchemaMismatchError: an append whose columns differ from the table's (table untouched).
    """
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if mode not in ("append", "overwrite"):
        raise IngestError(f"--mode {mode!r} is not append or overwrite")
    root = os.path.abspath(source)
    if not os.path.isdir(root):
        raise IngestError(f"ingest source {source} is not a folder")
    engine = get_engine(cfg.delta.engine)
    table = cfg.delta.table
    strict = is_strict(cfg)
    rule = label_rule(cfg.ingest.label_depth)
    log.info("ingesting %s: %s%s", root, rule, "; strict: any skipped file fails the ingest" if strict else "")

    listing = list_source(root, cfg.ingest.extensions, cfg.ingest.label_depth)
    if listing.files_found == 0:
        raise IngestError(f"ingest source {source} holds no files")
    skipped = list(listing.skipped)
    labels: List[str] = []
    checked = None
    try:
        if listing.candidates:
            candidates = spark.createDataFrame(listing.candidates, "path string, label string, is_link boolean")
            # only image files are read: a large archive beside them is neither read nor fails the scan
            files = (spark.read.format("binaryFile").option("recursiveFileLookup", "true")
                     .option("pathGlobFilter", extension_glob(cfg.ingest.extensions)).load("file://" + root)
                     .filter(F.col("length") <= _MAX_BINARY_FILE)
                     .select(F.regexp_replace("path", "^file:", "").alias("path"), "content"))
            checked = (candidates.join(files, on="path", how="left")
                       .withColumn("_v", _validate_udf()(F.col("content")))
                       .select("path", "label", "is_link", "content", "_v.width", "_v.height", "_v.mode",
                               F.when(F.col("content").isNull(), F.lit("not_read"))
                               .when(F.col("_v.error").isNotNull(), F.lit("undecodable")).alias("reason"),
                               F.when(F.col("content").isNull(), F.lit(SKIP_REASONS["not_read"]))
                               .otherwise(F.col("_v.error")).alias("detail"),
                               F.sha2(F.col("content"), 256).alias("sha256")))
            checked = checked.persist(StorageLevel.MEMORY_AND_DISK)
            skipped += [SkippedFile(r["path"], r["reason"], r["detail"]) for r in
                        checked.filter(F.col("reason").isNotNull()).select("path", "reason", "detail").collect()]
            # duplicates by content: the first path (a real file before a link to it) is kept
            by_hash = Window.partitionBy("sha256").orderBy("is_link", "path")
            ranked = (checked.filter(F.col("reason").isNull()).select("path", "sha256", "is_link")
                      .withColumn("_n", F.row_number().over(by_hash))
                      .withColumn("_kept", F.first("path").over(by_hash)))
            dups = ranked.filter(F.col("_n") > 1).select("path", "_kept").collect()
            skipped += [SkippedFile(r["path"], "duplicate", f"same content as {r['_kept']}") for r in dups]
            good = checked.filter(F.col("reason").isNull())
            if dups:
                good = good.join(spark.createDataFrame([(r["path"],) for r in dups], "path string"), "path",
                                 "left_anti")
            labels = sorted(r["label"] for r in good.select("label").distinct().collect())
        skipped.sort(key=lambda s: s.path)
        counts = _counts_text(skipped)
        _log_skipped(skipped)
        if skipped and strict:
            first = "; ".join(f"{s.path} ({s.reason}: {s.detail})" for s in skipped[:5])
            raise IngestError(f"ingest.strict: {len(skipped)} of {listing.files_found} file(s) under {source} would "
                              f"be skipped ({counts}), nothing written. First: {first}"
                              f"{' ...' if len(skipped) > 5 else ''}")
        if not labels:
            raise IngestError(f"nothing to ingest in {source}: all {listing.files_found} file(s) skipped ({counts}); "
                              f"nothing written")

        classes = _existing_classes(engine, spark, table) if mode == "append" else {}
        for label in labels:
            if label not in classes:
                classes[label] = max(classes.values(), default=-1) + 1
        mapping = spark.createDataFrame(sorted(classes.items()), "label string, label_index int")
        out = good.join(F.broadcast(mapping), on="label", how="left").select(*TABLE_COLUMNS)
        rows = out.count()
        report = {"source": root, "files_found": listing.files_found, "rows_written": rows, "label_rule": rule,
                  "skipped_counts": skipped_counts(skipped), "skipped": [s._asdict() for s in skipped[:_COMMIT_SKIPS]]}
        if len(skipped) > _COMMIT_SKIPS:
            report["skipped_not_listed"] = len(skipped) - _COMMIT_SKIPS
        version = engine.write(out, table, mode, commit_metadata={"lakehouse.ingest": report})
        log.info("ingested %d of %d file(s) from %s into %s version %d; skipped %d: %s", rows, listing.files_found,
                 source, table, version, len(skipped), counts)
        return IngestResult(table=table, version=version, rows_written=rows, skipped=skipped, classes=classes,
                            files_found=listing.files_found, label_rule=rule)
    finally:
        if checked is not None:
            checked.unpersist()


def ingest_report(spark, cfg: Config, version: Optional[int] = None) -> Optional[dict]:
    """The ingest report recorded with a commit of `delta.table` (latest when `version` is None), or None."""
    engine = get_engine(cfg.delta.engine)
    return engine.commit_metadata(spark, cfg.delta.table, version).get("lakehouse.ingest")
