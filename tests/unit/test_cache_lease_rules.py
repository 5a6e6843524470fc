"""Unit tests of the converted-data cache's leases (pipeline.data.leases) and of eviction and clearing honouring them,
on real files in a temporary folder and real processes (no Spark: entries are manifests with made-up sizes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest

from pipeline.data import cache, leases
from pipeline.data.leases import Holder, JobLeases, cache_lock, live_holders, read_holders, stale_reason
from pipeline.data.shards import FORMAT_VERSION, ConversionError

HOST, BOOT = leases.this_host()
NS = leases.this_pid_ns()  # this process's PID namespace, "pid:[...]" on Linux
OTHER_NS = "pid:[1]"  # no real namespace has inode 1: another container's or pod's on this host
FS = pafs.LocalFileSystem()


def _holder(**kw) -> Holder:
    base = dict(key="k", job="train", pid=os.getpid(), host=HOST, boot_id=BOOT,
                pid_start=leases.process_start(os.getpid()), pid_ns=NS, taken=1000.0, renewed=1000.0)
    return Holder(**{**base, **kw})


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- who is live --------------------------------------------------------------------------------

def test_same_host_lease_lives_with_its_process_not_its_age():
    now = 1000.0 + 10 * leases.STALE_S  # never renewed for a long time: on this host only the pid counts
    assert stale_reason(_holder(), now, HOST, BOOT) is None
    dead = _dead_pid()
    reason = stale_reason(_holder(pid=dead, pid_start=None), now, HOST, BOOT)
    assert reason == f"pid {dead} no longer runs on host {HOST}"


def test_a_reused_pid_or_a_rebooted_host_is_not_the_holder():
    start = leases.process_start(os.getpid())
    assert start is not None  # Linux /proc
    assert leases.pid_alive(os.getpid(), start)
    assert not leases.pid_alive(os.getpid(), start + 1)  # same pid, another process start: reused
    reason = stale_reason(_holder(boot_id="another-boot"), 1001.0, HOST, "this-boot")
    assert reason is not None and "restarted" in reason


def test_another_hosts_lease_lives_while_renewed():
    other = _holder(host="elsewhere", pid=1)  # its pid means nothing here
    assert stale_reason(other, 1000.0 + leases.STALE_S - 1, HOST, BOOT) is None
    reason = stale_reason(other, 1000.0 + leases.STALE_S + 5, HOST, BOOT)
    assert reason is not None and "elsewhere" in reason and "not renewed" in reason


# --- PID namespaces: containers or pods on one host, sharing its name and boot id, not its pids ------------

def _never_asked(pid, start):
    raise AssertionError(f"pid {pid} of another PID namespace was checked in this one")


def test_another_pid_namespaces_lease_lives_while_renewed_whatever_its_pid_is_here():
    assert NS is not None and NS.startswith("pid:[")  # Linux /proc
    dead = _holder(pid=_dead_pid(), pid_start=None, pid_ns=OTHER_NS)  # its pid runs in its own namespace
    fresh = 1000.0 + leases.STALE_S - 1
    assert stale_reason(dead, fresh, HOST, BOOT) is None  # the real pid check, from this namespace: not consulted
    assert stale_reason(dead, fresh, HOST, BOOT, alive=_never_asked, pid_ns=NS) is None
    reason = stale_reason(dead, 1000.0 + leases.STALE_S + 5, HOST, BOOT, alive=_never_asked, pid_ns=NS)
    assert reason is not None and "not renewed" in reason and OTHER_NS in reason and HOST in reason
    # nor does a pid that runs here (another process, reusing its number) keep a lease its holder stopped renewing
    reused = _holder(pid=os.getpid(), pid_ns=OTHER_NS)
    assert stale_reason(reused, 1000.0 + leases.STALE_S + 5, HOST, BOOT) is not None
    # ours unknown (no /proc/self/ns here): a lease naming a namespace cannot be compared, so judged by its renewals
    assert stale_reason(dead, fresh, HOST, BOOT, alive=_never_asked, pid_ns=None) is None
    assert stale_reason(dead, 1000.0 + leases.STALE_S + 5, HOST, BOOT, alive=_never_asked, pid_ns=None) is not None


def test_this_pid_namespaces_lease_keeps_the_pid_check():
    dead = _dead_pid()
    renewed_now = _holder(pid=dead, pid_start=None, renewed=5000.0)
    assert stale_reason(renewed_now, 5000.0, HOST, BOOT) == f"pid {dead} no longer runs on host {HOST}"
    asked = []
    assert stale_reason(_holder(), 1000.0 + 10 * leases.STALE_S, HOST, BOOT,
                        alive=lambda pid, start: asked.append(pid) or True, pid_ns=NS) is None
    assert asked == [os.getpid()]
    assert stale_reason(_holder(), 1001.0, HOST, BOOT, alive=lambda pid, start: False, pid_ns=NS) is not None


def test_an_old_lease_file_without_a_namespace_still_reads_and_is_judged_by_its_pid(tmp_path):
    """Lease files written before leases recorded the PID namespace: read as before, pid_ns None, and (the documented
    choice) judged by their pid on this host, as they were."""
    root = str(tmp_path)
    folder = tmp_path / ".leases" / "a"
    folder.mkdir(parents=True)
    dead = _dead_pid()
    for name, pid in (("live", os.getpid()), ("dead", dead)):
        (folder / f"{HOST}--{pid}--{name}.json").write_text(json.dumps(
            {"key": "a", "job": f"old {name}", "pid": pid, "host": HOST, "boot_id": BOOT, "pid_start": None,
             "taken": 1000.0, "renewed": time.time()}))
    got = {h.job: h for h in read_holders(FS, root)["a"]}
    assert set(got) == {"old live", "old dead"} and all(h.pid_ns is None for h in got.values())
    reason = stale_reason(got["old dead"], time.time(), HOST, BOOT, pid_ns=NS)
    assert reason == f"pid {dead} no longer runs on host {HOST}"
    with cache_lock(FS, root):
        assert [h.job for h in live_holders(FS, root, prune=True)["a"]] == ["old live"]


def test_a_live_lease_of_another_pid_namespace_survives_a_prune_and_a_new_lease_records_ours(tmp_path):
    root = str(tmp_path)
    pod = _holder(key="a", job="train in another pod", pid=_dead_pid(), pid_start=None, pid_ns=OTHER_NS,
                  renewed=time.time(), file=f"{root}/.leases/a/{HOST}--7--pod.json")
    leases.write_lease(FS, pod)
    with cache_lock(FS, root):
        assert [h.job for h in live_holders(FS, root, prune=True)["a"]] == ["train in another pod"]
    assert os.path.exists(pod.file)
    with JobLeases("train") as job:
        mine = job.take(FS, root, "b")
        assert mine.pid_ns == NS and json.loads(open(mine.file).read())["pid_ns"] == NS
    pod.renewed = time.time() - leases.STALE_S - 60  # its pod stopped renewing: gone
    leases.write_lease(FS, pod)
    with cache_lock(FS, root):
        assert live_holders(FS, root, prune=True) == {}
    assert not os.path.exists(pod.file)


# --- lease files -------------------------------------------------------------------------------------

def test_take_renew_release(tmp_path):
    root = str(tmp_path)
    with JobLeases("tune study s1") as job:
        h = job.take(FS, root, "entryA")
        assert job.take(FS, root, "entryA") is h  # once per key
        held = live_holders(FS, root)
        assert list(held) == ["entryA"] and len(held["entryA"]) == 1
        got = held["entryA"][0]
        assert (got.job, got.pid, got.host) == ("tune study s1", os.getpid(), HOST)
        before = got.renewed
        time.sleep(0.01)
        job.renew()
        assert read_holders(FS, root)["entryA"][0].renewed > before
        os.remove(h.file)  # dropped as stale by another job meanwhile: renewing writes it again
        job.renew()
        assert os.path.exists(h.file)
    assert read_holders(FS, root) == {}  # released at the end of the job
    job.renew()  # a released lease is never written again
    assert read_holders(FS, root) == {}


def test_prune_drops_a_dead_process_lease_and_keeps_live_ones(tmp_path):
    root = str(tmp_path)
    dead = _holder(key="a", pid=_dead_pid(), pid_start=None, file=f"{root}/.leases/a/x--1--dead.json")
    leases.write_lease(FS, dead)
    (tmp_path / ".leases" / "a" / "y--2--junk.json").write_text("{not json")  # unreadable, fresh: kept for now
    with JobLeases("train") as job:
        job.take(FS, root, "a")
        with cache_lock(FS, root):
            live = live_holders(FS, root, prune=True)
        jobs = sorted(h.job for h in live["a"])
        assert jobs[0].startswith("train") and "unreadable lease file" in jobs[1]
        assert not os.path.exists(dead.file)
        old = time.time() - leases.STALE_S - 60
        os.utime(tmp_path / ".leases" / "a" / "y--2--junk.json", (old, old))  # unreadable and old: stale
        assert [h.job for h in live_holders(FS, root, prune=True)["a"]] == ["train"]


def test_a_process_that_exits_without_releasing_leaves_no_lease(tmp_path):
    code = ("import pyarrow.fs as f; from pipeline.data.leases import JobLeases; "
            f"JobLeases('train').take(f.LocalFileSystem(), {str(tmp_path)!r}, 'k')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert read_holders(FS, str(tmp_path)) == {}  # released at exit


def test_taking_a_lease_waits_for_the_cache_lock(tmp_path):
    """A deleter holds the lock while it checks leases and deletes: a lease cannot slip in between. The other process
    holds the lock until told to let go, so the wait is seen however slow the machine is."""
    import threading

    root = str(tmp_path)
    code = ("import sys, pyarrow.fs as f; from pipeline.data.leases import cache_lock\n"
            f"with cache_lock(f.LocalFileSystem(), {root!r}):\n"
            "    print('locked', flush=True); sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ConversionError, match=f"pid {proc.pid} on host"):
            with cache_lock(FS, root, timeout_s=0.3):
                pass
        taken = []
        with JobLeases("train") as job:
            taker = threading.Thread(target=lambda: taken.append(job.take(FS, root, "k")), daemon=True)
            taker.start()
            taker.join(1.0)
            assert taker.is_alive() and not taken  # it waits for the other process's lock
            proc.stdin.write("go\n")
            proc.stdin.flush()
            taker.join(60)
            assert [h.key for h in taken] == ["k"] and read_holders(FS, root)["k"]  # taken once the lock was let go
    finally:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
        proc.wait(timeout=30)


# --- eviction and clear -------------------------------------------------------------------------------

def _entry(cache_dir: str, key: str, mb: float, last_used: float) -> None:
    url = cache.entry_url(cache_dir, key)
    cache.mark_entry(url)  # as the converter does, before anything else
    files = [{"name": "part-00000.parquet", "bytes": int(mb * 2 ** 20), "row_groups": [1]}]
    cache.write_manifest(url, {"format": FORMAT_VERSION, "created": last_used, "last_used": last_used,
                               "inputs": {"table": "t", "version": 0},
                               "splits": {"train": {"folder": "r/train", "rows": 1, "files": files}}})


def test_eviction_skips_held_entries_until_released(tmp_path, caplog):
    cache_dir = str(tmp_path / "cache")
    for i, key in enumerate(["old", "mid", "new"]):
        _entry(cache_dir, key, 1.0, 1000.0 + i)
    job = JobLeases("train run-a")
    cache.take_lease(job, cache_dir, "old")  # least recently used, but in use
    assert cache.enforce_bound(cache_dir, 1.5 / 1024, keep="new") == ["mid"]
    assert {e["key"] for e in cache.list_entries(cache_dir)} == {"old", "new"}
    assert "entries in use are kept (old by job 'train run-a'" in caplog.text
    [old] = [e for e in cache.list_entries(cache_dir) if e["key"] == "old"]
    assert old["held_by"][0]["pid"] == os.getpid() and old["held_by"][0]["job"] == "train run-a"
    job.release()
    assert cache.enforce_bound(cache_dir, 1.5 / 1024, keep="new") == ["old"]
    assert not (tmp_path / "cache" / ".leases" / "old").exists()  # its lease folder goes with it


def test_clear_keeps_held_entries_names_the_holder_and_force_deletes(tmp_path):
    cache_dir = str(tmp_path / "cache")
    _entry(cache_dir, "a", 1.0, 1.0)
    _entry(cache_dir, "b", 1.0, 2.0)
    with JobLeases("tune study s") as job:
        cache.take_lease(job, cache_dir, "a")
        out = cache.clear(cache_dir)
        assert out["cleared"] == ["b"]
        assert [k["key"] for k in out["kept"]] == ["a"]
        assert out["kept"][0]["held_by"][0] | {"taken": 0, "renewed": 0} == \
            {"job": "tune study s", "pid": os.getpid(), "host": HOST, "taken": 0, "renewed": 0}
        with pytest.raises(ConversionError, match="'nope'"):
            cache.clear(cache_dir, ["a", "nope"])
        assert [e["key"] for e in cache.list_entries(cache_dir)] == ["a"]  # an unknown key deletes nothing
        assert cache.clear(cache_dir, ["a"], force=True) == {"cleared": ["a"], "kept": []}
    assert cache.list_entries(cache_dir) == []


def test_clear_is_not_blocked_by_a_stale_lease(tmp_path):
    cache_dir = str(tmp_path / "cache")
    _entry(cache_dir, "a", 1.0, 1.0)
    root = cache.filesystem(cache_dir)[1]
    stale = _holder(key="a", pid=_dead_pid(), pid_start=None, file=f"{root}/.leases/a/h--1--x.json")
    leases.write_lease(FS, stale)
    assert cache.list_entries(cache_dir)[0]["held_by"] == []
    assert cache.clear(cache_dir) == {"cleared": ["a"], "kept": []}
    assert not os.path.exists(stale.file)


def test_lease_files_are_not_entries(tmp_path):
    cache_dir = str(tmp_path / "cache")
    with JobLeases("train") as job:
        cache.take_lease(job, cache_dir, "a")  # a conversion in progress: lease, no entry yet
        assert cache.list_entries(cache_dir) == []
        data = json.loads(open(read_holders(FS, cache.filesystem(cache_dir)[1])["a"][0].file).read())
        assert data["pid"] == os.getpid() and data["host"] == HOST and data["job"] == "train"


# --- only what the cache wrote (issue 37, defect 5) ----------------------------------------------------

def _snapshot(folder) -> dict:
    """Every file under `folder` with its bytes (to show it survived byte for byte)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _foreign_folders(root) -> dict:
    """What a shared folder holds beside the cache: a real Delta table, and a plain folder with a checkpoint-like file
    (neither has a manifest, so before the fix both counted as incomplete entries). Returns their snapshots."""
    import deltalake
    import pyarrow as pa

    deltalake.write_deltalake(str(root / "digits_delta"), pa.table({"path": ["a.png", "b.png"], "label": [0, 1]}))
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / "last.ckpt").write_bytes(b"\x80\x02weights" * 100)
    return {name: _snapshot(root / name) for name in ("digits_delta", "checkpoints")}


def test_clear_deletes_only_entries_the_cache_wrote(tmp_path):
    import deltalake

    cache_dir = str(tmp_path / "shared")
    _entry(cache_dir, "a", 1.0, 1.0)
    before = _foreign_folders(tmp_path / "shared")
    assert [e["key"] for e in cache.list_entries(cache_dir)] == ["a"]  # the others are not entries
    assert cache.clear(cache_dir) == {"cleared": ["a"], "kept": []}
    assert {name: _snapshot(tmp_path / "shared" / name) for name in before} == before
    assert not (tmp_path / "shared" / "a").exists()
    for name in before:  # asked for by name: refused, naming the folder, nothing deleted
        with pytest.raises(ConversionError, match=f"{tmp_path}/shared/{name} is not a converted-data cache entry"):
            cache.clear(cache_dir, [name])
    assert {name: _snapshot(tmp_path / "shared" / name) for name in before} == before
    assert deltalake.DeltaTable(str(tmp_path / "shared" / "digits_delta")).to_pyarrow_table().num_rows == 2
    assert cache.enforce_bound(cache_dir, 1e-9, keep="") == []  # nor does the size bound touch them


def test_an_incomplete_entry_is_one_the_cache_marked(tmp_path):
    """A folder the converter marked before writing anything, with no manifest yet: incomplete, deleted by clear unless
    the writing job holds it (its lease is taken before it marks the folder)."""
    cache_dir = str(tmp_path / "cache")
    for key in ("crashed", "writing"):
        url = cache.entry_url(cache_dir, key)
        cache.mark_entry(url)
        os.makedirs(f"{url[len('file://'):]}/run-1/train")
        open(f"{url[len('file://'):]}/run-1/train/.part-00000.parquet.0-abc.tmp", "wb").write(b"half")
    with JobLeases("train writer") as job:
        cache.take_lease(job, cache_dir, "writing")
        assert {(e["key"], e["complete"]) for e in cache.list_entries(cache_dir)} == {("crashed", False),
                                                                                     ("writing", False)}
        out = cache.clear(cache_dir)
        assert out["cleared"] == ["crashed"] and [k["key"] for k in out["kept"]] == ["writing"]
        assert (tmp_path / "cache" / "writing" / "run-1" / "train").is_dir()
    assert cache.clear(cache_dir) == {"cleared": ["writing"], "kept": []}


def test_an_unmarked_entry_is_adopted_when_it_is_used(tmp_path):
    """An entry written before the marker existed (manifest, no marker) is not listed, so never deleted, until a job
    reuses it (a cache hit `touch`es it): then the cache marks it as its own."""
    cache_dir = str(tmp_path / "cache")
    _entry(cache_dir, "old", 1.0, 1.0)
    url = cache.entry_url(cache_dir, "old")
    os.remove(f"{url[len('file://'):]}/{cache.MARKER}")
    assert cache.list_entries(cache_dir) == []
    cache.touch(url, cache.read_manifest(url))
    assert [e["key"] for e in cache.list_entries(cache_dir)] == ["old"]


def test_a_marker_that_does_not_name_the_cache_is_not_one(tmp_path):
    cache_dir = str(tmp_path / "cache")
    _entry(cache_dir, "a", 1.0, 1.0)
    marker = tmp_path / "cache" / "a" / cache.MARKER
    for text in ("", "{", json.dumps({"kind": "something else"})):
        marker.write_text(text)
        assert cache.list_entries(cache_dir) == []
