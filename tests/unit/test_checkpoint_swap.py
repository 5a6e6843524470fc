"""A checkpoint appears whole or not at all: a sharded folder is written beside its name and swapped in, a crash at any
point leaves the previous checkpoint or the new one (never a mix), and `settle` finishes or undoes a swap a crash cut
between its two renames. One process (torch.distributed.checkpoint without a process group)."""
import os

import pytest
import torch

from pipeline.distributed.checkpoints import (ASIDE, STAGED, checkpoint_meta, consolidated_state, leftovers, settle,
                                              swap_in, write_atomically, write_sharded)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant


class OneRank:
    """The strategy a one-process write_sharded calls (Lightning's FSDP strategy has the same three members)."""

    global_rank = 0

    def broadcast(self, obj):
        return obj

    def barrier(self, name=None):
        pass


class Died(Exception):
    """What a rank killed at a fault hook stands for here: nothing after it runs."""


def _save(path, step, value, part_written=None):
    """A Lightning-shaped checkpoint at `step`, its one weight filled with `value`, written as FSDP writes it."""
    checkpoint = {"global_step": step, "epoch": step, "state_dict": {"w": torch.full((4, 3), float(value))},
                  "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}]}
    write_sharded(OneRank(), checkpoint, path, part_written)


def _step_and_weight(path):
    return checkpoint_meta(str(path))["global_step"], float(consolidated_state(str(path))["w"].unique())


def _dies(path):
    raise Died(path)


def _save_dying(path, step, value):
    """`_save` with the rank stopping at the fault hook (torch.distributed.checkpoint hands its exception on)."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as err:
        _save(path, step, value, part_written=_dies)
    assert isinstance(err.value.failures[0][0], Died)  # (rank 0's exception, its traceback)


def test_a_sharded_write_replaces_the_previous_folder_whole_and_leaves_nothing_beside_it(tmp_path):
    last = tmp_path / "last.ckpt"
    _save(last, 5, 1.0)
    assert _step_and_weight(last) == (5, 1.0)
    _save(last, 10, 2.0)
    assert _step_and_weight(last) == (10, 2.0)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_rank_dying_once_its_shard_is_written_leaves_the_previous_checkpoint(tmp_path):
    last = tmp_path / "last.ckpt"
    _save(last, 5, 1.0)
    _save_dying(last, 10, 2.0)
    assert _step_and_weight(last) == (5, 1.0)  # shard of step 10 on disk, but not in last.ckpt
    staged, aside = leftovers(last)
    assert [os.path.basename(s) for s in staged] == [os.path.basename(staged[0])] and not aside
    assert os.path.basename(staged[0]).startswith(f"last.ckpt{STAGED}10-")
    assert any(f.endswith(".distcp") for f in os.listdir(staged[0]))  # the dead rank's shard, never read
    assert settle(last) == str(last)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"] and _step_and_weight(last) == (5, 1.0)
    _save(last, 15, 3.0)  # the next save of the relaunched job
    assert _step_and_weight(last) == (15, 3.0) and sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_the_first_write_killed_leaves_no_checkpoint_rather_than_a_partial_one(tmp_path):
    last = tmp_path / "last.ckpt"
    _save_dying(last, 5, 1.0)
    assert not last.exists()
    assert settle(last) is None and os.listdir(tmp_path) == []


def _cut_between_the_renames(tmp_path, new_complete: bool):
    """A swap of step 10 over step 5 that a crash cut after the old folder was renamed aside: no last.ckpt."""
    last = tmp_path / "last.ckpt"
    _save(last, 5, 1.0)
    new = tmp_path / "new.ckpt"
    _save(new, 10, 2.0)
    if not new_complete:
        os.unlink(new / "meta.pt")
    os.replace(last, tmp_path / f"last.ckpt{ASIDE}1a2b3c4d")
    os.replace(new, tmp_path / f"last.ckpt{STAGED}10-5e6f7a8b")
    return last


def test_settle_finishes_a_swap_cut_between_its_two_renames(tmp_path):
    last = _cut_between_the_renames(tmp_path, new_complete=True)
    assert not last.exists()
    assert settle(last) == str(last)
    assert _step_and_weight(last) == (10, 2.0)  # every rank had written it: the swap goes through
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_settle_puts_the_old_folder_back_when_the_new_one_is_incomplete(tmp_path):
    last = _cut_between_the_renames(tmp_path, new_complete=False)
    assert settle(last) == str(last)
    assert _step_and_weight(last) == (5, 1.0)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_settle_removes_a_folder_set_aside_once_the_new_one_is_in(tmp_path):
    last = tmp_path / "last.ckpt"
    _save(last, 5, 1.0)
    os.makedirs(tmp_path / f"last.ckpt{ASIDE}1a2b3c4d")  # a crash after the second rename, before the removal
    assert settle(last) == str(last) and _step_and_weight(last) == (5, 1.0)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_settle_leaves_other_checkpoints_alone(tmp_path):
    best, last = tmp_path / "best.ckpt", tmp_path / "last.ckpt"
    _save(best, 5, 1.0)
    _save(last, 5, 1.0)
    os.makedirs(tmp_path / f"best.ckpt{STAGED}10-00000000")
    settle(last)
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt", f"best.ckpt{STAGED}10-00000000", "last.ckpt"]


def test_reading_a_checkpoint_leaves_the_users_own_files_beside_it(tmp_path):
    """Only what this project wrote is settled: a user's backups named like `<name>.old-*` / `<name>.tmp-*` beside a
    checkpoint survive every read of it, and one beside a missing checkpoint is never renamed into its place."""
    from pipeline.config import ConfigError
    from pipeline.distributed.checkpoints.layout import resolve_restore_point

    prod = tmp_path / "prod.ckpt"
    write_atomically({"global_step": 7, "state_dict": {"w": torch.ones(2)}}, str(prod))
    users = {"prod.ckpt.old-2024-06-01": "a file", "prod.ckpt.old-1a2b3c4d": "a file", "prod.ckpt.tmp-3-5e6f7a8b": "",
             "prod.ckpt.tmp-notes": "text", "gone.ckpt.old-2024-06-01": "a backup of a checkpoint since deleted"}
    for name, text in users.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "prod.ckpt.old-folder").mkdir()
    assert resolve_restore_point(str(prod), str(tmp_path)) == str(prod)
    assert checkpoint_meta(str(prod))["global_step"] == 7 and settle(prod) == str(prod)
    assert settle(tmp_path / "gone.ckpt") is None
    with pytest.raises(ConfigError, match="gone.ckpt does not exist"):
        resolve_restore_point(str(tmp_path / "gone.ckpt"), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([*users, "prod.ckpt", "prod.ckpt.old-folder"])
    assert all((tmp_path / name).read_text() == text for name, text in users.items())
    assert leftovers(prod) == ([], [])


def test_swap_in_over_a_file_and_over_nothing(tmp_path):
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "x").write_text("new")
    path = tmp_path / "last.ckpt"
    path.write_text("a file checkpoint")
    swap_in(str(staged), str(path))
    assert (path / "x").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    other = tmp_path / "other"
    other.mkdir()
    swap_in(str(other), str(tmp_path / "fresh.ckpt"))
    assert (tmp_path / "fresh.ckpt").is_dir()


def test_a_file_checkpoint_killed_before_its_rename_keeps_the_previous_file(tmp_path):
    path = tmp_path / "last.ckpt"
    write_atomically({"global_step": 1, "w": torch.ones(2)}, str(path))
    with pytest.raises(Died):
        write_atomically({"global_step": 2, "w": torch.zeros(2)}, str(path), part_written=_dies)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file is removed with the exception
