"""A resume with data.reader=petastorm warns that the epoch it resumes reads a new shuffle only where an epoch was
part-read: a checkpoint of an epoch's end (step 184 = 8 epochs of 23 steps, `train.ckpt_restore=<run>/last` after 8
epochs) resumes at the next epoch's start, where nothing is replayed, and both ranks warned there all the same."""
import logging
from types import SimpleNamespace

import pytest

import pipeline.data.loader as loader_mod
from pipeline.data.loader import ShardLoader

STEPS = 23  # steps per epoch
BATCH = 32


@pytest.fixture()
def petastorm_loader(monkeypatch):
    """A train loader of the petastorm reader on rank 1 (whether or not Petastorm is installed: nothing is read)."""
    monkeypatch.setattr(loader_mod, "require_reader", lambda _name: None)
    plan = SimpleNamespace(steps_per_epoch=STEPS, batch_size=BATCH, rows_per_rank=[STEPS * BATCH] * 2, eval_steps=0,
                           name="train")
    return ShardLoader(SimpleNamespace(name="train"), plan, rank=1, world_size=2, channels=1, image_size=8,
                       endless=True, workers=1, shuffle_buffer=0, seed=0, reader="petastorm")


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "cannot replay its row order" in r.getMessage()]


def test_a_resume_at_an_epochs_start_does_not_warn(petastorm_loader, caplog):
    caplog.set_level(logging.WARNING)
    petastorm_loader.resume_at(8 * STEPS)
    assert _warnings(caplog) == []
    assert petastorm_loader.batches_taken == 8 * STEPS  # resumed there all the same


def test_a_resume_mid_epoch_warns_naming_the_rank_and_step(petastorm_loader, caplog):
    caplog.set_level(logging.WARNING)
    petastorm_loader.resume_at(8 * STEPS + 5)
    assert _warnings(caplog) == [f"rank 1: data.reader=petastorm cannot replay its row order; the epoch resumed at "
                                 f"step {8 * STEPS + 5} reads a new shuffle of the shard (data.reader=arrow resumes "
                                 f"exactly)"]
