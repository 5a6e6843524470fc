"""The promotion gate against a real SQLite registry (a stand-in scorer, given held-out rows): a registry call that
fails during the gate (a 503 blip) leaves the version registered, not promoted, with the reason recorded and no
exception past `gate_version` (so `train` still prints its summary); and a version gated again carries no gate_* tag
of the earlier gate that the new decision did not write."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.config import Config, apply_overrides
from pipeline.tracking.gate import GATE_TAG, promote
from pipeline.tracking.heldout import HeldOutRows
from pipeline.tracking.lease import LeaseTimes
from pipeline.tracking.registry import RegistryError

ROWS = HeldOutRows("t", 0, "val", [b"x"] * 10, ["a"] * 5 + ["b"] * 5)  # chance val_acc 0.5
FAST = LeaseTimes(settle_s=0.5, ttl_s=5.0, wait_s=20.0)  # settle_s: an SQLite write on a busy CI machine


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """One store for the module: creating an SQLite store costs seconds (MLflow's migrations); names differ."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('gate_faults')}/mlflow.db"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _versions(client, name, n):
    client.create_registered_model(name)
    return [str(client.create_model_version(name, source=str(i)).version) for i in range(n)]


def _scorer(scores):
    """A stand-in scorer: a fixed figure per version, or an exception to raise."""
    def score(uri, rows, metric):
        got = scores[uri.rsplit("/", 1)[1]]
        if isinstance(got, Exception):
            raise got
        return got

    return score


def _blip_once(monkeypatch, cls, method):
    """`cls.method` raises a 503 the first time it is called, then works."""
    real, fired = getattr(cls, method), []

    def flaky(self, *args, **kwargs):
        if not fired:
            fired.append(method)
            raise MlflowException("API request to endpoint /api/2.0/mlflow/registered-models/get failed with error "
                                  "code 503 != 200", error_code="TEMPORARILY_UNAVAILABLE")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, flaky)
    return fired


@pytest.mark.parametrize("where", ["lease", "alias"])
def test_a_registry_blip_during_the_gate_leaves_the_version_registered_not_promoted_with_the_reason(
        registry, monkeypatch, where):
    """A 503 on the lease's read of the registered model's tags (`_ModelTags.get`), or on the read of the alias
    holder: a RegistryError naming the version and alias, the reason in gate_decision, the alias where it was; and
    `gate_version` (what `train` and `sync-run` call) returns "not promoted" instead of raising."""
    import pipeline.tracking.gate as gate_module
    import pipeline.workflow as workflow

    name = f"blip_{where}"
    v1, v2 = _versions(registry, name, 2)
    scorer = _scorer({v1: 0.7, v2: 0.9})
    assert promote(registry, name, v1, held_out=ROWS, scorer=scorer, lease=FAST, min_lift=None).promoted
    if where == "lease":
        fired = _blip_once(monkeypatch, gate_module._ModelTags, "get")
    else:
        fired = _blip_once(monkeypatch, MlflowClient, "get_model_version_by_alias")
    with pytest.raises(RegistryError) as failed:
        promote(registry, name, v2, held_out=ROWS, scorer=scorer, lease=FAST, min_lift=None)
    assert fired
    why = str(failed.value)
    assert f"model {name!r} version {v2}" in why and "alias 'champion' not moved" in why and "503" in why
    assert registry.get_model_version(name, v2).tags[GATE_TAG] == f"not promoted: {why}"
    assert registry.get_model_version_by_alias(name, "champion").version == int(v1)

    # the same through the job's gate: registered, not promoted, with the reason; nothing raised
    monkeypatch.undo()
    if where == "lease":
        _blip_once(monkeypatch, gate_module._ModelTags, "get")
    else:
        _blip_once(monkeypatch, MlflowClient, "get_model_version_by_alias")
    monkeypatch.setattr(workflow, "gate", lambda client, cfg, version: promote(
        client, name, version, held_out=ROWS, scorer=scorer, lease=FAST, min_lift=None))
    cfg = apply_overrides(Config(), {"mlflow.registered_model": name})
    decision = workflow.gate_version(registry, cfg, v2)
    assert not decision.promoted and "503" in decision.reason and decision.error
    assert registry.get_model_version_by_alias(name, "champion").version == int(v1)


def test_a_version_that_does_not_exist_is_a_registry_error_naming_it(registry):
    _versions(registry, "absent", 1)
    with pytest.raises(RegistryError, match=r"model 'absent' version 7: a registry call failed"):
        promote(registry, "absent", "7", held_out=ROWS, scorer=_scorer({}), lease=FAST, min_lift=None)


def test_a_version_gated_again_keeps_no_tag_of_the_earlier_gate(registry):
    """Version 3 first loses to champion 1 (gate_champion_val_acc=0.8 ...); gated again with a higher floor it is under
    chance, so the champion (now version 2, scoring 0.9) is not scored: no gate_champion_val_acc may remain to claim
    the champion scored 0.8. A gate with no chance floor leaves no gate_chance_* / gate_min_lift either."""
    name = "regate"
    v1, v2, v3 = _versions(registry, name, 3)
    scorer = _scorer({v1: 0.8, v2: 0.9, v3: 0.7})

    def gate(version, lift):
        return promote(registry, name, version, held_out=ROWS, scorer=scorer, lease=FAST, min_lift=lift)

    assert gate(v1, 0.05).promoted
    assert not gate(v3, 0.05).promoted
    tags = registry.get_model_version(name, v3).tags
    assert (tags["gate_champion_version"], tags["gate_champion_val_acc"]) == (v1, "0.8")
    assert gate(v2, 0.05).promoted

    d = gate(v3, 0.3)  # under chance + 0.3: the champion (version 2) is not scored
    assert not d.promoted and d.champion_value is None
    tags = {k: v for k, v in registry.get_model_version(name, v3).tags.items() if k.startswith("gate_")}
    assert "gate_champion_val_acc" not in tags, tags
    assert tags == {"gate_val_acc": "0.7", "gate_rows": d.rows, "gate_margin": "0", GATE_TAG: d.reason,
                    "gate_chance_val_acc": "0.5", "gate_min_lift": "0.3", "gate_champion_version": v2}

    d = gate(v3, None)  # no floor: judged against version 2 (0.9), no chance tags
    tags = {k: v for k, v in registry.get_model_version(name, v3).tags.items() if k.startswith("gate_")}
    assert tags == {"gate_val_acc": "0.7", "gate_rows": d.rows, "gate_margin": "0", GATE_TAG: d.reason,
                    "gate_champion_version": v2, "gate_champion_val_acc": "0.9"}

    registry.set_model_version_tag(name, v3, "owner", "team-a")  # not the gate's: kept
    with pytest.raises(RegistryError):
        promote(registry, name, v3, held_out=ROWS, scorer=_scorer({v3: ValueError("boom")}), lease=FAST)
    tags = registry.get_model_version(name, v3).tags
    assert [k for k in tags if k.startswith("gate_")] == [GATE_TAG] and tags["owner"] == "team-a"
    assert "could not be scored" in tags[GATE_TAG]
