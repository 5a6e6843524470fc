"""Unit tests of the gate's lease (pipeline.tracking.lease) on an in-memory tag store: the acquire/check/release
rules on a fake clock, and mutual exclusion among real threads on a store with random latency."""
from __future__ import annotations

import random
import threading
import time

import pytest

from pipeline.tracking.lease import Holder, Lease, LeaseHeld, LeaseLost, LeaseTimes, parse_holder

KEY = "gate_lease.champion"
TIMES = LeaseTimes(settle_s=1.0, ttl_s=30.0, wait_s=10.0)


class Store:
    """An in-memory tag store; `on_sleep` hooks let a test act while a lease waits; `write_cost` is how long a
    write takes on the fake clock."""

    def __init__(self, clock=None, write_cost=0.0):
        self.tags, self.clock, self.write_cost = {}, clock, write_cost

    def get(self, key):
        return self.tags.get(key)

    def set(self, key, value):
        if self.clock is not None:
            self.clock.now += self.write_cost
        self.tags[key] = value

    def delete(self, key):
        del self.tags[key]


class Clock:
    """Fake time: sleep advances it and runs the test's hooks (what another process does meanwhile)."""

    def __init__(self):
        self.now, self.hooks, self.sleeps = 1_000_000.0, [], []

    def time(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s
        while self.hooks and self.hooks[0][0] <= self.now:
            self.hooks.pop(0)[1]()


def lease(store, clock, owner="me", times=TIMES, what="gate of version 7"):
    return Lease(store, KEY, what=what, times=times, owner=owner, clock=clock.time, monotonic=clock.time,
                 sleep=clock.sleep)


def test_free_lease_is_acquired_after_the_settle_wait_and_released():
    clock = Clock()
    store = Store()
    mine = lease(store, clock)
    got = mine.acquire()
    assert mine.held and got.owner == "me" and got.expires == pytest.approx(1_000_000 + 30)
    assert clock.sleeps == [1.0]  # wrote, waited settle_s, re-read
    assert parse_holder(store.tags[KEY]) == Holder("me", got.expires, "gate of version 7")
    mine.check()
    mine.release()
    assert KEY not in store.tags and not mine.held


def test_held_lease_waits_then_fails_naming_the_holder_and_its_expiry():
    clock = Clock()
    store = Store()
    store.tags[KEY] = Holder("host-b:42:abc", clock.now + 300, "promotion gate of model 'm' version 9").dumps()
    with pytest.raises(LeaseHeld, match=r"not acquired within 10 s: held by host-b:42:abc \(promotion gate of "
                                        r"model 'm' version 9; until .*expires in 29\d\.\d s\)"):
        lease(store, clock).acquire()
    assert clock.now - 1_000_000 == pytest.approx(10, abs=1)  # it waited its bound, no longer
    assert "host-b" in store.tags[KEY]  # the other's lease untouched


def test_a_holder_that_released_lets_the_waiter_in():
    clock = Clock()
    store = Store()
    store.tags[KEY] = Holder("other", clock.now + 300).dumps()
    clock.hooks.append((clock.now + 3, lambda: store.tags.pop(KEY)))
    mine = lease(store, clock)
    mine.acquire()
    assert parse_holder(store.tags[KEY]).owner == "me" and 3 <= clock.now - 1_000_000 < 5


def test_expired_lease_of_a_crashed_holder_is_taken_over():
    clock = Clock()
    store = Store()
    store.tags[KEY] = Holder("crashed", clock.now + 5).dumps()  # never released: blocks only until it expires
    mine = lease(store, clock)
    mine.acquire()
    assert parse_holder(store.tags[KEY]).owner == "me"
    assert 5 <= clock.now - 1_000_000 < 7


def test_unreadable_tag_is_treated_as_free():
    clock = Clock()
    store = Store()
    store.tags[KEY] = "someone typed this"
    lease(store, clock).acquire()
    assert parse_holder(store.tags[KEY]).owner == "me"


def test_a_contender_that_wrote_during_the_settle_wait_wins_and_we_wait():
    """Both read the lease free; the other's write lands after ours: it holds the lease, we do not."""
    clock = Clock()
    store = Store()
    theirs = Holder("other", clock.now + 30, "the other gate").dumps()
    clock.hooks.append((clock.now + 0.5, lambda: store.tags.__setitem__(KEY, theirs)))
    with pytest.raises(LeaseHeld, match="held by other .the other gate"):
        lease(store, clock, times=LeaseTimes(settle_s=1.0, ttl_s=60.0, wait_s=5.0)).acquire()
    assert store.tags[KEY] == theirs


def test_a_write_slower_than_settle_is_never_claimed():
    clock = Clock()
    store = Store(clock, write_cost=1.5)  # each write returns 1.5 s after the read, settle_s is 1
    mine = lease(store, clock, times=LeaseTimes(settle_s=1.0, ttl_s=30.0, wait_s=5.0))
    with pytest.raises(LeaseHeld, match="registry writes took up to 1.50 s, more than settle_s=1 s"):
        mine.acquire()
    assert not mine.held
    with pytest.raises(LeaseLost):
        mine.check()


def test_check_refuses_a_lost_lease_or_one_close_to_expiry():
    clock = Clock()
    store = Store()
    mine = lease(store, clock)
    mine.acquire()
    clock.now += 14  # 29 - 14 = 15 s left: exactly the margin (ttl/2)
    mine.check()
    clock.now += 1
    with pytest.raises(LeaseLost, match=r"has 14.0 s left, less than the 15 s"):
        mine.check()
    store.tags[KEY] = Holder("thief", clock.now + 30, "after ours expired").dumps()
    with pytest.raises(LeaseLost, match="was lost; now held by thief"):
        mine.check()
    mine.release()  # not ours any more: left alone
    assert parse_holder(store.tags[KEY]).owner == "thief"


def test_lease_times_are_validated():
    with pytest.raises(ValueError, match="settle_s"):
        LeaseTimes(settle_s=0)
    with pytest.raises(ValueError, match="ttl_s=5 must exceed"):
        LeaseTimes(settle_s=2, ttl_s=5)


class SlowStore:
    """A thread-safe store whose every call takes a random 0..`jitter` s (a registry across a network)."""

    def __init__(self, jitter):
        self.tags, self.lock, self.jitter = {}, threading.Lock(), jitter

    def _wait(self):
        time.sleep(random.uniform(0, self.jitter))

    def get(self, key):
        self._wait()
        with self.lock:
            return self.tags.get(key)

    def set(self, key, value):
        self._wait()
        with self.lock:
            self.tags[key] = value

    def delete(self, key):
        self._wait()
        with self.lock:
            self.tags.pop(key, None)


@pytest.mark.timeout(120)
def test_threads_never_hold_the_lease_together():
    """6 threads x 3 turns on a store with up to 20 ms per call: at most one holder at any time, every turn done."""
    store = SlowStore(jitter=0.02)
    times = LeaseTimes(settle_s=0.1, ttl_s=10.0, wait_s=60.0)
    inside, most, turns, errors = [0], [0], [], []
    guard = threading.Lock()

    def worker(n):
        try:
            for turn in range(3):
                with Lease(store, KEY, what=f"worker {n}", times=times) as held:
                    with guard:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    held.check()
                    time.sleep(random.uniform(0, 0.03))
                    with guard:
                        inside[0] -= 1
                        turns.append((n, turn))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert most[0] == 1 and len(turns) == 18
    assert KEY not in store.tags  # every holder released


def test_a_refused_write_is_never_claimed_and_named_when_it_keeps_failing():
    clock = Clock()
    store = Store()
    calls = []

    def refuse(key, value):
        calls.append(value)
        if len(calls) == 1 or len(calls) > 2:
            raise RuntimeError("UNIQUE constraint failed: registered_model_tags.key")
        store.tags[key] = value

    store.set = refuse
    mine = lease(store, clock, times=LeaseTimes(settle_s=1.0, ttl_s=30.0, wait_s=5.0))
    mine.acquire()  # refused once, then written: acquired on the second try
    assert len(calls) == 2 and mine.held and store.tags[KEY] == calls[1]
    mine.release()
    with pytest.raises(LeaseHeld, match="the last lease write was refused: RuntimeError: UNIQUE constraint failed"):
        mine.acquire()
    assert not mine.held
