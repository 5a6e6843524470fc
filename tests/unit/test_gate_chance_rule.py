"""Unit tests of the gate's chance floor: the chance level of held-out labels, the pure rule `decide` with the floor,
and promote() (a stand-in scorer, a real SQLite registry) leaving a version at chance registered but not crowned."""
import math

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus

from pipeline.config import Config, ConfigError, load_config
from pipeline.tracking.gate import clears_chance, decide, promote
from pipeline.tracking.heldout import HeldOutRows, chance_level, chance_what
from pipeline.tracking.registry import register_model


# --- the chance level ----------------------------------------------------------------------------------------------

def test_accuracy_chance_is_the_majority_share_of_all_rows():
    labels = ["a"] * 5 + ["b"] * 3 + ["c"] * 2
    assert chance_level("val_acc", "max", labels) == pytest.approx(0.5)
    assert chance_level("train_acc", "max", labels) == pytest.approx(0.5)
    assert chance_level("val_acc", "max", ["a", "b", "c", "d"]) == pytest.approx(0.25)  # balanced: 1 / classes
    # a row without a label is wrong for any guess (the scorer counts it wrong): it is in the denominator
    assert chance_level("val_acc", "max", ["a", "a", "b", None]) == pytest.approx(0.5)


def test_loss_chance_is_the_entropy_of_the_labels():
    assert chance_level("val_loss", "min", ["a", "b", "c", "d"]) == pytest.approx(math.log(4))
    labels = ["a"] * 3 + ["b"]
    assert chance_level("val_loss", "min", labels) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert chance_level("val_loss", "min", ["a", "a"]) == pytest.approx(0.0)  # one class: a prior guess is perfect


def test_no_chance_level_without_a_known_baseline_or_labels():
    assert chance_level("val_acc", "min", ["a", "b"]) is None  # accuracy in min mode: no constant guess to beat
    assert chance_level("val_loss", "max", ["a", "b"]) is None
    assert chance_what("val_f1", "max") is None and chance_level("val_f1", "max", ["a"]) is None
    assert chance_level("val_acc", "max", []) is None and chance_level("val_acc", "max", [None, None]) is None
    assert "majority" in chance_what("val_acc", "max") and "entropy" in chance_what("val_loss", "min")


def test_clears_chance_is_strict_and_directional():
    assert not clears_chance(0.30, 0.25, 0.05, "max")  # a lift equal to the margin is not enough
    assert clears_chance(0.3001, 0.25, 0.05, "max")
    assert clears_chance(1.0, 1.1, 0.05, "min") and not clears_chance(1.06, 1.1, 0.05, "min")
    assert clears_chance(0.1, None, 0.05, "max") and clears_chance(0.1, 0.25, None, "max")  # no floor
    assert not clears_chance(math.nan, None, None, "max") and not clears_chance(None, 0.25, 0.05, "max")


# --- the rule ------------------------------------------------------------------------------------------------------

def test_first_model_at_chance_is_not_crowned_and_the_reason_names_the_numbers():
    """Issue 25 item 13: stopped early at 0.35 with 4 balanced classes (chance 0.25), no champion yet."""
    d = decide("1", 0.35, None, None, chance=0.25, min_lift=0.05)
    assert d.promoted  # 0.35 beats 0.25 by 0.10 > 0.05
    assert "beats chance 0.25" in d.reason and "min lift 0.05" in d.reason
    d = decide("1", 0.28, None, None, chance=0.25, min_lift=0.05)
    assert not d.promoted and (d.chance, d.min_lift) == (0.25, 0.05)
    for needle in ("val_acc=0.28", "chance val_acc=0.25", "majority class", "mlflow.gate_min_lift 0.05",
                   "registered, not promoted", "no champion yet"):
        assert needle in d.reason, (needle, d.reason)
    assert not decide("1", 0.30, None, None, chance=0.25, min_lift=0.05).promoted  # exactly chance + lift


def test_the_floor_holds_with_a_champion_too():
    # beats a weak champion by the margin, but not chance by the lift: the champion is kept
    d = decide("3", 0.27, "2", 0.20, chance=0.25, min_lift=0.05)
    assert not d.promoted and "champion version 2 kept" in d.reason and d.champion_version == "2"
    d = decide("3", 0.9, "2", 0.8, chance=0.25, min_lift=0.05)
    assert d.promoted and "beats champion version 2" in d.reason and "beats chance 0.25" in d.reason
    # above chance but not above the champion: the champion comparison decides
    d = decide("3", 0.7, "2", 0.8, chance=0.25, min_lift=0.05)
    assert not d.promoted and "does not beat champion version 2" in d.reason


def test_loss_floor_in_min_mode():
    h = math.log(4)
    assert not decide("1", h - 0.01, None, None, metric="val_loss", mode="min", chance=h, min_lift=0.05).promoted
    d = decide("1", 0.4, None, None, metric="val_loss", mode="min", chance=h, min_lift=0.05)
    assert d.promoted and "entropy" in d.reason
    d = decide("1", 2.0, None, None, metric="val_loss", mode="min", chance=h, min_lift=0.05)
    assert not d.promoted and "lower is better" in d.reason and "entropy" in d.reason


def test_no_floor_is_said_in_the_reason():
    d = decide("1", 0.1, None, None, metric="val_acc", mode="min", chance=None, min_lift=0.05)
    assert d.promoted and "no chance floor: no known chance level for val_acc in min mode" in d.reason
    d = decide("1", 0.1, None, None, chance=0.25, min_lift=None)
    assert d.promoted and "no chance floor (mlflow.gate_min_lift is null)" in d.reason
    d = decide("1", 0.1, None, None, chance=None, min_lift=0.05)
    assert d.promoted and "no labelled rows" in d.reason


def test_already_champion_and_bad_inputs():
    assert decide("2", 0.2, "2", 0.2, chance=0.25, min_lift=0.05).promoted  # the gate never takes an alias away
    assert not decide("1", math.nan, None, None, chance=0.25, min_lift=0.05).promoted
    with pytest.raises(ValueError, match="mlflow.gate_min_lift"):
        decide("1", 0.9, None, None, chance=0.25, min_lift=-0.1)


def test_config_key_default_and_validation():
    assert Config().mlflow.gate_min_lift == 0.05
    assert load_config(None, ["mlflow.gate_min_lift=null"]).mlflow.gate_min_lift is None
    assert load_config(None, ["mlflow.gate_min_lift=0.1"]).mlflow.gate_min_lift == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="mlflow.gate_min_lift"):
        load_config(None, ["mlflow.gate_min_lift=-0.5"])


# --- promote() with a stand-in scorer and a real SQLite registry ----------------------------------------------------

# 4 balanced classes: chance 0.25 (accuracy), log 4 (loss)
ROWS = HeldOutRows("t", 3, "val", [b"a", b"b", b"c", b"d"] * 2, ["w", "x", "y", "z"] * 2)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry_chance")
    uri = f"sqlite:///{root}/mlflow.db"
    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("gate_chance", artifact_location=(root / "artifacts").as_uri())
    try:
        yield client, exp_id
    finally:
        mlflow.set_tracking_uri(old)


def _version(client, exp_id, name):
    run_id = client.create_run(exp_id).info.run_id
    client.set_terminated(run_id)
    model = mlflow.initialize_logged_model(name="model", source_run_id=run_id, experiment_id=exp_id)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)  # as if uploaded: PENDING is refused
    return register_model(client, f"models:/{model.model_id}", name, run_id, {})


def _scorer(by_version, calls):
    def score(uri, rows, metric):
        calls.append(uri.rsplit("/", 1)[1])
        return by_version[uri.rsplit("/", 1)[1]]
    return score


def _alias(client, name):
    try:
        return str(client.get_model_version_by_alias(name, "champion").version)
    except mlflow.exceptions.MlflowException:
        return None


@pytest.mark.timeout(120)
def test_promote_keeps_a_chance_level_version_registered_unpromoted_and_tagged(registry):
    client, exp_id = registry
    name = "gate_chance"
    v1, v2, v3 = (_version(client, exp_id, name) for _ in range(3))
    calls = []
    scores = _scorer({v1: 0.25, v2: 0.875, v3: 0.28}, calls)

    d1 = promote(client, name, v1, held_out=ROWS, scorer=scores, min_lift=0.05)
    assert not d1.promoted and d1.chance == pytest.approx(0.25) and _alias(client, name) is None
    tags = client.get_model_version(name, v1).tags
    assert tags["gate_chance_val_acc"] == "0.25" and tags["gate_min_lift"] == "0.05" and tags["gate_val_acc"] == "0.25"
    assert tags["gate_decision"] == d1.reason and "does not beat chance val_acc=0.25" in d1.reason

    d2 = promote(client, name, v2, held_out=ROWS, scorer=scores, min_lift=0.05)
    assert d2.promoted and _alias(client, name) == v2 and "beats chance 0.25" in d2.reason

    calls.clear()
    d3 = promote(client, name, v3, held_out=ROWS, scorer=scores, min_lift=0.05)  # under the floor, champion exists
    assert not d3.promoted and d3.champion_version == v2 and _alias(client, name) == v2
    assert calls == [v3]  # the champion is not scored: nothing it scores could crown a version under chance
    tags = client.get_model_version(name, v3).tags
    assert tags["gate_champion_version"] == v2 and "gate_champion_val_acc" not in tags
    assert f"champion version {v2} kept" in tags["gate_decision"]


@pytest.mark.timeout(120)
def test_promote_floor_defaults_on_and_null_turns_it_off(registry):
    client, exp_id = registry
    name = "gate_chance_default"
    v1 = _version(client, exp_id, name)
    scores = _scorer({v1: 0.27}, [])
    d = promote(client, name, v1, held_out=ROWS, scorer=scores)  # the config's default lift, 0.05
    assert not d.promoted and d.min_lift == Config().mlflow.gate_min_lift and _alias(client, name) is None
    d = promote(client, name, v1, held_out=ROWS, scorer=scores, min_lift=None)
    assert d.promoted and "no chance floor" in d.reason and _alias(client, name) == v1
    with pytest.raises(ValueError, match="gate_min_lift"):
        promote(client, name, v1, held_out=ROWS, scorer=scores, min_lift=-1)


@pytest.mark.timeout(120)
def test_promote_loss_floor(registry):
    client, exp_id = registry
    name = "gate_chance_loss"
    v1, v2 = _version(client, exp_id, name), _version(client, exp_id, name)
    scores = _scorer({v1: math.log(4) + 0.3, v2: 0.5}, [])
    d1 = promote(client, name, v1, metric="val_loss", mode="min", held_out=ROWS, scorer=scores, min_lift=0.05)
    assert not d1.promoted and d1.chance == pytest.approx(math.log(4))
    assert client.get_model_version(name, v1).tags["gate_chance_val_loss"] == f"{math.log(4):.6g}"
    assert promote(client, name, v2, metric="val_loss", mode="min", held_out=ROWS, scorer=scores,
                   min_lift=0.05).promoted
    assert _alias(client, name) == v2
