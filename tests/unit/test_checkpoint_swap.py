"""A checkpoint appears whole or not at all: a sharded folder is written beside its name and swapped in, a crash at any
point leaves the previous checkpoint or the new one (never a mix), and `settle` finishes or undoes a swap a crash cut
between its two renames. One process (torch.distributed.checkpoint without a process group)."""
import os
import time

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


# ------------------------------------------------------------------ another run's folder, a staged folder lost
class Hooked(OneRank):
    """One rank whose barriers call `at[name](staged folders)`: what happens beside the write at that moment."""

    def __init__(self, at):
        self.at = at

    def barrier(self, name=None):
        if name in self.at:
            self.at[name]()


def _runs(tmp_path):
    a, b = tmp_path / "runA", tmp_path / "runB"
    a.mkdir()
    b.mkdir()
    return a, b


def test_resuming_another_runs_checkpoint_never_touches_the_save_that_run_is_making(tmp_path, monkeypatch):
    """Job B resolves `runA/last` at the moment run A's rank 0 is about to write meta.pt into its staged folder (every
    shard and the index on disk): A's folder is read as it stands, A's save completes, B gets A's previous one."""
    from pipeline.distributed.checkpoints import io as cio
    from pipeline.distributed.checkpoints.layout import resolve_restore_point

    run_a, run_b = _runs(tmp_path)
    last = run_a / "last.ckpt"
    _save(last, 1, 1.0)
    resolved, listed = [], []
    write_atomically_ = cio.write_atomically

    def rank0_writes_meta(obj, path, *args, **kwargs):
        listed.append(sorted(os.listdir(run_a)))
        resolved.append(resolve_restore_point("runA/last", str(run_b), str(tmp_path)))
        return write_atomically_(obj, path, *args, **kwargs)

    monkeypatch.setattr(cio, "write_atomically", rank0_writes_meta)
    _save(last, 2, 2.0)
    assert resolved == [str(last)] and listed[0][0] == "last.ckpt" and STAGED in listed[0][1]
    assert _step_and_weight(last) == (2, 2.0) and sorted(os.listdir(last)) == [".metadata", "__0_0.distcp",
                                                                                "meta.pt"]
    assert sorted(os.listdir(run_a)) == ["last.ckpt"]


def test_resolving_another_runs_cut_swap_leaves_it_for_that_run_and_says_so(tmp_path):
    """A swap cut between its renames in run A's folder (no last.ckpt): job B neither finishes nor undoes it (only run
    A settles its folder); the error names what is beside it. Run A's own resolve settles it."""
    from pipeline.config import ConfigError
    from pipeline.distributed.checkpoints.layout import resolve_restore_point

    last = _cut_between_the_renames(tmp_path, new_complete=True)  # tmp_path is run A's folder here
    before = sorted(os.listdir(tmp_path))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-runB"
    with pytest.raises(ConfigError, match=rf"{last} does not exist; beside it: last\.ckpt{ASIDE}1a2b3c4d, "
                                          rf"last\.ckpt{STAGED}10-5e6f7a8b"):
        resolve_restore_point(str(last), str(elsewhere))
    assert resolve_restore_point(str(last), str(elsewhere), required=False) == str(last)
    assert sorted(os.listdir(tmp_path)) == before
    assert resolve_restore_point("last", str(tmp_path)) == str(last) and _step_and_weight(last) == (10, 2.0)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def _remove_staged(folder):
    def remove():
        staged, _ = leftovers(folder / "last.ckpt")
        assert len(staged) == 1
        import shutil
        shutil.rmtree(staged[0])
    return remove


@pytest.mark.parametrize("moment", ["lakehouse-checkpoint-staged", "meta", "lakehouse-checkpoint-written"])
def test_a_save_whose_staged_folder_was_removed_fails_naming_it_and_leaves_the_previous_one(tmp_path, monkeypatch,
                                                                                              moment):
    """The staged folder removed under the writers (before the shards, before meta.pt, before the swap): the save
    fails naming it, never makes it again (empty, or with meta.pt alone) and never swaps it in."""
    from pipeline.distributed.checkpoints import io as cio

    last = tmp_path / "last.ckpt"
    _save(last, 1, 1.0)
    remove = _remove_staged(tmp_path)
    if moment == "meta":
        write_atomically_ = cio.write_atomically

        def removed_first(obj, path, *args, **kwargs):
            remove()
            return write_atomically_(obj, path, *args, **kwargs)

        monkeypatch.setattr(cio, "write_atomically", removed_first)
        strategy = OneRank()
    else:
        strategy = Hooked({moment: remove})
    checkpoint = {"global_step": 2, "epoch": 2, "state_dict": {"w": torch.full((4, 3), 2.0)},
                  "optimizer_states": []}
    with pytest.raises(FileNotFoundError, match=rf"save of checkpoint {last} failed: its staged folder was removed"
                                                rf".*last\.ckpt{STAGED}2-[0-9a-f]{{8}}'$"):
        write_sharded(strategy, checkpoint, last)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"] and _step_and_weight(last) == (1, 1.0)


# -------------------------------------------------------------------- a killed write's temporary file
_WRITER = """
import os, sys, time, torch
from pipeline.distributed.checkpoints.io import write_atomically
path = sys.argv[1]
write_atomically({"global_step": 1, "w": torch.ones(2)}, path)
def hang(p):
    print("written", flush=True)
    time.sleep(600)
write_atomically({"global_step": 2, "w": torch.zeros(2)}, path, part_written=hang)
"""


def _temporaries(folder):
    return sorted(p for p in os.listdir(folder) if p.startswith(".tmp-"))


def test_a_killed_writes_temporary_file_is_removed_by_its_run_and_a_live_ones_is_kept(tmp_path):
    """A writer killed between its bytes and its rename leaves `.tmp-<host>-<pid>-*.ckpt`: kept while that process
    lives (it may still be writing), removed once it is gone when the run resolves its restore point or settles its
    folder; another run resolving a checkpoint in that folder never removes it."""
    import subprocess
    import sys

    from pipeline.distributed.checkpoints.layout import resolve_restore_point

    run = tmp_path / "runA"
    run.mkdir()
    last = run / "last.ckpt"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(last)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        left = _temporaries(run)
        assert len(left) == 1 and f"-{proc.pid}-" in left[0]
        assert resolve_restore_point("last", str(run)) == str(last) and settle(last) == str(last)
        assert _temporaries(run) == left  # its writer is alive
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert resolve_restore_point("runA/last", str(tmp_path / "runB"), str(tmp_path)) == str(last)
    assert _temporaries(run) == left  # another run's folder: read as it stands
    assert resolve_restore_point(None, str(run)) is None  # the run starting again, from scratch or not
    assert sorted(os.listdir(run)) == ["last.ckpt"]
    assert torch.load(last, weights_only=True)["global_step"] == 1


def test_only_a_dead_or_stale_writers_temporary_file_is_removed(tmp_path):
    from pipeline.distributed.checkpoints.layout import STALE_TEMPORARY_S, remove_stale_temporaries, temporary_prefix

    ours = temporary_prefix()  # this process: alive
    host = ours.split("-")[1]
    names = {"live": f"{ours}abcd1234.ckpt", "other_host_fresh": ".tmp-0badc0de-1-abcd1234.ckpt",
             "other_host_stale": ".tmp-0badc0de-2-abcd1234.ckpt", "unnamed_fresh": ".tmp-k3j4h5g6.ckpt",
             "unnamed_stale": ".tmp-a1b2c3d4.ckpt", "users": ".tmp-notes.ckpt", "not_a_checkpoint": f"{ours}x.txt"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - STALE_TEMPORARY_S - 60
    for key in ("other_host_stale", "unnamed_stale", "users"):
        os.utime(tmp_path / names[key], (old, old))
    assert host != "0badc0de"
    removed = remove_stale_temporaries(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted([names["other_host_stale"], names["unnamed_stale"]])
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if not k.endswith("_stale"))
