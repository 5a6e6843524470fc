"""The search space file: parsing to Optuna distributions, and errors that name the file and the key (no Spark)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, apply_overrides, load_config
from pipeline.tune.space import conversion_settings, is_conversion_key, load_space, space_from_text

ROOT = Path(__file__).resolve().parents[2]


def _space(text: str):
    return space_from_text(text, Config(), "s.yaml")


def test_shipped_demo_space_parses_and_suggests():
    import optuna

    cfg = load_config(str(ROOT / "conf/local.yaml"))
    space = load_space(str(ROOT / "conf/search/demo.yaml"), cfg)
    assert {"model.lr", "data.batch_size", "model.arch", "model.optimizer"} <= set(space.params)
    lr = space.params["model.lr"].distribution()
    assert isinstance(lr, optuna.distributions.FloatDistribution) and lr.log
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for params in space.enqueue:
        study.enqueue_trial(params)
    first = space.suggest(study.ask())
    assert first["model.lr"] == 0.01 and first["train.max_epochs"] == 4  # the enqueued baseline, fixed values
    for _ in range(5):
        values = space.suggest(study.ask())
        assert 1e-3 <= values["model.lr"] <= 0.2 and values["data.batch_size"] in (16, 32, 64)
        assert values["model.arch"] in ("cnn", "resnet")


def test_int_float_categorical_distributions():
    import optuna

    space = _space("""
params:
  train.warmup_epochs: {type: int, low: 0, high: 4, step: 2}
  model.momentum: {type: float, low: 0.5, high: 0.99}
  debug.nan_at_step: {type: categorical, choices: [null, 3]}
""")
    warm = space.params["train.warmup_epochs"].distribution()
    assert isinstance(warm, optuna.distributions.IntDistribution) and warm.step == 2 and warm.high == 4
    assert space.params["debug.nan_at_step"].distribution().choices == (None, 3)
    assert not space.params["model.momentum"].log


@pytest.mark.parametrize("text, match", [
    ("params:\n  model.lrr: {type: float, low: 0.1, high: 1}\n", r"s\.yaml: params\.model\.lrr: unknown config key"),
    ("params:\n  model.lr: {type: float, low: 0, high: 1, log: true}\n", r"params\.model\.lr: 'low' \(0\) must be > 0"),
    ("params:\n  model.lr: {type: float, low: 1, high: 0.1}\n", r"params\.model\.lr: 'low' \(1\) must be below"),
    ("params:\n  model.lr: {type: uniform, low: 0.1, high: 1}\n", r"params\.model\.lr: 'type' must be one of"),
    ("params:\n  model.lr: {type: float, low: 0.1, hi: 1}\n", r"params\.model\.lr: unknown field\(s\) hi"),
    ("params:\n  model.lr: {type: float, low: 0.1, high: 1, log: true, step: 0.1}\n", "cannot be combined"),
    ("params:\n  data.batch_size: {type: float, low: 8, high: 64}\n", r"params\.data\.batch_size: .*must be an int"),
    ("params:\n  data.batch_size: {type: int, low: 8.5, high: 64}\n", r"'low' must be an int"),
    ("params:\n  model.arch: {type: categorical, choices: [cnn, vgg]}\n",
     r"params\.model\.arch: config key 'model\.arch': value 'vgg' is not one of"),
    ("params:\n  model.arch: {type: categorical, choices: []}\n", r"'choices' must be a non-empty list"),
    ("params:\n  model.arch: {type: categorical, choices: [cnn, cnn]}\n", "duplicates"),
    ("params:\n  data.batch_size: {type: int, low: 0, high: 8}\n", r"data\.batch_size.*must be an int >= 1"),
    ("params:\n  train.np: {type: categorical, choices: [-1, -2]}\n", r"'train\.np' cannot be set per trial: the world"),
    ("params:\n  mlflow.experiment: {type: categorical, choices: [a, b]}\n", "cannot be set per trial"),
    ("params:\n  data.cache_dir: {type: categorical, choices: [a, b]}\n", "cannot be set per trial"),
    ("params:\n  lr: {type: float, low: 0.1, high: 1}\n", "not a dotted config key"),
    ("params: {}\n", "'params' must be a non-empty mapping"),
    ("parms:\n  model.lr: {type: float, low: 0.1, high: 1}\n", "unknown top-level key"),
    ("params:\n  model.lr: {type: float, low: 0.1, high: 1}\nfixed:\n  model.lr: 0.5\n", "also searched"),
    ("params:\n  model.lr: {type: float, low: 0.1, high: 1}\nfixed:\n  train.max_epochs: 0\n",
     r"fixed: config key 'train\.max_epochs'"),
    ("params:\n  model.lr: {type: float, low: 0.1, high: 1}\nenqueue:\n  - {model.lr: 5}\n",
     r"enqueue\[0\]: model\.lr=5 is outside"),
    ("params:\n  model.lr: {type: float, low: 0.1, high: 1}\nenqueue:\n  - {model.arch: cnn}\n",
     r"enqueue\[0\]: key 'model\.arch' is not searched"),
    ("params: [1, 2\n", "is not valid YAML"),
])
def test_bad_space_names_file_and_key(text, match):
    with pytest.raises(ConfigError, match=match):
        _space(text)


@pytest.mark.parametrize("text, match", [
    # PyYAML reads a number in exponent form without a dot (or without the exponent's sign) as a string
    ("params:\n  model.lr: {type: float, low: 1e-5, high: 0.1, log: true}\n",
     r"s\.yaml: params\.model\.lr: 'low' must be a number, got '1e-5' \(PyYAML reads 1e-5 as text: write 1\.0e-5"),
    ("params:\n  model.lr: {type: float, low: 1.0e-5, high: 1.0e5}\n", r"'high' must be a number, .*write 1\.0e\+5"),
    # a high off the step grid: Optuna lowers it silently
    ("params:\n  model.lr: {type: float, low: 0.1, high: 1.0, step: 0.4}\n",
     r"params\.model\.lr: 'high' \(1\.0\) is not 'low' \(0\.1\) plus a whole number of 'step' \(0\.4\): Optuna "
     r"would lower it to 0\.9; set 'high' to 0\.9 or 1\.3"),
    ("params:\n  train.max_epochs: {type: int, low: 1, high: 8, step: 2}\n",
     r"params\.train\.max_epochs: 'high' \(8\) .* Optuna would lower it to 7"),
    # a step wider than the range: every trial the same value
    ("params:\n  train.max_epochs: {type: int, low: 1, high: 2, step: 5}\n",
     r"params\.train\.max_epochs: 'step' \(5\) is wider than the range .* every trial would draw 1"),
    # an enqueued value off the step grid
    ("params:\n  train.max_epochs: {type: int, low: 2, high: 8, step: 2}\nenqueue:\n  - {train.max_epochs: 3}\n",
     r"enqueue\[0\]: train\.max_epochs=3 is outside its distribution int \[2, 8\] step 2 \(a stepped range"),
    ("params:\n  model.lr: {type: float, low: 0.1, high: 0.9, step: 0.2}\nenqueue:\n  - {model.lr: 0.4}\n",
     r"enqueue\[0\]: model\.lr=0\.4 is outside"),
    ("params:\n  model.lr: {type: float, low: 1.0e-3, high: 0.1}\nenqueue:\n  - {model.lr: 1e-2}\n",
     r"enqueue\[0\]: model\.lr='1e-2' is outside .*write 1\.0e-2"),
])
def test_a_space_optuna_would_change_silently_is_refused(text, match):
    with pytest.raises(ConfigError, match=match):
        _space(text)


def test_a_stepped_range_on_its_grid_is_taken_as_written():
    import optuna

    space = _space("params:\n  model.lr: {type: float, low: 0.1, high: 0.9, step: 0.2}\n"
                   "  train.max_epochs: {type: int, low: 2, high: 8, step: 2}\n"
                   "enqueue:\n  - {model.lr: 0.5, train.max_epochs: 6}\n")
    lr = space.params["model.lr"].distribution()
    assert (lr.low, lr.high, lr.step) == (0.1, 0.9, 0.2)  # not lowered: 0.9 is 0.1 + 4 steps (in decimal)
    assert space.params["train.max_epochs"].distribution().high == 8
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial(space.enqueue[0])
    assert space.suggest(study.ask()) == {"model.lr": 0.5, "train.max_epochs": 6}


def test_missing_space_file(tmp_path):
    with pytest.raises(ConfigError, match="search space .*nope.yaml does not exist"):
        load_space(str(tmp_path / "nope.yaml"), Config())


def test_conversion_keys_reconvert_read_time_keys_share():
    assert not is_conversion_key("data.batch_size") and not is_conversion_key("model.lr")
    assert is_conversion_key("data.image_size") and is_conversion_key("data.val_fraction")
    assert not is_conversion_key("data.cache_dir")  # refused, not converted
    base = Config()
    other_batch = apply_overrides(Config(), {"data.batch_size": 7})
    other_size = apply_overrides(Config(), {"data.image_size": 16})
    assert conversion_settings(base) == conversion_settings(other_batch)
    assert conversion_settings(base) != conversion_settings(other_size)
    space = _space("params:\n  data.image_size: {type: categorical, choices: [16, 32]}\n")
    assert space.needs_conversion() == ["data.image_size"]


def test_a_trials_plan_keeps_row_groups_changes_steps():
    """A trial re-plans the shared conversion with the job's own derivation (pipeline.data.plan.derive_plan)."""
    from pipeline.data.plan import derive_plan
    from pipeline.lakehouse.partition import ShardPlan, plan_split

    plan = ShardPlan(train=plan_split("train", [100, 90, 80, 70], 2, 16), val=plan_split("val", [20, 25], 2, 16))
    again = derive_plan(apply_overrides(Config(), {"data.batch_size": 32, "data.min_steps_per_epoch": 0}), plan,
                        plan.train.world_size).shards
    assert again.train.row_group_rows == plan.train.row_group_rows and again.train.rows_per_rank == [180, 160]
    assert (plan.train.steps_per_epoch, again.train.steps_per_epoch) == (10, 5)
    assert again.val.batch_size == 32 and again.val.steps_per_epoch == 1


def test_trial_data_plans_auto_batch_at_its_start_size():
    from dataclasses import dataclass
    from types import SimpleNamespace

    from pipeline.config import apply_overrides
    from pipeline.lakehouse.partition import ShardPlan, plan_split
    from pipeline.tune.trial import SharedData

    plan = ShardPlan(train=plan_split("train", [400, 400], 2, 64), val=plan_split("val", [100, 100], 2, 64))
    @dataclass
    class Data:  # what the trial's re-plan touches of a ConvertedData
        plan: ShardPlan

    data = Data(plan)
    shared = SharedData(lambda cfg, version: (data, SimpleNamespace(table="t", version=0)))
    cfg = apply_overrides(Config(), {"data.batch_size": "auto", "data.auto_batch_start": 100,
                                     "data.min_steps_per_epoch": 0})
    got, _ = shared.for_config(cfg)
    assert got.plan.train.batch_size == 100 and got.plan.train.steps_per_epoch == 4
    # at the default data.min_steps_per_epoch (16) the trial's plan is lowered as a job's is: 400 // 16 per rank
    got, _ = shared.for_config(apply_overrides(cfg, {"data.min_steps_per_epoch": 16}))
    assert got.plan.train.batch_size == 25 and got.plan.train.steps_per_epoch == 16


def _wait_for(path, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.01)
    return path.read_text()


def test_pruning_gate_reports_each_epoch_and_answers_rank_zero(tmp_path):
    """The driver side of pruning with a real in-memory Optuna study: epoch files in, verdict files out."""
    import json

    import optuna

    from pipeline.tune.trial import PruningGate

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1))
    first = study.ask()
    for epoch, value in enumerate([2.0, 1.0, 0.5]):
        first.report(value, epoch)
    study.tell(first, 0.5)

    def epoch_file(folder, epoch, value):  # written as rank 0 writes it (DriverVerdict): whole, then renamed
        tmp = folder / f".epoch-{epoch}.json.tmp"
        tmp.write_text(json.dumps({"epoch": epoch, "metrics": {"val_loss": value}}))
        os.replace(tmp, folder / f"epoch-{epoch}.json")

    trial = study.ask()
    folder = tmp_path / "gate"
    with PruningGate(trial, str(folder), "val_loss", "median") as gate:
        epoch_file(folder, 0, 9.0)  # worse, but epoch 0 is warmup
        assert _wait_for(folder / "verdict-0") == "continue"
        epoch_file(folder, 1, float("nan"))  # not reported (a non-finite loss stops the ranks by itself)
        assert _wait_for(folder / "verdict-1") == "continue"
        epoch_file(folder, 2, 3.0)  # worse than the median at epoch 2 (0.5): pruned
        verdict = _wait_for(folder / "verdict-2")
    assert verdict.startswith("stop: pruned by the median pruner after epoch 2 (val_loss 3)")
    assert gate.pruned_epoch == 2 and study.trials[1].intermediate_values == {0: 9.0, 2: 3.0}

    good = study.ask()
    with PruningGate(good, str(tmp_path / "gate2"), "val_loss", "median") as gate:
        for epoch, value in enumerate([1.5, 0.8, 0.4]):
            epoch_file(tmp_path / "gate2", epoch, value)
            assert _wait_for(tmp_path / "gate2" / f"verdict-{epoch}") == "continue"
    assert gate.pruned_epoch is None


def test_shared_data_hands_the_pinned_version_to_prepare_and_leaves_the_config_as_given():
    from dataclasses import dataclass
    from types import SimpleNamespace

    from pipeline.config import Config, apply_overrides
    from pipeline.lakehouse.partition import ShardPlan, plan_split
    from pipeline.tune.trial import SharedData

    @dataclass
    class Data:
        plan: ShardPlan

    data = Data(ShardPlan(train=plan_split("train", [400, 400], 2, 64), val=plan_split("val", [100, 100], 2, 64)))
    seen = []

    def prepare(cfg, version):
        seen.append((cfg.delta.version, version))
        return data, SimpleNamespace(table="t", version=7 if version is None else version)

    cfg = apply_overrides(Config(), {"data.batch_size": 64, "data.min_steps_per_epoch": 0})
    fresh = SharedData(prepare)
    fresh.for_config(cfg)
    assert seen == [(None, None)] and fresh.delta_version == 7  # the version pinned, kept by the sweep's data
    resumed = SharedData(prepare, delta_version=3)  # a resumed sweep reads the version its study recorded
    resumed.for_config(cfg)
    assert seen[-1] == (None, 3)
