"""Which commit is a writer's own, and which commits a conditional write lost its race to (pure history logic)."""
import json

from pipeline.lakehouse.delta import COMMIT_KEY, claims_after, own_commit


def _entry(version, writer=None, claim=None, other=None):
    meta = dict(other or {})
    if writer:
        meta[COMMIT_KEY] = {"writer": writer, **({"claim": claim} if claim else {})}
    return {"version": version, "userMetadata": json.dumps(meta) if meta else None}


HISTORY = [  # newest first, as DeltaTable.history gives it
    _entry(5, "w5", "labels"),
    _entry(4, "w4"),  # a blind append: no claim
    _entry(3, "w3", "labels"),
    {"version": 2, "userMetadata": "not json"},  # written by another tool
    _entry(1, "w1", "other"),
    _entry(0, "w0", "labels", {"lakehouse.ingest": {"rows_written": 3}}),
]


def test_own_commit_is_found_by_writer_not_by_latest():
    assert own_commit(HISTORY, "w3") == 3
    assert own_commit(HISTORY, "w0") == 0
    assert own_commit(HISTORY, "nobody") is None


def test_claims_after_the_read_version():
    assert claims_after(HISTORY, "labels", 0) == [3, 5]
    assert claims_after(HISTORY, "labels", 3) == [5]
    assert claims_after(HISTORY, "labels", None) == [0, 3, 5]  # the table did not exist: every claimant
    assert claims_after(HISTORY, "labels", 0, before=5) == [3]
    assert claims_after(HISTORY, "labels", 0, writer="w3") == [5]  # its own commit is no race
    assert claims_after(HISTORY, "other", 0) == [1] and claims_after(HISTORY, "other", 1) == []
