"""What crosses from the driver into the ranks: converted splits (files, row groups) and the shard plan; no Spark inside."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from pipeline.lakehouse.partition import ShardPlan

# The columns of a converted split, in the order the converter writes them: decoded pixels (data.decode=convert) ...
PIXELS, LABEL, ROW_ID = "pixels", "label_index", "row_id"
COLUMNS = (PIXELS, LABEL, ROW_ID)
# ... or the table's encoded image bytes and the row's path (data.decode=cpu|gpu|auto: the ranks decode every epoch)
CONTENT, PATH = "content", "path"
ENCODED_COLUMNS = (CONTENT, LABEL, ROW_ID, PATH)
LAYOUTS = {"pixels": COLUMNS, "encoded": ENCODED_COLUMNS}
# Bumped whenever the converted files' layout changes: entries of another format are rebuilt, never misread.
FORMAT_VERSION = 3

READERS = ("petastorm", "arrow")


class ConversionError(RuntimeError):
    """Converted data cannot be read or written; the message names the file (and row group)."""


@dataclass
class ConvertedSplit:
    """One split's converted Parquet files and their row groups, in the order every reader numbers them.

    Row group i of `row_groups` belongs to shard ``i % world_size`` (Petastorm's `cur_shard` rule); the files are
    sorted by name and each file's row groups taken in order, which is how Petastorm lists them too.
    """

    name: str
    cache_dir_url: str  # the split's folder (file://... or another filesystem URL)
    file_urls: List[str]
    row_groups: List[Tuple[int, int, int]] = field(default_factory=list)  # (file index, group in file, rows)

    @property
    def row_group_rows(self) -> List[int]:
        return [rows for _, _, rows in self.row_groups]

    @property
    def rows(self) -> int:
        return sum(self.row_group_rows)

    def shard(self, rank: int, world_size: int) -> List[Tuple[int, int, int]]:
        """The row groups of `rank`, in global order."""
        return [g for i, g in enumerate(self.row_groups) if i % world_size == rank]


@dataclass
class ConvertedData:
    """The converted train/val splits of a pinned table, the plan over the ranks, and what the model needs."""

    train: ConvertedSplit
    val: ConvertedSplit
    plan: ShardPlan
    class_names: List[str]
    image_size: int
    channels: int
    key: str = ""  # the cache entry (content key) both splits live in
    entry_url: str = ""  # the cache entry's folder
    layout: str = "pixels"  # pixels: decoded at conversion; encoded: the ranks decode (LAYOUTS)

    @property
    def rows(self) -> Tuple[int, int]:
        return self.plan.train.total_rows, self.plan.val.total_rows
