"""Unit tests of the promotion gate: the pure rule, and promote() against a real SQLite registry with a stand-in
scorer (the real one, a pyfunc on a Delta version's held-out rows, is tested in tests/integration/test_serving.py)."""
from __future__ import annotations

import math

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus

from pipeline.tracking.lease import LeaseTimes
from pipeline.tracking.gate import LEASE_TAG, MAX_GATE_ROUNDS, PromotionDecision, decide, promote
from pipeline.tracking.heldout import HeldOutRows, split_of
from pipeline.tracking.registry import RegistryError, register_model


# --- the pure rule ---------------------------------------------------------------------------

def test_no_champion_promotes():
    d = decide("1", 0.8, None, None)
    assert d == PromotionDecision(True, "1", "val_acc", 0.8, None, None, d.reason, 0.0)
    assert "no champion" in d.reason


def test_worse_is_refused_and_reason_names_both_values():
    d = decide("2", 0.7, "1", 0.8, metric="val_acc", mode="max")
    assert not d.promoted
    assert "0.7" in d.reason and "0.8" in d.reason and "version 1" in d.reason


def test_tie_does_not_promote():
    d = decide("2", 0.8, "1", 0.8)
    assert not d.promoted and "champion kept" in d.reason
    assert decide("2", 0.8000001, "1", 0.8).promoted


def test_margin_must_be_exceeded():
    assert not decide("2", 0.82, "1", 0.80, margin=0.02).promoted  # a gain equal to the margin is not enough
    assert decide("2", 0.83, "1", 0.80, margin=0.02).promoted
    assert not decide("2", 0.39, "1", 0.40, metric="val_loss", mode="min", margin=0.05).promoted
    d = decide("2", 0.30, "1", 0.40, metric="val_loss", mode="min", margin=0.05)
    assert d.promoted and "margin 0.05" in d.reason and d.margin == 0.05


def test_bad_margin_names_the_config_key():
    for bad in (-0.01, math.nan, None):
        with pytest.raises(ValueError, match="mlflow.gate_margin"):
            decide("2", 0.9, "1", 0.8, margin=bad)


def test_min_mode_lower_is_better():
    assert decide("2", 0.3, "1", 0.4, metric="val_loss", mode="min").promoted
    d = decide("2", 0.5, "1", 0.4, metric="val_loss", mode="min")
    assert not d.promoted and "lower is better" in d.reason


def test_nan_value_is_never_promoted():
    d = decide("2", math.nan, "1", 0.1)
    assert not d.promoted and "cannot be compared" in d.reason
    assert not decide("1", math.nan, None, None).promoted


def test_champion_that_cannot_be_scored_keeps_the_alias():
    d = decide("2", 0.9, "1", None, champion_error="model 'm' version 1 cannot be loaded or scored: OSError")
    assert not d.promoted and d.error and "champion version 1 could not be scored" in d.reason
    assert not decide("2", 0.9, "1", None).promoted
    assert not decide("2", 0.9, "1", math.nan).promoted


def test_same_version_is_already_champion():
    d = decide("3", 0.5, "3", None)
    assert d.promoted and "already" in d.reason


def test_bad_mode_names_the_config_key():
    with pytest.raises(ValueError, match="mlflow.gate_mode"):
        decide("1", 0.5, None, None, mode="best")


def test_train_metrics_are_scored_on_the_training_rows():
    assert (split_of("val_acc"), split_of("val_loss"), split_of("train_loss")) == ("val", "val", "train")


# --- promote() against a real SQLite registry -----------------------------------------------

@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root}/mlflow.db"
    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("gate", artifact_location=(root / "artifacts").as_uri())
    try:
        yield client, exp_id
    finally:
        mlflow.set_tracking_uri(old)


def _logged_model(client, run_id, exp_id, status=LoggedModelStatus.READY):
    """A logged model of run `run_id` in state `status` (READY: as if its artifacts were uploaded; none are here)."""
    model = mlflow.initialize_logged_model(name="model", source_run_id=run_id, experiment_id=exp_id)
    client.finalize_logged_model(model.model_id, status)
    return model


def _version(client, exp_id, name, tags=None):
    run_id = client.create_run(exp_id).info.run_id
    client.set_terminated(run_id)
    model = _logged_model(client, run_id, exp_id)
    return register_model(client, f"models:/{model.model_id}", name, run_id, tags or {})


ROWS = HeldOutRows("t", 3, "val", [b"a", b"b"], ["0", "1"])


class Scores:
    """A stand-in scorer: a fixed figure per version (a float, or an exception to raise), calls recorded."""

    def __init__(self, by_version):
        self.by_version, self.calls = by_version, []

    def __call__(self, uri, rows, metric):
        self.calls.append((uri, rows, metric))
        got = self.by_version[uri.rsplit("/", 1)[1]]
        if isinstance(got, Exception):
            raise got
        return got


@pytest.mark.timeout(120)
def test_promote_scores_both_on_the_same_rows_and_records_both(registry):
    client, exp_id = registry
    name = "gate_seq"
    # the logged val_acc tags say the opposite of the same-rows scores: the gate must not read them
    v1 = _version(client, exp_id, name, tags={"val_acc": "0.5"})
    v2 = _version(client, exp_id, name, tags={"val_acc": "0.99"})
    v3 = _version(client, exp_id, name, tags={"val_acc": "0.1"})
    v4 = _version(client, exp_id, name, tags={"val_acc": "1.0"})
    scores = Scores({v1: 0.8, v2: 0.7, v3: 0.9, v4: 0.9})
    d1 = promote(client, name, v1, held_out=ROWS, scorer=scores)
    assert d1.promoted and d1.champion_version is None and d1.rows == ROWS.describe()
    assert str(client.get_model_version_by_alias(name, "champion").version) == v1

    d2 = promote(client, name, v2, held_out=ROWS, scorer=scores)
    assert not d2.promoted
    assert {u for u, _, _ in scores.calls[-2:]} == {f"models:/{name}/{v2}", f"models:/{name}/{v1}"}
    assert all(r is ROWS for _, r, _ in scores.calls)  # the same rows for challenger and champion
    assert (d2.champion_version, d2.champion_value, d2.value) == (v1, pytest.approx(0.8), pytest.approx(0.7))
    tags = client.get_model_version(name, v2).tags
    assert (tags["gate_val_acc"], tags["gate_champion_val_acc"], tags["gate_champion_version"]) == ("0.7", "0.8", v1)
    assert tags["gate_decision"] == d2.reason and tags["gate_rows"] == ROWS.describe() and tags["gate_margin"] == "0"
    assert str(client.get_model_version_by_alias(name, "champion").version) == v1

    assert promote(client, name, v3, held_out=ROWS, scorer=scores).promoted
    assert str(client.get_model_version_by_alias(name, "champion").version) == v3
    d4 = promote(client, name, v4, held_out=ROWS, scorer=scores)  # a tie with the champion
    assert not d4.promoted and str(client.get_model_version_by_alias(name, "champion").version) == v3


@pytest.mark.timeout(120)
def test_champion_that_cannot_be_scored_is_kept_with_an_error_naming_it(registry):
    client, exp_id = registry
    name = "gate_broken"
    v1 = _version(client, exp_id, name)
    v2 = _version(client, exp_id, name)
    client.set_registered_model_alias(name, "champion", v1)
    scores = Scores({v1: OSError("no such artifact"), v2: 0.9})
    d = promote(client, name, v2, held_out=ROWS, scorer=scores)
    assert not d.promoted and f"version {v1}" in d.error and "no such artifact" in d.error
    assert str(client.get_model_version_by_alias(name, "champion").version) == v1
    tags = client.get_model_version(name, v2).tags
    assert tags["gate_champion_val_acc"] == "error" and f"champion version {v1}" in tags["gate_decision"]


@pytest.mark.timeout(120)
def test_a_scoring_error_quoting_a_url_with_its_password_is_recorded_without_it(registry):
    """MLflow's errors quote the URL they failed on, credentials and all (`API request to http://user:pw@host/...
    failed`): the gate's reason, its error and the challenger's tags keep the host and lose the password."""
    from mlflow.exceptions import MlflowException

    client, exp_id = registry
    name = "gate_secret"
    v1 = _version(client, exp_id, name)
    v2 = _version(client, exp_id, name)
    client.set_registered_model_alias(name, "champion", v1)
    url = "http://alice:s3cretPW@127.0.0.1:9/api/2.0/mlflow/registered-models/get"
    d = promote(client, name, v2, held_out=ROWS,
                scorer=Scores({v1: MlflowException(f"API request to {url} failed with exception boom"), v2: 0.9}))
    tags = client.get_model_version(name, v2).tags
    assert not d.promoted and "http://alice:***@127.0.0.1:9" in d.error
    assert all("s3cretPW" not in str(x) for x in (d.reason, d.error, *tags.values())), tags


@pytest.mark.timeout(120)
def test_challenger_without_data_or_score_is_refused_with_clear_error(registry):
    client, exp_id = registry
    name = "gate_missing"
    v1 = _version(client, exp_id, name, tags={"delta_version": "0"})
    with pytest.raises(RegistryError, match=rf"version {v1} has no tag\(s\) delta_table"):
        promote(client, name, v1)
    with pytest.raises(RegistryError, match=rf"version {v1} could not be scored.*boom"):
        promote(client, name, v1, held_out=ROWS, scorer=Scores({v1: RuntimeError("boom")}))
    assert "not promoted" in client.get_model_version(name, v1).tags["gate_decision"]
    with pytest.raises(ValueError, match="gate_mode"):
        promote(client, name, v1, mode="up")
    with pytest.raises(ValueError, match="gate_margin"):
        promote(client, name, v1, margin=-1)


@pytest.mark.timeout(120)
def test_custom_alias_and_min_mode(registry):
    client, exp_id = registry
    name = "gate_min"
    v1 = _version(client, exp_id, name)
    v2 = _version(client, exp_id, name)
    scores = Scores({v1: 0.4, v2: 0.5})
    assert promote(client, name, v1, metric="val_loss", mode="min", alias="prod", held_out=ROWS,
                   scorer=scores).promoted
    d = promote(client, name, v2, metric="val_loss", mode="min", alias="prod", held_out=ROWS, scorer=scores)
    assert not d.promoted and scores.calls[-1][2] == "val_loss"
    assert str(client.get_model_version_by_alias(name, "prod").version) == v1


FAST_LEASE = LeaseTimes(settle_s=0.5, ttl_s=10.0, wait_s=10.0)  # SQLite writes take ~0.06 s here


@pytest.mark.timeout(120)
def test_alias_moving_under_the_gate_is_rescored_and_bounded(registry):
    """Each time the gate scores the alias holder, the alias moves to another version (other gates): after
    MAX_GATE_ROUNDS rounds the gate gives up naming every holder it saw, moves nothing, and releases its lease."""
    client, exp_id = registry
    name = "gate_moving"
    others = [_version(client, exp_id, name) for _ in range(MAX_GATE_ROUNDS + 1)]
    challenger = _version(client, exp_id, name)
    client.set_registered_model_alias(name, "champion", others[0])
    moves = iter(others[1:])

    class Moving(Scores):
        def __call__(self, uri, rows, metric):
            got = super().__call__(uri, rows, metric)
            following = next(moves, None) if uri.rsplit("/", 1)[1] != challenger else None
            if following is not None:
                client.set_registered_model_alias(name, "champion", following)
            return got

    scores = Moving({**{v: 0.1 for v in others}, challenger: 0.9})
    with pytest.raises(RegistryError, match=rf"no decision in {MAX_GATE_ROUNDS} rounds .*version {others[0]} -> "
                                            rf"version {others[1]} -> .*alias not moved"):
        promote(client, name, challenger, held_out=ROWS, scorer=scores, lease=FAST_LEASE)
    assert [u.rsplit("/", 1)[1] for u, _, _ in scores.calls] == [challenger] + others[:MAX_GATE_ROUNDS]
    assert str(client.get_model_version_by_alias(name, "champion").version) == others[MAX_GATE_ROUNDS]
    assert "not promoted" in client.get_model_version(name, challenger).tags["gate_decision"]
    assert f"{LEASE_TAG}.champion" not in client.get_registered_model(name).tags

    # one move only: re-scored once, then crowned over the holder it replaced, which the decision names
    client.set_registered_model_alias(name, "champion", others[0])
    moves = iter([others[1]])
    scores.calls.clear()
    d = promote(client, name, challenger, held_out=ROWS, scorer=Moving({**{v: 0.1 for v in others},
                                                                        challenger: 0.9}), lease=FAST_LEASE)
    assert d.promoted and d.champion_version == others[1] and d.moved_from == [others[0]]
    assert client.get_model_version(name, challenger).tags["gate_champion_moved_from"] == others[0]
    assert str(client.get_model_version_by_alias(name, "champion").version) == challenger
    # gated again with nothing moving: the earlier decision's moved-from tag is not left to mislead
    assert promote(client, name, challenger, held_out=ROWS, scorer=Scores({challenger: 0.9}), lease=FAST_LEASE).promoted
    assert "gate_champion_moved_from" not in client.get_model_version(name, challenger).tags


@pytest.mark.timeout(120)
def test_an_alias_write_that_lands_after_its_lease_was_taken_fails_the_gate_saying_so(registry):
    """A gate's alias write can outlast its lease (a 503 retried after a backoff): another gate takes the expired
    lease, judges against the old holder and moves the alias; the late write then lands over it. The late gate must
    fail saying so, not report a promotion that may have overwritten a better one (a review saw the worse model
    crowned in silence). A late write with nobody taking the lease meanwhile is fine."""
    import threading
    import time

    client, exp_id = registry
    name = "gate_late"
    v1, v2, v3 = (_version(client, exp_id, name) for _ in range(3))
    client.set_registered_model_alias(name, "champion", v1)
    scores = Scores({v1: 0.5, v2: 0.8, v3: 0.9})
    times = LeaseTimes(settle_s=0.05, ttl_s=1.0, wait_s=20.0)  # scaled down from settle 2 s, ttl 30 s
    lease_tag = f"{LEASE_TAG}.champion"
    b_done = threading.Event()

    class LateAlias(MlflowClient):  # A's alias write lands only once gate B has taken the expired lease and ended
        def set_registered_model_alias(self, *args):
            b_done.wait(30)
            super().set_registered_model_alias(*args)

    out = {}

    def gate(tag, gate_client, version):
        try:
            out[tag] = promote(gate_client, name, version, held_out=ROWS, scorer=scores, min_lift=None, lease=times)
        except RegistryError as exc:
            out[tag] = exc
        finally:
            if tag == "B":
                b_done.set()

    a = threading.Thread(target=gate, args=("A", LateAlias(tracking_uri=client._tracking_client.tracking_uri), v2))
    a.start()
    deadline = time.monotonic() + 30
    while lease_tag not in client.get_registered_model(name).tags and time.monotonic() < deadline:
        time.sleep(0.01)  # A holds the lease: B starts now and waits for it to expire
    b = threading.Thread(target=gate, args=("B", client, v3))
    b.start()
    b.join(60)
    a.join(60)
    assert out["B"].promoted and out["B"].champion_version == v1  # B judged against the holder A had not moved yet
    assert isinstance(out["A"], RegistryError), out["A"]
    assert f"alias 'champion' was set to it, but late" in str(out["A"]) and "taken meanwhile" in str(out["A"])
    assert "late" in client.get_model_version(name, v2).tags["gate_decision"]

    # late, but nobody wanted the lease meanwhile: the promotion stands
    client.set_registered_model_alias(name, "champion", v1)
    b_done.set()

    class SlowAlias(MlflowClient):
        def set_registered_model_alias(self, *args):
            time.sleep(1.5)
            super().set_registered_model_alias(*args)

    d = promote(SlowAlias(tracking_uri=client._tracking_client.tracking_uri), name, v2, held_out=ROWS,
                scorer=scores, min_lift=None, lease=times)
    assert d.promoted and str(client.get_model_version_by_alias(name, "champion").version) == v2


def test_the_version_description_lists_the_metrics_of_the_registered_weights(registry):
    """Issue 37, defect 11: with early stopping the run's last epoch is not the epoch whose weights are registered;
    the description lists the registered epoch's metrics, which register_model is given."""
    client, exp_id = registry
    run_id = client.create_run(exp_id).info.run_id
    for step, (loss, acc) in enumerate([(0.9, 0.50), (0.3, 0.91), (0.6, 0.80)]):  # best epoch 1, last epoch 2
        client.log_metric(run_id, "val_loss", loss, step=step)
        client.log_metric(run_id, "val_acc", acc, step=step)
    client.set_terminated(run_id)
    model = _logged_model(client, run_id, exp_id)
    version = register_model(client, f"models:/{model.model_id}", "described", run_id, {"val_acc": "0.91"},
                             metrics={"val_loss": 0.3, "val_acc": 0.91, "epoch_time_s": 1.0})
    description = client.get_model_version("described", version).description
    assert "val_acc=0.91" in description and "val_loss=0.3" in description
    assert "0.8" not in description.split("**Metrics**")[1].split("\n")[0]  # not the last epoch's


def test_a_version_registered_with_no_known_metrics_lists_none_rather_than_the_runs_last(registry):
    """Issue 37, defect 11: registered with metrics of no epoch (a trial or offline run that recorded none), the
    description lists no metrics; the run's latest values would be another epoch's than the registered weights'."""
    client, exp_id = registry
    run_id = client.create_run(exp_id).info.run_id
    for step, acc in enumerate([0.91, 0.80]):
        client.log_metric(run_id, "val_acc", acc, step=step)
    client.set_terminated(run_id)
    model = _logged_model(client, run_id, exp_id)
    version = register_model(client, f"models:/{model.model_id}", "undescribed", run_id, {}, metrics={})
    description = client.get_model_version("undescribed", version).description
    assert "models:/undescribed/" in description and "**Metrics**" not in description
    # a model logged outside a training run (metrics None) still lists its run's values
    version = register_model(client, f"models:/{model.model_id}", "undescribed", run_id, {})
    assert "val_acc=0.8" in client.get_model_version("undescribed", version).description


@pytest.mark.timeout(120)
def test_an_alias_write_the_registry_refuses_leaves_the_version_registered_and_names_it(registry):
    """The alias write is bounded to the lease's time left, so a slow registry can fail it: the gate then says the
    write failed and where the alias is (a RegistryError, which the job logs, its version registered), instead of
    an MlflowException out of the job after training."""
    from mlflow.exceptions import MlflowException

    client, exp_id = registry
    name = "gate_refused"
    v1, v2 = _version(client, exp_id, name), _version(client, exp_id, name)
    client.set_registered_model_alias(name, "champion", v1)

    class Refusing(MlflowClient):
        def set_registered_model_alias(self, *args):
            raise MlflowException("API request to http://u:pw@h/api/2.0/mlflow/registered-models/alias failed: timeout")

    with pytest.raises(RegistryError, match=rf"moving alias 'champion' to it failed .*not known: the alias is on "
                                            rf"version {v1}; run `lakehouse promote` again") as err:
        promote(Refusing(tracking_uri=client._tracking_client.tracking_uri), name, v2, held_out=ROWS,
                scorer=Scores({v1: 0.5, v2: 0.9}), lease=FAST_LEASE)
    assert "pw" not in str(err.value) and "failed" in client.get_model_version(name, v2).tags["gate_decision"]
    assert f"{LEASE_TAG}.champion" not in client.get_registered_model(name).tags  # the lease released


@pytest.mark.parametrize("status", [LoggedModelStatus.FAILED, LoggedModelStatus.PENDING])
def test_a_logged_model_whose_upload_failed_or_never_ended_is_refused_naming_it(registry, status):
    """MLflow links a logged model to its run before it uploads the artifacts: a `models:/m-<id>` whose upload failed
    (FAILED) or never ended (PENDING) cannot be loaded, so it is never registered (nor then promoted by the gate);
    the error names the model, its state and its run. A READY one of the same run registers."""
    client, exp_id = registry
    name = f"not_ready_{status}".lower()
    run_id = client.create_run(exp_id).info.run_id
    client.set_terminated(run_id)
    broken = _logged_model(client, run_id, exp_id, status)
    with pytest.raises(RegistryError, match=rf"{broken.model_id} of run {run_id} is {status}, not READY") as err:
        register_model(client, f"models:/{broken.model_id}", name, run_id, {"val_acc": "0.9"})
    assert f"{name!r}" in str(err.value)
    assert not client.search_model_versions(f"name = '{name}'")  # no version of it, so none for the gate
    ready = _logged_model(client, run_id, exp_id)
    version = register_model(client, f"models:/{ready.model_id}", name, run_id, {"val_acc": "0.9"})
    mv = client.get_model_version(name, version)
    assert mv.status == "READY" and mv.source == f"models:/{ready.model_id}" and mv.run_id == run_id
