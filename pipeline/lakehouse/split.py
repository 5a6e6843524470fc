"""The train/val split rule, its one home: which rows are validation, in Python and as a Spark filter.

A row is in validation when the CRC-32 of its `data.split_key` value (mod SPLIT_BUCKETS) falls under
round(`data.val_fraction` x SPLIT_BUCKETS). Training splits the table with it in Spark (`split_frame`, called by
pipeline.data.convert); the promotion gate picks the rows a model held out with it in Python (`in_split`, delta-rs)
or in Spark (`held_out_frame`, a catalog-named table), pipeline.tracking.heldout. Both forms are built from
`val_buckets` and the same key, so they never disagree.
"""
from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

SPLIT_BUCKETS = 10_000
# What a row's split bucket is computed from (`data.split_key`). content: the SHA-256 of the row's bytes, the same
# wherever the files were mounted when ingested (and a duplicate image always on the same side); path: the absolute
# path, the rule before the key existed (a table re-ingested from another mount changes every bucket).
SPLIT_KEYS = ("content", "path")
# A run that records no `data.split_key` was trained before the key existed: with this rule.
LEGACY_SPLIT_KEY = "path"
# The column in which ingest stores each row's SHA-256 of `content` (lowercase hex, as hashlib and Spark's sha2 give
# it): the content key is read from it, 64 bytes a row, where a stored value has that form; a row without one (a
# table written before the column, or by another writer) has its bytes hashed, as every row once was.
DIGEST = "sha256"
_DIGEST_FORM = re.compile(r"[0-9a-f]{64}")


def _check_key(split_key: str) -> None:
    if split_key not in SPLIT_KEYS:
        raise ValueError(f"config key 'data.split_key': {split_key!r} is not one of {', '.join(SPLIT_KEYS)}")


def val_buckets(val_fraction: float) -> int:
    """How many of the SPLIT_BUCKETS buckets are validation: a row whose bucket is below this is held out."""
    return round(val_fraction * SPLIT_BUCKETS)


def split_bucket(key: str) -> int:
    """Bucket of a row key in [0, SPLIT_BUCKETS): CRC-32 of the UTF-8 bytes, as Spark's crc32()."""
    return zlib.crc32(key.encode("utf-8")) % SPLIT_BUCKETS


def is_validation(key: str, val_fraction: float) -> bool:
    """A row is in the validation split when its bucket falls under the fraction.

    It depends on the key alone, so a row stays in its split when the table grows.
    """
    return split_bucket(key) < val_buckets(val_fraction)


def split_rule(split_key: str) -> str:
    """The split rule of `data.split_key`, in words (recorded in the conversion cache's key and the gate's tags)."""
    _check_key(split_key)
    return (f"crc32(sha256(content) hex) % {SPLIT_BUCKETS}" if split_key == "content" else
            f"crc32(path) % {SPLIT_BUCKETS}")


def stored_digest(value: Optional[str]) -> Optional[str]:
    """A row's stored DIGEST value where it has the form of one (64 lowercase hex digits); else None: hash the
    bytes."""
    return value if isinstance(value, str) and _DIGEST_FORM.fullmatch(value) else None


def row_key(split_key: str, path: Optional[str], content: Optional[bytes], digest: Optional[str] = None) \
        -> Optional[str]:
    """The string a row's bucket is computed from under `split_key` (None: the row has no such value; it is in no
    split): for `content`, the row's stored DIGEST (`stored_digest`) or else the SHA-256 of its bytes. `bucket_column`
    is the same in Spark."""
    _check_key(split_key)
    if split_key == "content":
        digest = stored_digest(digest)
        if digest is not None:
            return digest
        return None if content is None else hashlib.sha256(content).hexdigest()
    return path


@dataclass(frozen=True)
class HoldOut:
    """How one model's training held rows out: its `data.val_fraction` and `data.split_key`."""

    val_fraction: float
    split_key: str = LEGACY_SPLIT_KEY

    def describe(self) -> str:
        return f"val_fraction {self.val_fraction:g} by {self.split_key}"


def held_out_by_all(holdouts: Iterable[HoldOut], split: str = "val") -> Tuple[HoldOut, ...]:
    """The conditions of the rows in `split` for EVERY one of `holdouts`: `val`, the rows none of them trained on;
    `train`, the rows all of them trained on.

    Under one split key a smaller fraction's validation rows are a subset of a larger one's (the bucket is below
    `val_buckets(fraction)`), so per key the smallest fraction is the intersection of the validation rows, and the
    largest leaves the intersection of the training rows; under different keys the row must be held out (or trained
    on) under each (sorted by key, so the result is the same in any order).
    """
    pick = min if split == "val" else max
    smallest: dict = {}
    for h in holdouts:
        _check_key(h.split_key)
        smallest[h.split_key] = pick(smallest.get(h.split_key, h.val_fraction), h.val_fraction)
    if not smallest:
        raise ValueError("held_out_by_all needs at least one hold-out")
    return tuple(HoldOut(f, k) for k, f in sorted(smallest.items()))


def in_split(split: str, conditions: Tuple[HoldOut, ...], path: Optional[str], content: Optional[bytes],
             digest: Optional[str] = None) -> bool:
    """Whether a row is in `split` under all `conditions` (see `held_out_by_all`): `val` when every condition holds it
    out, `train` when none does (rows every model trained on). A row without a key value is in neither."""
    held = []
    for c in conditions:
        key = row_key(c.split_key, path, content, digest)
        if key is None:
            return False
        held.append(is_validation(key, c.val_fraction))
    return all(held) if split == "val" else not any(held)


def stored_digest_column():
    """The Spark column of a row's stored DIGEST where it has the form of one (`stored_digest`), else null."""
    from pyspark.sql import functions as F

    # Java's `$` also matches before a final line break, where Python's fullmatch does not: `\z` is the very end
    return F.when(F.col(DIGEST).rlike(f"^{_DIGEST_FORM.pattern}\\z"), F.col(DIGEST))


def bucket_column(split_key: str, with_digest: bool = False):
    """The Spark column of a row's split bucket under `split_key`: `split_bucket(row_key(...))`, computed by Spark
    (sha2 gives the same lowercase hex as hashlib; crc32 the same checksum as zlib). Null where the key value is.
    `with_digest`: the frame has the DIGEST column, whose well-formed values are the content key (`stored_digest`)."""
    from pyspark.sql import functions as F

    _check_key(split_key)  # a key that is not one of SPLIT_KEYS is refused, naming the config key
    key = F.sha2(F.col("content"), 256) if split_key == "content" else F.col("path")
    if split_key == "content" and with_digest:
        key = F.coalesce(stored_digest_column(), key)
    return F.pmod(F.crc32(key.cast("binary")), F.lit(SPLIT_BUCKETS))


def held_out_frame(df, conditions: Tuple[HoldOut, ...], split: str = "val"):
    """The rows of `df` in `split` under every one of `conditions` (`held_out_by_all`): `val`, the rows every model
    held out; `train`, the rows every model trained on. `in_split`'s rule, run in Spark (the DIGEST column read where
    `df` has it)."""
    with_digest = DIGEST in df.columns
    for c in conditions:
        bucket, threshold = bucket_column(c.split_key, with_digest), val_buckets(c.val_fraction)
        df = df.filter(bucket < threshold) if split == "val" else df.filter(bucket.isNotNull() & (bucket >= threshold))
    return df


def split_frame(df, val_fraction: float, split_key: str = LEGACY_SPLIT_KEY):
    """(train, val) of `df` by the rule of `data.val_fraction` and `data.split_key`: the one place Spark splits a
    table for training (a row without a key value is in neither)."""
    rule = (HoldOut(val_fraction, split_key),)
    return held_out_frame(df, rule, "train"), held_out_frame(df, rule, "val")
