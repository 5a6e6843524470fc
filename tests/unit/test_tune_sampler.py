"""Each trial's random draws are its own (seeded by `tune.seed` and the trial's number): two resumes started together
on one study (a documented use) draw different values, a fresh sweep with the same seed draws again what it drew, and
a resumed sweep draws what one sweep that had not stopped would have (random sampler; TPE in its startup trials)."""
from __future__ import annotations

import pytest

from pipeline.config import Config, apply_overrides
from pipeline.tune.space import space_from_text
from pipeline.tune.study import StaleTrials, create_study, load_study, make_storage, quiet_optuna

SPACE = """
params:
  model.lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
  model.optimizer: {type: categorical, choices: [sgd, adam]}
  train.warmup_epochs: {type: int, low: 0, high: 5}
"""


def _sweep(tmp_path, sampler, name, resume=False):
    quiet_optuna()
    url = f"sqlite:///{tmp_path}/optuna.db"
    cfg = apply_overrides(Config(), {"tune.sampler": sampler, "tune.seed": 42, "tune.storage": url})
    storage = make_storage(url, StaleTrials(10))
    if resume:
        return load_study(cfg, name, storage, url)
    return create_study(cfg, name, storage, url, 8, SPACE, [])


def _run(study, n):
    space = space_from_text(SPACE, Config(), "s.yaml")
    drawn = []
    for _ in range(n):
        trial = study.ask()
        drawn.append(space.suggest(trial))
        study.tell(trial, 0.5)
    return drawn


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_two_resumes_started_together_draw_different_values(tmp_path, sampler):
    _run(_sweep(tmp_path, sampler, "s"), 2)  # the first sweep ran two trials
    a = _sweep(tmp_path, sampler, "s", resume=True)
    b = _sweep(tmp_path, sampler, "s", resume=True)
    space = space_from_text(SPACE, Config(), "s.yaml")
    ta, tb = a.ask(), b.ask()
    assert ta.number != tb.number
    assert space.suggest(ta) != space.suggest(tb)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_fixed_seed_draws_the_same_values_fresh_or_resumed(tmp_path, sampler):
    whole = _run(_sweep(tmp_path, sampler, "whole"), 4)
    assert _run(_sweep(tmp_path, sampler, "again"), 4) == whole  # a fresh sweep, same seed: the same draws
    _run(_sweep(tmp_path, sampler, "stopped"), 2)
    assert _run(_sweep(tmp_path, sampler, "stopped", resume=True), 2) == whole[2:]  # as if it had not stopped
    assert len({repr(d) for d in whole}) == 4  # and every trial's draws differ
