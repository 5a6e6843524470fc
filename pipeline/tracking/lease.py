"""A lease (one holder at a time, bounded in time) on a key of a tag store that has no compare-and-set.

What it is for: the promotion gate must read the champion alias and move it with nothing happening in between,
and MLflow's registry offers only read, write and delete of a registered model's tags and aliases, nothing
atomic. The lease is a tag holding `{"owner", "expires", "what"}`, taken with Fischer's timed mutual exclusion:

    acquire: read the tag; if it is free (absent, unreadable, expired, or already ours) write our own; wait
             `settle_s`; read it again; we hold the lease only if it is still exactly what we wrote. Two
             contenders that both saw it free both write; the later write wins and the earlier one sees the
             other's owner after its wait and goes back to waiting.
    check:   just before the write the lease guards: the tag is still ours with at least `margin_s` left.
    release: delete the tag if it is still ours (else leave it: someone took it after ours expired).

Why this is correct (the assumptions, all bounded):
  1. A contender's write lands within `settle_s` of the read that saw the tag free. Each contender enforces this
     for itself: a write that returned more than `settle_s` after that read is not claimed (it waits and tries
     again), so every contender using the same `settle_s` meets it. If two contenders ever both believed they held
     it, one of them wrote more than `settle_s` after its read, which that one refuses.
  2. Hosts' clocks agree to well within `margin_s` (NTP): `expires` is wall-clock time written by the holder and
     judged by the reader's clock.
  3. The holder's guarded write ends while the lease is still its own. `guarded()` enforces it: it tells the write
     how long it has (the time left less `settle_s`), times it, and a write that ended later raises `LeaseOverrun`
     unless the tag is still ours (nobody can have acted in between), naming who took the lease.
A write the store refuses (the SQLite store's tag upsert can meet a contender's insert) is never claimed either.
A holder that crashes blocks the others for at most `ttl_s`; a contender that cannot get the lease within
`wait_s` fails with `LeaseHeld`, naming the holder and when its lease expires.
"""
from __future__ import annotations

import json
import math
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, TypeVar

from pipeline.log import get_logger
from pipeline.redact import error_line, redact_url

log = get_logger(__name__)


class TagStore(Protocol):
    """Where the lease lives: one string value per key (an MLflow registered model's tags)."""

    def get(self, key: str) -> Optional[str]: ...

    def set(self, key: str, value: str) -> None: ...

    def delete(self, key: str) -> None: ...


class LeaseHeld(RuntimeError):
    """The lease could not be acquired within its wait bound; the message names the holder and its expiry."""


class LeaseLost(RuntimeError):
    """The lease is no longer ours (taken after it expired) or too close to expiry to start the guarded write."""


class LeaseOverrun(RuntimeError):
    """The guarded write ended after the lease expired and another holder took it meanwhile: the write may have
    landed after that holder acted. The message names the holder (when the tag still says) and how late it was."""


T = TypeVar("T")


@dataclass(frozen=True)
class LeaseTimes:
    """The lease's time bounds, in seconds. settle_s: the longest a registry write may take after the read that saw
    the lease free (and the wait before re-reading); ttl_s: how long a lease lasts (a crashed holder blocks others
    at most this long); wait_s: how long acquire() tries before failing; margin_s: the least time left on the lease
    for check() to pass (default: half the ttl)."""

    settle_s: float = 2.0
    ttl_s: float = 30.0
    wait_s: float = 120.0
    margin_s: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("settle_s", "ttl_s", "wait_s"):
            val = getattr(self, key)
            if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                raise ValueError(f"lease time {key}={val!r} must be a number > 0")
        if self.ttl_s <= 2 * self.settle_s + self.margin:
            raise ValueError(f"lease ttl_s={self.ttl_s:g} must exceed 2 x settle_s ({self.settle_s:g}) + margin_s "
                             f"({self.margin:g}): the holder needs time left after it acquired")

    @property
    def margin(self) -> float:
        return self.ttl_s / 2 if self.margin_s is None else float(self.margin_s)


@dataclass(frozen=True)
class Holder:
    """What the lease tag says: who holds it, until when (epoch seconds), and for what."""

    owner: str
    expires: float
    what: str = ""

    def dumps(self) -> str:
        return json.dumps({"owner": self.owner, "expires": self.expires, "what": self.what}, sort_keys=True)

    def describe(self, now: float) -> str:
        left = self.expires - now
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires))
        state = f"expires in {left:.1f} s" if left > 0 else f"expired {-left:.1f} s ago"
        return f"{self.owner} ({self.what or 'no purpose given'}; until {when}, {state})"


def parse_holder(raw: Optional[str]) -> Optional[Holder]:
    """The holder a lease tag names, or None for an absent or unreadable tag (treated as free: a hand-edited or
    truncated tag must not block every gate forever)."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return Holder(str(data["owner"]), float(data["expires"]), str(data.get("what", "")))
    except (ValueError, TypeError, KeyError):
        log.warning("lease tag %r is not a lease record; treated as free", raw[:200])
        return None


def new_owner() -> str:
    """An id no other process will use: host, pid and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """A lease on `key` of `store` for `what` (see the module docstring); a context manager (acquire/release)."""

    def __init__(self, store: TagStore, key: str, what: str = "", times: LeaseTimes = LeaseTimes(),
                 owner: Optional[str] = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.store, self.key, self.what, self.times = store, key, what, times
        self.owner = owner or new_owner()
        self._clock, self._monotonic, self._sleep = clock, monotonic, sleep
        self._written: Optional[str] = None  # the exact tag value of the lease we hold
        self._holder: Optional[Holder] = None

    @property
    def held(self) -> bool:
        return self._written is not None

    def acquire(self) -> Holder:
        """Take the lease, waiting up to `wait_s` while another holds it. Returns what the tag now says.

        Raises:
            LeaseHeld: not acquired within `wait_s`; the message names the last holder seen.
        """
        t = self.times
        deadline = self._monotonic() + t.wait_s
        other: Optional[Holder] = None
        slow: Optional[float] = None
        failed: Optional[str] = None  # the last lease write the store refused
        while True:
            started = self._monotonic()
            holder = parse_holder(self.store.get(self.key))
            now = self._clock()
            if holder is None or holder.expires <= now or holder.owner == self.owner:
                if holder is not None and holder.owner != self.owner:
                    log.warning("lease %s: taking over the expired lease of %s", self.key, holder.describe(now))
                mine = Holder(self.owner, self._clock() + t.ttl_s, self.what)
                written = mine.dumps()
                try:
                    self.store.set(self.key, written)
                    took: Optional[float] = self._monotonic() - started
                except Exception as exc:  # e.g. the SQLite store's upsert meeting a contender's insert: not claimed
                    failed = error_line(exc, 300)
                    log.info("lease %s: the write was refused (%s); trying again", self.key, failed)
                    took = None
                if took is None:
                    pass
                elif took <= t.settle_s:
                    self._sleep(t.settle_s)
                    raw = self.store.get(self.key)
                    if raw == written:
                        self._written, self._holder = written, mine
                        log.debug("lease %s acquired by %s", self.key, self.owner)
                        return mine
                    other = parse_holder(raw)  # someone wrote after us: theirs, we go back to waiting
                else:  # assumption 1 broken by us: a contender may already hold it; never claim on a late write
                    slow = took
                    log.warning("lease %s: the write took %.2f s after the read, more than settle_s=%g s; not "
                                "claimed, trying again", self.key, took, t.settle_s)
            else:
                other = holder
            left = deadline - self._monotonic()
            if left <= 0:
                now = self._clock()
                who = other.describe(now) if other is not None else "nobody (the tag kept changing)"
                hint = (f"; this host's registry writes took up to {slow:.2f} s, more than settle_s={t.settle_s:g} s"
                        if slow is not None else "")
                hint += f"; the last lease write was refused: {failed}" if failed is not None else ""
                raise LeaseHeld(f"lease {self.key} not acquired within {t.wait_s:g} s: held by {who}{hint}")
            self._sleep(min(left, random.uniform(0.25, 0.75) * t.settle_s))

    def check(self) -> None:
        """Just before the guarded write: the tag is still ours and at least `margin_s` is left on it.

        Raises:
            LeaseLost: it is not (the message says who holds it now or how little time is left).
        """
        if self._written is None or self._holder is None:
            raise LeaseLost(f"lease {self.key} is not held by {self.owner}")
        raw = self.store.get(self.key)
        now = self._clock()
        if raw != self._written:
            now_holder = parse_holder(raw)
            who = now_holder.describe(now) if now_holder else "nobody"
            self._written = None
            raise LeaseLost(f"lease {self.key} of {self.owner} was lost; now held by {who}")
        left = self._holder.expires - now
        if left < self.times.margin:
            raise LeaseLost(f"lease {self.key} of {self.owner} has {left:.1f} s left, less than the "
                            f"{self.times.margin:g} s the guarded write needs")

    def guarded(self, write: Callable[[float], T]) -> T:
        """The guarded write, assumption 3 enforced: `check()`, then `write(bound_s)`, which must bound itself to
        `bound_s` (the time left on the lease less `settle_s`, for the hosts' clocks), timed. A write that ended
        later is fine while the tag is still ours (nobody took the lease, so nobody acted); else LeaseOverrun.

        Raises:
            LeaseLost: from `check()`, before anything is written.
            LeaseOverrun: the write ended past its bound and the lease was taken meanwhile.
        """
        self.check()
        assert self._holder is not None  # check() passed
        bound = self._holder.expires - self._clock() - self.times.settle_s
        started = self._monotonic()
        result = write(bound)
        took = self._monotonic() - started
        if took > bound:
            try:
                raw = self.store.get(self.key)
            except Exception as exc:  # the registry's own exception types: who holds it now cannot be known
                self._written = None
                raise LeaseOverrun(f"lease {self.key} of {self.owner}: the guarded write took {took:.1f} s, past the "
                                   f"{bound:.1f} s it had, and the lease could not be read again "
                                   f"({redact_url(f'{type(exc).__name__}: {exc}')[:300]})") from None
            if raw != self._written:
                now_holder = parse_holder(raw)
                who = (now_holder.describe(self._clock()) if now_holder else
                       "another holder, since gone (the tag was released)")
                self._written = None
                raise LeaseOverrun(f"lease {self.key} of {self.owner}: the guarded write took {took:.1f} s, past the "
                                   f"{bound:.1f} s it had; the lease was taken meanwhile by {who}")
            log.warning("lease %s: the guarded write took %.1f s, past the %.1f s it had; nobody took the lease "
                        "meanwhile", self.key, took, bound)
        return result

    def release(self) -> None:
        """Delete the tag if it is still ours; a failure is logged (the lease then expires after `ttl_s`)."""
        if self._written is None:
            return
        written, self._written = self._written, None
        try:
            if self.store.get(self.key) == written:
                self.store.delete(self.key)
        except Exception as exc:  # the registry's own exception types; the lease expires anyway
            log.warning("lease %s of %s not released (%s: %s); it expires within %g s", self.key, self.owner,
                        type(exc).__name__, exc, self.times.ttl_s)

    def __enter__(self) -> "Lease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
