"""The promotion gate: score a challenger and the champion alias's holder on rows both held out, and move the alias
with a compare-and-set.

Concurrent gates (two trains, or `lakehouse promote` / `sync-run` beside a train, finishing together) are correct
because the alias is moved with a compare-and-set that MLflow's registry does not offer, built here:
  1. outside any lock, the gate scores its challenger and the current alias holder on the same held-out rows
     (seconds to minutes): the rows held out by both (pipeline.tracking.heldout: each version's own
     data.val_fraction and data.split_key, of the challenger's pinned table and Delta version; a holder trained on
     another table is not compared);
  2. it takes the alias's lease (pipeline.tracking.lease: a registered-model tag `gate_lease.<alias>`, one holder
     at a time, bounded by a ttl) and re-reads the alias holder;
  3. if the holder is one it has scored, it decides and, still under the lease (checked just before), moves the
     alias; if the holder changed since it scored, it releases the lease, scores the new holder (and itself, when
     the rows both held out differ) on the same rows, and goes back to 2 (at most MAX_GATE_ROUNDS times).
So every alias write is decided against the holder it replaces, on the same rows: the alias ends on the best of the
versions the gates compared, and a gate that loses (its champion moved to a better model) says so in its decision.
The assumption is the lease's: every gate uses the same lease times, a registry call completes within
`LeaseTimes.settle_s` (each gate refuses a lease whose write took longer), and hosts' clocks agree to within the
lease's margin. Something that moves the alias without this gate (by hand, another tool) is not excluded by it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from pipeline.config import MlflowConfig
from pipeline.lakehouse.split import held_out_by_all
from pipeline.log import get_logger
from pipeline.redact import URL_MASK, error_line, redact_url
from pipeline.tracking.heldout import (HeldOutRows, Scorer, chance_level, chance_what, comparable, held_out_rows,
                                       holdout_of, pinned_data, score_on_rows, split_of)
from pipeline.tracking.lease import Lease, LeaseHeld, LeaseLost, LeaseOverrun, LeaseTimes
from pipeline.tracking.registry import RegistryError, _error_code
from pipeline.tracking.runs import temporary_env

log = get_logger(__name__)

GATE_MODES = ("max", "min")
# The tag on a model version that records what the gate decided about it; every tag the gate writes on a version
# starts with GATE_PREFIX, and each gate's record replaces the earlier one's whole (`_record`).
GATE_TAG = "gate_decision"
GATE_PREFIX = "gate_"
# The registered-model tag holding the gate's lease on an alias (its key: LEASE_TAG + "." + alias).
LEASE_TAG = "gate_lease"
# How many times one gate re-scores a champion that moved while it scored before it gives up.
MAX_GATE_ROUNDS = 5


@dataclass
class PromotionDecision:
    """What the gate decided about one model version, with the numbers it compared (same rows for both)."""

    promoted: bool
    version: str
    metric: str
    value: Optional[float]
    champion_version: Optional[str]
    champion_value: Optional[float]
    reason: str
    margin: float = 0.0
    rows: Optional[str] = None  # what both were scored on, e.g. "val split of work/delta/digits version 3 (361 rows)"
    error: Optional[str] = None  # why a model could not be scored (the decision is then "not promoted")
    # the alias holders that moved while this gate scored (another gate crowned them), oldest first
    moved_from: Optional[List[str]] = None
    chance: Optional[float] = None  # what a constant guess scores on the same rows (see `chance_level`); None: unknown
    min_lift: Optional[float] = None  # the margin over `chance` a version must beat; None: no chance floor


def clears_chance(value: Optional[float], chance: Optional[float], min_lift: Optional[float], mode: str) -> bool:
    """`value` beats `chance` by more than `min_lift` (max: value > chance + lift; min: value < chance - lift); True
    when there is no floor (`chance` or `min_lift` None); False for a value that is not a number."""
    if value is None or math.isnan(value):
        return False
    if chance is None or min_lift is None:
        return True
    return value - chance > min_lift if mode == "max" else chance - value > min_lift


def decide(version: str, value: Optional[float], champion_version: Optional[str], champion_value: Optional[float],
           metric: str = "val_acc", mode: str = "max", margin: float = 0.0,
           champion_error: Optional[str] = None, chance: Optional[float] = None,
           min_lift: Optional[float] = None) -> PromotionDecision:
    """The gate's pure rule: promote when `value` beats the chance level by more than `min_lift` (the floor, see
    `chance_level`; none when `chance` or `min_lift` is None) and there is no champion, or it beats the champion's
    value (measured on the same rows) by more than `margin` (max: value > champion + margin; min: value < champion -
    margin).

    A tie never promotes; neither does a champion that could not be scored (`champion_error`) nor a value that
    is not a number. The floor holds for the first version too: a useless first model is not crowned.
    """
    _check_keys(mode, margin, min_lift)
    version = str(version)
    champ = None if champion_version is None else str(champion_version)
    better_word = "higher" if mode == "max" else "lower"

    def out(promoted: bool, reason: str) -> PromotionDecision:
        return PromotionDecision(promoted, version, metric, value, champ, champion_value, reason, margin,
                                 error=champion_error, chance=chance, min_lift=min_lift)

    if value is None or math.isnan(value):
        return out(False, f"version {version} has {metric}={value}, which cannot be compared; not promoted")
    if champ == version:
        return out(True, f"version {version} ({metric}={value:g}) is already the champion")
    what = chance_what(metric, mode)
    if min_lift is None:
        floor = "no chance floor (mlflow.gate_min_lift is null)"
    elif chance is None:
        floor = (f"no chance floor: no known chance level for {metric} in {mode} mode" if what is None else
                 f"no chance floor: no labelled rows to measure {what} on")
    elif not clears_chance(value, chance, min_lift, mode):
        kept = f"champion version {champ} kept" if champ is not None else "no champion yet, none crowned"
        return out(False, f"version {version} {metric}={value:g} does not beat chance {metric}={chance:g} ({what} "
                          f"on the same rows) by more than mlflow.gate_min_lift {min_lift:g} ({better_word} is "
                          f"better); registered, not promoted ({kept})")
    else:
        floor = f"beats chance {chance:g} ({what}) by {abs(value - chance):g} > min lift {min_lift:g}"
    if champ is None:
        return out(True, f"no champion yet; version {version} ({metric}={value:g}) becomes champion; {floor}")
    if champion_error is not None and champion_error.startswith("refused"):
        return out(False, f"version {version} ({metric}={value:g}) is not compared with champion version {champ}: "
                          f"{champion_error}; champion kept, not promoted")
    if champion_error is not None:
        return out(False, f"champion version {champ} could not be scored ({champion_error}); version {version} "
                          f"({metric}={value:g}) is not promoted: fix or move the alias by hand")
    if champion_value is None or math.isnan(champion_value):
        return out(False, f"champion version {champ} has {metric}={champion_value}, which cannot be compared; "
                          f"version {version} ({metric}={value:g}) is not promoted: move the alias by hand")
    gain = value - champion_value if mode == "max" else champion_value - value
    if gain > margin:
        return out(True, f"version {version} {metric}={value:g} beats champion version {champ} "
                         f"{metric}={champion_value:g} by {gain:g} > margin {margin:g} ({better_word} is better); "
                         f"promoted; {floor}")
    return out(False, f"version {version} {metric}={value:g} does not beat champion version {champ} "
                      f"{metric}={champion_value:g} by more than margin {margin:g} ({better_word} is better); "
                      f"champion kept")



def _champion(client: MlflowClient, name: str, alias: str) -> Optional[ModelVersion]:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        # No alias: RESOURCE_DOES_NOT_EXIST, or (SQLite store, 3.x) INVALID_PARAMETER_VALUE "alias ... not found".
        code = _error_code(exc)
        if "RESOURCE_DOES_NOT_EXIST" in code or ("INVALID_PARAMETER_VALUE" in code and "not found" in str(exc)):
            return None
        raise


class _ModelTags:
    """The registered model's tags as the lease's TagStore."""

    def __init__(self, client: MlflowClient, name: str):
        self.client, self.name = client, name

    def get(self, key: str) -> Optional[str]:
        return (self.client.get_registered_model(self.name).tags or {}).get(key)

    def set(self, key: str, value: str) -> None:
        self.client.set_registered_model_tag(self.name, key, value)

    def delete(self, key: str) -> None:
        self.client.delete_registered_model_tag(self.name, key)


def _chain(holders: List[Optional[str]]) -> str:
    """Alias holders in order, e.g. `version 4 -> version 6` (`no version` where the alias was unset)."""
    return " -> ".join(f"version {v}" if v is not None else "no version" for v in holders)


def _one_line(exc: BaseException) -> str:
    """The exception's first line, URL passwords hidden: it goes into a registry tag and the gate's reason."""
    return error_line(exc, 500)


def _where_alias_is(holder_now) -> str:
    """Where the alias is now, for a gate's failure message; a registry that cannot say is said (the failure being
    reported must not turn into another)."""
    try:
        return f"the alias is on {_chain([holder_now()])}"
    except MlflowException:
        return "the registry did not say where the alias is"


def _set_alias_within(client: MlflowClient, name: str, alias: str, version: str, bound_s: float) -> None:
    """Move `alias` to `version` within about `bound_s` (the time left on the gate's lease): MLflow's HTTP retries
    (whose defaults retry for minutes) fit in it, so a retried write cannot land long after the lease is gone."""
    timeout = max(1, int(bound_s / 4))  # 3 attempts of `timeout` and backoffs of 1 + 2 s
    with temporary_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout),
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
                        "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER": "false"}):  # a 503's Retry-After: 60 would outlast it
        client.set_registered_model_alias(name, alias, version)


def _record(client: MlflowClient, name: str, version: str, tags: Dict[str, str]) -> None:
    """The gate's record on the version: `tags` (its gate_* tags) written, then every other gate_* tag the version
    has removed: an earlier gate's figures (gate_champion_<metric>, gate_chance_<metric>, ...) would contradict this
    one's decision. A tag that cannot be written or removed is logged; the decision stands. Where no tag could be
    written (the registry is down), nothing is removed: no more calls are spent on it."""
    written = 0
    for key, val in tags.items():
        try:
            client.set_model_version_tag(name, version, key, redact_url(str(val))[:5000])
            written += 1
        except MlflowException as exc:  # the decision stands even if an audit tag cannot be written
            log.warning("could not tag model %r version %s with %s: %s", name, version, key, exc)
    if not written:
        return
    try:
        stale = sorted(k for k in (client.get_model_version(name, version).tags or {})
                       if k.startswith(GATE_PREFIX) and k not in tags)
    except MlflowException as exc:
        log.warning("could not read the tags of model %r version %s to remove an earlier gate's: %s", name, version,
                    exc)
        return
    for key in stale:
        try:
            client.delete_model_version_tag(name, version, key)
        except MlflowException as exc:
            log.warning("could not remove the earlier gate's tag %s of model %r version %s: %s", key, name, version,
                        exc)


def _with_credentials(recorded: str, tables: Sequence[str]) -> str:
    """The table a version records (its location, any credentials in the URL redacted: pipeline.redact), read through
    the one of `tables` (the config's `delta.table`, credentials and all) that it records; else as recorded."""
    if URL_MASK not in recorded:
        return recorded
    from pipeline.lakehouse.delta import table_location

    for table in tables:
        if table and redact_url(table_location(str(table))) == recorded:
            return table_location(str(table))
    return recorded


def _check_keys(mode: str, margin: float, min_lift: Optional[float]) -> None:
    if mode not in GATE_MODES:
        raise ValueError(f"config key 'mlflow.gate_mode': {mode!r} is not one of {', '.join(GATE_MODES)}")
    if margin is None or not margin >= 0:
        raise ValueError(f"config key 'mlflow.gate_margin': {margin!r} must be a number >= 0")
    if min_lift is not None and not min_lift >= 0:
        raise ValueError(f"config key 'mlflow.gate_min_lift': {min_lift!r} must be a number >= 0 or null")


class _Scoring:
    """The rows and scores one gate has: rows per rule (read once), the challenger's score on each, each holder's."""

    def __init__(self, client: MlflowClient, name: str, mv: ModelVersion, metric: str, val_fraction: float,
                 held_out: Optional[HeldOutRows], scorer: Scorer, tables: Sequence[str] = ()):
        self.client, self.name, self.mv, self.metric, self.scorer = client, name, mv, metric, scorer
        self.version, self.val_fraction, self.given = str(mv.version), val_fraction, held_out
        self.rows: Dict[Tuple, HeldOutRows] = {}
        self.value: Dict[Tuple, float] = {}
        self.holder_rows: Dict[str, Tuple] = {}  # holder -> the rows it was compared on
        self.scores: Dict[str, float] = {}
        self.errors: Dict[str, str] = {}
        if held_out is None:
            recorded, self.data_version = pinned_data(name, mv)
            self.table = _with_credentials(recorded, tables)
            self.own = holdout_of(client, mv, val_fraction)
        self.own_key = self.rows_for(None)

    def rows_for(self, holder: Optional[ModelVersion]) -> Tuple:
        """The key of the rows held out by the challenger (and `holder`), read on first use."""
        if self.given is not None:
            key: Tuple = ("given",)
            self.rows[key] = self.given
            return key
        key = held_out_by_all([self.own] if holder is None else
                              [self.own, holdout_of(self.client, holder, self.val_fraction)], split_of(self.metric))
        if key not in self.rows:
            self.rows[key] = held_out_rows(self.table, self.data_version, key, split_of(self.metric))
        return key

    def challenger(self, key: Tuple) -> float:
        """The challenger's score on rows `key`; a challenger that cannot be scored is refused (RegistryError)."""
        if key not in self.value:
            rows = self.rows[key]
            try:
                self.value[key] = self.scorer(f"models:/{self.name}/{self.version}", rows, self.metric)
            except Exception as exc:
                why = (f"model {self.name!r} version {self.version} could not be scored on the {rows.describe()}: "
                       f"{_one_line(exc)}")
                _record(self.client, self.name, self.version, {GATE_TAG: f"not promoted: {why}"})
                raise RegistryError(why) from exc
        return self.value[key]

    def holder(self, holder: str, alias: str) -> None:
        """Score the alias holder and the challenger on the rows both held out (or say why they cannot be)."""
        try:
            hmv = self.client.get_model_version(self.name, holder)
            refusal = None if self.given is not None else comparable(self.name, self.mv, hmv)
            if refusal:
                self.errors[holder] = refusal
                return
            key = self.rows_for(hmv)
        except Exception as exc:  # e.g. no row is held out by both
            self.errors[holder] = f"model {self.name!r} version {holder} ({alias}) cannot be compared: {_one_line(exc)}"
            return
        self.challenger(key)
        self.holder_rows[holder] = key
        try:
            self.scores[holder] = self.scorer(f"models:/{self.name}/{holder}", self.rows[key], self.metric)
        except Exception as exc:
            self.errors[holder] = (f"model {self.name!r} version {holder} ({alias}) cannot be loaded or scored: "
                                   f"{_one_line(exc)}")

    def compared(self, holder: Optional[str]) -> Tuple[float, HeldOutRows]:
        """The challenger's score and the rows of its comparison with `holder` (its own held-out rows if none)."""
        key = self.holder_rows.get(holder, self.own_key) if holder is not None else self.own_key
        return self.value[key], self.rows[key]


def promote(client: MlflowClient, name: str, version: str, metric: str = "val_acc", mode: str = "max",
            alias: str = "champion", margin: float = 0.0, val_fraction: float = 0.2,
            held_out: Optional[HeldOutRows] = None, scorer: Scorer = score_on_rows,
            lease: LeaseTimes = LeaseTimes(),
            min_lift: Optional[float] = MlflowConfig.gate_min_lift, tables: Sequence[str] = ()) -> PromotionDecision:
    """Score the challenger `version` and the `alias` holder on the rows both held out; move `alias` only if the
    challenger beats the chance level of those rows by more than `min_lift` (`mlflow.gate_min_lift`; None: no such
    floor) and the holder by more than `margin` (see `decide`), with the compare-and-set of the module docstring:
    the holder is re-read under the alias's lease just before the move, and re-scored if it changed. A challenger
    under the floor on its own held-out rows stays registered, unpromoted; the holder is then not scored.

    The rows: of the Delta version the challenger was trained on (its tags delta_table, delta_version), the `val`
    rows (`train` for a `train_*` metric) held out by the challenger and by the holder (pipeline.tracking.heldout:
    each one's data.val_fraction, else `val_fraction`, and data.split_key, else path), unless `held_out` is given. A
    holder trained on another table is not compared (the alias stays; the reason says why). Both figures, the rows and
    the decision are recorded as tags of the challenger (gate_<metric>, gate_champion_<metric>,
    gate_champion_version, gate_rows, gate_margin, gate_chance_<metric> and gate_min_lift when the floor applies,
    gate_decision, and gate_champion_moved_from when the holder moved while it scored). A champion that cannot be
    loaded or scored leaves the alias where it is; the decision's `error` and reason name its version, and it is
    logged as an error. `tables`: the config's `delta.table`, through which a version that records it with the
    credentials in its URL redacted is read.

    Raises:
        RegistryError: the challenger has no pinned data, or it cannot be loaded or scored; the alias's lease was
            held by another gate for longer than `lease.wait_s` (the message names it); the alias moved more than
            MAX_GATE_ROUNDS times while this gate scored; a registry call of the gate failed (MlflowException: a 503,
            a timeout; the message names the version and the alias, which this gate has not moved).
        ValueError: `mode` is not max/min, `margin` < 0, or `min_lift` < 0.
    """
    _check_keys(mode, margin, min_lift)
    version = str(version)
    try:
        return _promote(client, name, version, metric, mode, alias, margin, val_fraction, held_out, scorer, lease,
                        min_lift, tables)
    except MlflowException as exc:
        # every registry read and write of the gate but the alias's move (which says whether it may have landed) and
        # the records made after it (which log their failures): the alias was not moved by this gate
        why = (f"promotion gate for model {name!r} version {version}: a registry call failed ({_one_line(exc)}); "
               f"alias {alias!r} not moved by this gate: run the gate again (`lakehouse promote`)")
        if "RESOURCE_DOES_NOT_EXIST" not in _error_code(exc):  # a blip (a 503, a timeout): said on the version too
            _record(client, name, version, {GATE_TAG: f"not promoted: {why}"})
        raise RegistryError(why) from exc


def _promote(client: MlflowClient, name: str, version: str, metric: str, mode: str, alias: str, margin: float,
             val_fraction: float, held_out: Optional[HeldOutRows], scorer: Scorer, lease: LeaseTimes,
             min_lift: Optional[float], tables: Sequence[str]) -> PromotionDecision:
    """`promote`'s work; a registry call's MlflowException goes up to it."""
    mv = client.get_model_version(name, version)
    s = _Scoring(client, name, mv, metric, val_fraction, held_out, scorer, tables)
    own_value = s.challenger(s.own_key)
    own_chance = chance_level(metric, mode, s.rows[s.own_key].labels)

    def holder_now() -> Optional[str]:
        current = _champion(client, name, alias)
        return str(current.version) if current is not None else None

    seen = [holder_now()]  # the holders this gate scored against, in order
    decision: Optional[PromotionDecision] = None
    if not clears_chance(own_value, own_chance, min_lift, mode):  # nothing to move: no holder to score, no lease
        decision = decide(version, own_value, seen[-1], None, metric, mode, margin, None, own_chance, min_lift)
    for _ in range(MAX_GATE_ROUNDS if decision is None else 0):
        holder = seen[-1]
        if holder is not None and holder != version and holder not in s.scores and holder not in s.errors:
            s.holder(holder, alias)  # outside the lease: scoring takes seconds to minutes
        gate_lease = Lease(_ModelTags(client, name), f"{LEASE_TAG}.{alias}",
                           what=f"promotion gate of model {name!r} version {version}", times=lease)
        try:
            gate_lease.acquire()
        except LeaseHeld as exc:
            why = f"promotion gate for model {name!r} version {version}: alias {alias!r} not moved: {exc}"
            _record(client, name, version, {f"gate_{metric}": f"{own_value:.6g}", GATE_TAG: f"not promoted: {why}"})
            raise RegistryError(why) from None
        try:
            now = holder_now()
            if now != holder:  # moved while this gate scored: score the new holder on the rows both held out, again
                log.warning("promotion gate for model %r version %s: alias %r moved %s while this gate scored; "
                            "scoring the new holder on the rows both held out", name, version, alias,
                            _chain([holder, now]))
                seen.append(now)
                continue
            value, rows = s.compared(holder)
            decision = decide(version, value, holder, s.scores.get(holder), metric, mode, margin,
                              s.errors.get(holder), chance_level(metric, mode, rows.labels), min_lift)
            if decision.promoted and holder != version:
                try:
                    gate_lease.guarded(lambda bound_s: _set_alias_within(client, name, alias, version, bound_s))
                except LeaseOverrun as exc:  # moved, but maybe after another gate judged the holder it replaced
                    why = (f"promotion gate for model {name!r} version {version}: alias {alias!r} was set to it, but "
                           f"late: {exc}; that gate may have judged against version {holder} and been overwritten; "
                           f"{_where_alias_is(holder_now)}: run `lakehouse promote` on the versions both gates "
                           f"judged")
                    _record(client, name, version, {f"gate_{metric}": f"{own_value:.6g}", GATE_TAG: why})
                    raise RegistryError(why) from None
                except MlflowException as exc:  # refused or timed out within the lease: it may still have landed
                    why = (f"promotion gate for model {name!r} version {version}: moving alias {alias!r} to it "
                           f"failed ({_one_line(exc)}); whether it landed is not known: {_where_alias_is(holder_now)}; "
                           f"run `lakehouse promote` again")
                    _record(client, name, version, {f"gate_{metric}": f"{own_value:.6g}", GATE_TAG: why})
                    raise RegistryError(why) from None
            break
        except LeaseLost as exc:  # stalled past its margin, or taken: nothing written, judge again
            log.warning("promotion gate for model %r version %s: %s; trying again", name, version, exc)
            decision = None
        finally:
            gate_lease.release()
    if decision is None:
        why = (f"promotion gate for model {name!r} version {version}: no decision in {MAX_GATE_ROUNDS} rounds (alias "
               f"{alias!r} moved {_chain(seen)} while this gate scored; a lost lease is logged); alias not moved: "
               f"run the gate again (`lakehouse promote`)")
        _record(client, name, version, {f"gate_{metric}": f"{own_value:.6g}", GATE_TAG: f"not promoted: {why}"})
        raise RegistryError(why)
    _record_decision(client, name, decision, s, seen, alias, margin, min_lift, mode)
    return decision


def _record_decision(client: MlflowClient, name: str, decision: PromotionDecision, s: _Scoring,
                     seen: List[Optional[str]], alias: str, margin: float, min_lift: Optional[float],
                     mode: str) -> None:
    """Tag the challenger with the decision and its numbers, and log it (loudly when it lost or is under chance)."""
    version, metric = decision.version, decision.metric
    champion_version, champion_error = decision.champion_version, decision.error
    compared_with = champion_version if champion_version in s.holder_rows else None
    value, rows = s.compared(compared_with)
    chance = decision.chance
    decision.rows = rows.describe()
    moved = [str(v or "none") for v in seen[:-1]] if len(seen) > 1 else None
    if moved:
        decision.moved_from = moved
        decision.reason += (f" (alias {alias!r} moved {_chain(seen)} while this gate scored; judged against the "
                            f"last holder on the rows both held out)")
    tags = {f"gate_{metric}": f"{value:.6g}", "gate_rows": decision.rows, "gate_margin": f"{margin:g}",
            GATE_TAG: decision.reason}
    if chance is not None and min_lift is not None:
        tags.update({f"gate_chance_{metric}": f"{chance:.6g}", "gate_min_lift": f"{min_lift:g}"})
    if champion_version is not None and champion_version != version:
        tags["gate_champion_version"] = champion_version
        if champion_error or decision.champion_value is not None:  # unscored when the challenger is under chance
            tags[f"gate_champion_{metric}"] = "error" if champion_error else f"{decision.champion_value:.6g}"
    if moved:
        tags["gate_champion_moved_from"] = ",".join(moved)
    _record(client, name, version, tags)  # an earlier gate's other gate_* tags removed: not this decision's
    if champion_error:
        log.error("promotion gate for model %r version %s: %s", name, version, decision.reason)
    elif (moved and not decision.promoted) or not clears_chance(value, chance, min_lift, mode):
        # lost to a champion crowned while it scored, or no better than a constant guess: say so loudly
        log.warning("promotion gate for model %r version %s on the %s: %s", name, version, decision.rows,
                    decision.reason)
    else:
        log.info("promotion gate for model %r version %s on the %s: %s", name, version, decision.rows,
                 decision.reason)
