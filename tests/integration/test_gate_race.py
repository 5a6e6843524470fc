"""Two promotion gates at once on a real MLflow registry (SQLite store and `mlflow server`), real networks of known
accuracy registered as versions and scored by their pyfunc on the val rows of a real Delta table: the better
challenger ends champion in every finishing order, the loser says it lost to whom, and a champion that moves under
a gate after it scored is scored before the alias moves."""
from __future__ import annotations

import threading
import time

import mlflow
import pytest
from mlflow import MlflowClient

from pipeline.tracking.gate import LEASE_TAG
from pipeline.tracking.gate import promote as _promote
from pipeline.tracking.heldout import score_on_rows
from pipeline.tracking.lease import Holder, LeaseTimes, parse_holder
from pipeline.tracking.pyfunc import log_model
from pipeline.tracking.registry import RegistryError, register_model
from pipeline.tracking.runs import configure, tracked_run
from test_tracking import CLASS_NAMES, META, _always, _cfg, _png, _val_share, gate_table, sqlite_store  # noqa: F401

pytestmark = pytest.mark.integration

LEASE_KEY = f"{LEASE_TAG}.champion"


def promote(*args, **kwargs):
    """The gate without its chance floor: these versions are constant guesses, none above the majority class's share
    (the floor is tested in test_gate_chance.py); here only the champion comparison and the alias's lease count."""
    return _promote(*args, min_lift=None, **kwargs)


@pytest.fixture(scope="module", params=["sqlite", "server"])
def race(request, gate_table):
    """One registered model per store with three versions of known val accuracy on `gate_table`: `low` (the
    weaker champion), `mid` (the worse challenger), `high` (the better one)."""
    old_uri = mlflow.get_tracking_uri()
    if request.param == "sqlite":
        uri, artifacts = request.getfixturevalue("sqlite_store")
    else:
        uri, artifacts = request.getfixturevalue("mlflow_server"), None
    cfg = _cfg(uri, artifacts, f"race-{request.param}")
    client = configure(cfg.mlflow)
    name = f"race_{request.param}"
    share = {c: _val_share(gate_table, c) for c in CLASS_NAMES}
    low, mid, high = sorted(CLASS_NAMES, key=share.get)
    assert share[low] < share[mid] < share[high], share
    versions = {}
    for role, label in (("low", low), ("mid", mid), ("high", high)):
        with tracked_run(cfg, run_name=f"always-{label}") as run:
            model_uri = log_model(_always(CLASS_NAMES.index(label)), META, input_example_content=_png(0),
                                  run_id=run.run_id)
            versions[role] = register_model(run.client, model_uri, name, run.run_id,
                                            {"delta_table": gate_table, "delta_version": "0"})
    try:
        yield {"client": client, "uri": uri, "name": name, "v": versions,
               "acc": {role: share[label] for role, label in (("low", low), ("mid", mid), ("high", high))}}
    finally:
        mlflow.set_tracking_uri(old_uri)


def _holder(client: MlflowClient, name: str) -> str:
    return str(client.get_model_version_by_alias(name, "champion").version)


def _crown(race, role: str) -> None:
    """Start a scenario from a known state: `role` holds the alias, no lease is left."""
    client, name = race["client"], race["name"]
    client.set_registered_model_alias(name, "champion", race["v"][role])
    assert LEASE_KEY not in (client.get_registered_model(name).tags or {})


def _gates_at_once(race, hold):
    """Run the gates of `mid` and `high` in two threads (each with its own client) against the `low` champion.
    `hold[role](done)` (optional) is called by that gate's scorer right after it scored the champion it first read,
    with `done` the gates' finished events, so a test decides when each gate reaches the alias.
    Returns ({role: decision}, {role: [versions it scored, in order]})."""
    _crown(race, "low")
    decisions, scored, errors = {}, {"mid": [], "high": []}, []
    done = {"mid": threading.Event(), "high": threading.Event()}

    def run(role):
        def scorer(uri, rows, metric):
            value = score_on_rows(uri, rows, metric)
            version = uri.rsplit("/", 1)[1]
            scored[role].append(version)
            if version == race["v"]["low"] and role in hold:
                hold[role](done)
            return value

        try:
            decisions[role] = promote(MlflowClient(tracking_uri=race["uri"]), race["name"], race["v"][role],
                                      scorer=scorer)
        except Exception as exc:  # reported by the test
            errors.append((role, exc))
        finally:
            done[role].set()

    threads = [threading.Thread(target=run, args=(role,), name=f"gate-{role}") for role in ("mid", "high")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a gate never finished"
    return decisions, scored


def _after(other):
    """A hold: this gate reaches the alias only once gate `other` has finished."""
    def hold(done):
        assert done[other].wait(240), f"gate {other} did not finish"
    return hold


def _assert_better_won(race, decisions):
    """`high` holds the alias and its gate promoted it; both gates released the lease."""
    client, name, v = race["client"], race["name"], race["v"]
    assert _holder(client, name) == v["high"], decisions
    assert decisions["high"].promoted and decisions["high"].value == pytest.approx(race["acc"]["high"]), decisions
    assert LEASE_KEY not in (client.get_registered_model(name).tags or {})


def _assert_lost_to_high(race, decision):
    """The `mid` gate's decision says it lost to `high`, with both same-rows figures, in its return and its tags."""
    client, name, v = race["client"], race["name"], race["v"]
    assert not decision.promoted and decision.champion_version == v["high"], decision
    assert decision.value == pytest.approx(race["acc"]["mid"])
    assert decision.champion_value == pytest.approx(race["acc"]["high"])
    assert f"does not beat champion version {v['high']}" in decision.reason
    tags = client.get_model_version(name, v["mid"]).tags
    assert tags["gate_champion_version"] == v["high"] and tags["gate_decision"] == decision.reason


@pytest.mark.timeout(600)
def test_better_gate_finishing_last_still_wins(race):
    """The better challenger is slower: the worse one crowns itself first; the better one finds the champion moved
    under it, scores the new champion on the same rows, and takes the alias."""
    decisions, scored = _gates_at_once(race, {"high": _after("mid")})
    v = race["v"]
    _assert_better_won(race, decisions)
    # mid beat low and was crowned (right at that moment); high then judged against mid, not the low it first read
    assert decisions["mid"].promoted and decisions["mid"].champion_version == v["low"]
    assert decisions["high"].moved_from == [v["low"]] and decisions["high"].champion_version == v["mid"]
    assert decisions["high"].champion_value == pytest.approx(race["acc"]["mid"])
    assert scored["high"] == [v["high"], v["low"], v["mid"]]  # the moved champion scored before the alias moved
    assert f"moved version {v['low']} -> version {v['mid']}" in decisions["high"].reason


@pytest.mark.timeout(600)
def test_worse_gate_finishing_last_loses_and_says_so(race):
    """The worse challenger is slower: the better one crowns itself first; the worse one, which beat the old
    champion, finds the better one in its place, scores it, leaves the alias there and says why."""
    decisions, scored = _gates_at_once(race, {"mid": _after("high")})
    v = race["v"]
    _assert_better_won(race, decisions)
    _assert_lost_to_high(race, decisions["mid"])
    assert decisions["mid"].moved_from == [v["low"]] and decisions["high"].moved_from is None
    assert scored["mid"] == [v["mid"], v["low"], v["high"]]
    assert f"moved version {v['low']} -> version {v['high']}" in decisions["mid"].reason
    assert race["client"].get_model_version(race["name"], v["mid"]).tags["gate_champion_moved_from"] == v["low"]


@pytest.mark.timeout(600)
def test_gates_reaching_the_alias_together(race):
    """Both gates scored the old champion, then go for the alias at the same instant: the lease lets one through,
    the other finds the champion moved and judges against it. Whichever went first, the better one ends champion."""
    barrier = threading.Barrier(2, timeout=240)
    decisions, _ = _gates_at_once(race, {"mid": lambda done: barrier.wait(), "high": lambda done: barrier.wait()})
    _assert_better_won(race, decisions)
    v = race["v"]
    assert (decisions["mid"].moved_from is None) != (decisions["high"].moved_from is None)  # exactly one re-scored
    if decisions["mid"].moved_from:  # high went first: mid judged against high and lost
        _assert_lost_to_high(race, decisions["mid"])
    else:  # mid went first and was crowned over low; high judged against mid
        assert decisions["mid"].promoted and decisions["high"].champion_version == v["mid"]


@pytest.mark.timeout(600)
def test_champion_moved_after_the_gate_scored_is_scored_before_the_alias_moves(race):
    """After the gate of `mid` scored champion `low`, the alias moves to `high` (another gate, a person): the gate
    scores `high` on the same rows and leaves it champion; moved back to `low`, `mid` is crowned over `low`."""
    client, name, v = race["client"], race["name"], race["v"]
    _crown(race, "low")
    scored = []

    def scorer(uri, rows, metric):
        value = score_on_rows(uri, rows, metric)
        scored.append(uri.rsplit("/", 1)[1])
        if scored == [v["mid"], v["low"]]:
            client.set_registered_model_alias(name, "champion", v["high"])
        return value

    d = promote(client, name, v["mid"], scorer=scorer)
    assert scored == [v["mid"], v["low"], v["high"]]
    assert not d.promoted and d.champion_version == v["high"] and d.moved_from == [v["low"]]
    assert d.champion_value == pytest.approx(race["acc"]["high"])
    assert _holder(client, name) == v["high"]

    _crown(race, "high")  # and the other way: the champion moves to a weaker one after scoring
    scored.clear()

    def scorer_down(uri, rows, metric):
        value = score_on_rows(uri, rows, metric)
        scored.append(uri.rsplit("/", 1)[1])
        if scored == [v["mid"], v["high"]]:
            client.set_registered_model_alias(name, "champion", v["low"])
        return value

    d = promote(client, name, v["mid"], scorer=scorer_down)
    assert scored == [v["mid"], v["high"], v["low"]]
    assert d.promoted and d.champion_version == v["low"] and d.moved_from == [v["high"]]
    assert _holder(client, name) == v["mid"]


@pytest.mark.timeout(600)
def test_a_held_lease_blocks_the_gate_and_an_expired_one_does_not(race):
    """Another gate's live lease: the gate waits its bound, then fails naming the holder, and moves nothing. The
    lease of a gate that crashed (expired): taken over, the gate decides."""
    client, name, v = race["client"], race["name"], race["v"]
    _crown(race, "low")
    client.set_registered_model_tag(name, LEASE_KEY, Holder("host-x:4242:dead", time.time() + 600,
                                                            "promotion gate of version 99").dumps())
    quick = LeaseTimes(settle_s=0.5, ttl_s=10.0, wait_s=3.0)
    with pytest.raises(RegistryError, match=r"alias 'champion' not moved: lease gate_lease.champion not acquired "
                                            r"within 3 s: held by host-x:4242:dead \(promotion gate of version 99"):
        promote(client, name, v["high"], lease=quick)
    assert _holder(client, name) == v["low"]
    assert "held by host-x:4242:dead" in client.get_model_version(name, v["high"]).tags["gate_decision"]

    client.set_registered_model_tag(name, LEASE_KEY, Holder("host-x:4242:dead", time.time() - 1,
                                                            "promotion gate of version 99").dumps())
    d = promote(client, name, v["high"], lease=quick)
    assert d.promoted and _holder(client, name) == v["high"]
    assert parse_holder((client.get_registered_model(name).tags or {}).get(LEASE_KEY)) is None  # released
