"""Checkpoints, in one home: where they live and what they are called, and a job's snapshot of another run's
(layout.py, no torch), reading and writing them whole or not at all and without running code (io.py), what each
records and the driver's checks before a resume (record.py), and restating one for another batch, world size or
number of steps per epoch (restate.py).

Every public name is importable from here. The layout's are imported at once; the others (torch) on first use, so the
driver, which resolves and settles checkpoint paths before any rank starts, imports no torch through this package.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.distributed.checkpoints.layout import (ASIDE, BEST, DCP_METADATA, LAST, META_FILE, NAMES,
                                                     RESTORE_POINT, STAGED, discard_snapshot, identity,
                                                     is_sharded_checkpoint, last_checkpoint, leftovers, linked_copy,
                                                     resolve_restore_point, restore_path, run_checkpoint_dir, settle,
                                                     snapshot, swap_in)

if TYPE_CHECKING:  # the lazy names' modules, as the type checker and the import linter see them
    from pipeline.distributed.checkpoints import io, record, restate  # noqa: F401

# name -> the module (beside this one) that holds it, imported when the name is first asked for
_LAZY = {
    **dict.fromkeys(("CheckpointError", "check_sharded", "checkpoint_meta", "consolidated_state",
                     "plain_shard_reader", "read_checkpoint", "read_index", "refusals_unwrapped", "sharded_state",
                     "write_atomically", "write_sharded"), "io"),
    **dict.fromkeys(("LINEAGE", "SPLIT", "TRAINED_WITH", "CheckpointLineageError", "CheckpointRecord", "RngCheckpoint",
                     "check_checkpoint_lineage", "check_resume", "classifier_from_checkpoint", "config_param_groups",
                     "config_split", "data_split", "optimizer_record", "plain_classifier", "recorded_training",
                     "trained_with"), "record"),
    **dict.fromkeys(("converted_position", "rescale_checkpoint", "restated"), "restate"),
}

__all__ = ["ASIDE", "BEST", "DCP_METADATA", "LAST", "META_FILE", "NAMES", "RESTORE_POINT", "STAGED",
           "discard_snapshot", "identity", "is_sharded_checkpoint", "last_checkpoint", "leftovers", "linked_copy",
           "resolve_restore_point", "restore_path", "run_checkpoint_dir", "settle", "snapshot", "swap_in", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
