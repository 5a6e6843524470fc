"""Leases on converted-data cache entries: which jobs read an entry now (job, pid, host), so eviction and clear keep it.

Files in the cache folder, no server, so the cache may sit on storage several hosts share:

    <root>/.lock                                     the cache's lock: held while a lease is taken, and while a
                                                     deleter (eviction, `cache clear`) checks the leases and deletes
    <root>/.leases/<key>/<host>--<pid>--<id>.json    one file per holder of entry <key> (written to a temporary file
                                                     and renamed, so a reader never sees half of one)

A job's driver takes the lease before it looks at the entry (`JobLeases.take`, under the lock): a deleter holding the
lock either sees the lease, or has finished deleting before the job reads the manifest (and the job converts again).
The driver holds it until training ends (the ranks read the entry meanwhile) and rewrites it every `RENEW_S` seconds.

A holder that is gone does not block forever (`stale_reason`, one rule per case):
  - on this host (same host name and boot) and in this process's PID namespace: the lease is live while its pid runs
    and started when the lease says (a reused pid is not the holder);
  - on another host, whose pids cannot be checked from here: the lease is live while it was renewed in the last
    `STALE_S` seconds (15 min: 15 missed renewals, and much more than the clock skew between hosts under NTP);
  - on this host but in another PID namespace (containers or Kubernetes pods sharing the host's network and boot id,
    each with pids of its own), or one that cannot be compared because ours is unknown: its pid means nothing here
    (gone, or another process's), so the lease is judged as another host's, by its renewals;
  - a lease without a namespace (written before leases recorded it, or where /proc/self/ns/pid cannot be read) keeps
    the older rule: judged by its pid on this host. A dead holder's lease then goes at once, as it did; the cost is
    that such a lease from another namespace is still misjudged, until every job on the host records its namespace;
  - an unreadable lease file counts as another host's lease renewed at the file's modification time.
A stale lease is deleted by the deleter that finds it, under the lock.

The lock is `fcntl.flock` on `<root>/.lock` for a local or mounted path (on NFS, Linux carries it to the server as a
POSIX lock, so it holds across hosts), plus a lock inside the process. An object store (s3://, gs://, hdfs://) has no
such lock: leases are still taken and honoured, but the short window between a deleter's look at the leases and its
delete is not closed there (a job that loses it fails verifying the entry's files, naming the file).
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from pipeline.data.shards import ConversionError
from pipeline.log import get_logger

log = get_logger(__name__)

LEASES = ".leases"
LOCK = ".lock"
RENEW_S = 60.0  # a holder rewrites its lease this often
STALE_S = 900.0  # another host's lease not renewed for this long is stale
LOCK_TIMEOUT_S = 300.0  # waiting longer than this for the cache's lock is an error naming its holder


@dataclass
class Holder:
    """One lease: who holds entry `key`, since when, last renewed when; `file` is the lease file's path."""

    key: str
    job: str
    pid: int
    host: str
    boot_id: Optional[str] = None
    pid_start: Optional[int] = None  # the process's start time (clock ticks after boot, /proc/<pid>/stat)
    pid_ns: Optional[str] = None  # the process's PID namespace ("pid:[4026531836]"); None: unknown, or an old lease
    taken: float = 0.0
    renewed: float = 0.0
    file: str = ""

    def public(self) -> Dict[str, Any]:
        """What `cache ls` / `cache clear` print about the holder."""
        return {"job": self.job, "pid": self.pid, "host": self.host, "taken": self.taken, "renewed": self.renewed}

    def describe(self, now: Optional[float] = None) -> str:
        ago = (now if now is not None else time.time()) - self.renewed
        return (f"job {self.job!r} (pid {self.pid} on host {self.host}, lease taken "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.taken))}, renewed {ago:.0f} s ago)")


def _read_first_line(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.readline().strip() or None
    except OSError:
        return None


def this_host() -> Tuple[str, Optional[str]]:
    """(host name, boot id): a lease from another boot of this host is from a process that is gone."""
    return socket.gethostname(), _read_first_line("/proc/sys/kernel/random/boot_id")


def this_pid_ns() -> Optional[str]:
    """This process's PID namespace as /proc names it ("pid:[4026531836]"), None where it cannot be read (no /proc).

    Processes on one host and boot in different namespaces (containers, pods with `hostNetwork: true`) share the host
    name and boot id, not pids: a pid is checked from here only when its lease names this namespace. Read on every
    call, not cached: a child forked after `unshare(CLONE_NEWPID)` is in another namespace than its parent."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start(pid: int) -> Optional[int]:
    """The start time of process `pid` (clock ticks after boot), None where /proc cannot tell."""
    line = _read_first_line(f"/proc/{pid}/stat")
    if not line or ")" not in line:
        return None
    fields = line.rsplit(")", 1)[1].split()
    try:
        return int(fields[19])  # field 22 of stat; the text after the command name starts at field 3
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start: Optional[int]) -> bool:
    """Whether process `pid` of this host runs and is the one that started at `start` (when both are known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    now_start = process_start(pid)
    return start is None or now_start is None or now_start == start


_OURS: Any = object()  # stale_reason's default namespace: this process's, read when called


def stale_reason(holder: Holder, now: float, host: str, boot_id: Optional[str],
                 alive: Callable[[int, Optional[int]], bool] = pid_alive, pid_ns: Any = _OURS) -> Optional[str]:
    """Why the lease's holder is gone, or None while it is live (the rules in the module's docstring).

    `pid_ns` is this process's PID namespace (`this_pid_ns()` when not given; None: unknown)."""
    if holder.host == host:
        if holder.boot_id and boot_id and holder.boot_id != boot_id:
            return f"host {host} has restarted since pid {holder.pid} took the lease"
        ours = this_pid_ns() if pid_ns is _OURS else pid_ns
        if holder.pid_ns is None or (ours is not None and holder.pid_ns == ours):
            if not alive(holder.pid, holder.pid_start):
                return f"pid {holder.pid} no longer runs on host {host}"
            return None
        age = now - holder.renewed  # another PID namespace (or ours unknown): its pid cannot be checked from here
        if age > STALE_S:
            return (f"pid {holder.pid} of PID namespace {holder.pid_ns} on host {host} (ours: {ours or 'unknown'}) "
                    f"has not renewed it for {age:.0f} s (> {STALE_S:.0f} s)")
        return None
    age = now - holder.renewed
    if age > STALE_S:
        return f"host {holder.host} has not renewed it for {age:.0f} s (> {STALE_S:.0f} s)"
    return None


_process_lock = threading.Lock()  # flock conflicts between descriptors; this also orders this process's threads


@contextmanager
def cache_lock(fs, root: str, timeout_s: Optional[float] = None) -> Iterator[None]:
    """The cache's lock (see the module's docstring); waits at most `timeout_s` (LOCK_TIMEOUT_S).

    Raises:
        ConversionError: the lock was not free in time, naming the lock file and the process that took it.
    """
    import pyarrow.fs as pafs

    timeout_s = LOCK_TIMEOUT_S if timeout_s is None else timeout_s
    if not _process_lock.acquire(timeout=timeout_s):
        raise ConversionError(f"cache lock {root}/{LOCK}: still held inside this process after {timeout_s:.0f} s")
    try:
        if not isinstance(fs, pafs.LocalFileSystem):
            yield
            return
        import fcntl

        path = os.path.join(root, LOCK)
        os.makedirs(root, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        who = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                        raise ConversionError(f"cache lock {path}: not free after {timeout_s:.0f} s (taken by "
                                              f"{who}); is a `lakehouse` job on it hung?") from None
                    time.sleep(0.05)
            host, _ = this_host()
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {host}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock
    finally:
        _process_lock.release()


def _key_dir(root: str, key: str) -> str:
    return f"{root}/{LEASES}/{key}"


def write_lease(fs, holder: Holder) -> bool:
    """Write (or rewrite) the holder's lease file through a rename; True if the file was there before."""
    folder = holder.file.rsplit("/", 1)[0]
    existed = fs.get_file_info(holder.file).size is not None
    fs.create_dir(folder, recursive=True)
    tmp = f"{folder}/.{holder.file.rsplit('/', 1)[1]}.tmp"
    with fs.open_output_stream(tmp) as fh:
        fh.write(json.dumps({k: v for k, v in asdict(holder).items() if k != "file"}, sort_keys=True).encode())
    fs.move(tmp, holder.file)
    return existed


def read_holders(fs, root: str) -> Dict[str, List[Holder]]:
    """Every lease file under the cache, live or not, by entry key."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/{LEASES}", recursive=True, allow_not_found=True))
    except OSError as exc:
        log.warning("could not list the cache's leases under %s/%s: %s", root, LEASES, exc)
        return {}
    out: Dict[str, List[Holder]] = {}
    for info in infos:
        if info.type != pafs.FileType.File or info.base_name.startswith(".") or not info.base_name.endswith(".json"):
            continue
        key = info.path.rsplit("/", 2)[-2]
        try:
            with fs.open_input_stream(info.path) as fh:
                data = json.loads(fh.read().decode())
            holder = Holder(**{k: data[k] for k in Holder.__dataclass_fields__ if k in data and k != "file"},
                            file=info.path)
            holder.key = key
        except FileNotFoundError:  # released meanwhile
            continue
        except Exception as exc:
            mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
            holder = Holder(key=key, job=f"unreadable lease file {info.path} ({type(exc).__name__})", pid=-1,
                            host="?", taken=mtime, renewed=mtime, file=info.path)
        out.setdefault(key, []).append(holder)
    return out


def live_holders(fs, root: str, prune: bool = False, now: Optional[float] = None) -> Dict[str, List[Holder]]:
    """The live leases by entry key; with `prune` (under the cache's lock) stale lease files are deleted, logged."""
    now = time.time() if now is None else now
    host, boot_id = this_host()
    pid_ns = this_pid_ns()
    live: Dict[str, List[Holder]] = {}
    for key, holders in read_holders(fs, root).items():
        for h in holders:
            reason = stale_reason(h, now, host, boot_id, pid_ns=pid_ns)
            if reason is None:
                live.setdefault(key, []).append(h)
            elif prune:
                log.info("cache entry %s: dropping the stale lease of %s: %s", key, h.describe(now), reason)
                try:
                    fs.delete_file(h.file)
                except (FileNotFoundError, OSError):
                    pass
    return live


def drop_key(fs, root: str, key: str) -> None:
    """Delete entry `key`'s lease folder (after the entry itself; under the cache's lock)."""
    try:
        fs.delete_dir(_key_dir(root, key))
    except (FileNotFoundError, OSError):
        pass


_open_sets: "weakref.WeakSet[JobLeases]" = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    for leases in list(_open_sets):
        leases.release()


class JobLeases:
    """The leases one job's driver holds: taken as it chooses an entry (`take`), rewritten every `RENEW_S` seconds in
    the background, released when the job ends (`with`, `release`, or at the process's exit; a killed process's
    leases are stale by the rules above). Never crosses into the ranks."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._held: Dict[str, Tuple[Any, Holder]] = {}  # lease file -> (filesystem, holder)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "JobLeases":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    @property
    def keys(self) -> List[str]:
        return sorted({h.key for _, h in self._held.values()})

    def take(self, fs, root: str, key: str) -> Holder:
        """Hold entry `key` of the cache at `root` (once per key); the lease file is written under the cache's lock."""
        with self._lock:
            for _, h in self._held.values():
                if h.key == key and h.file.startswith(f"{root}/"):
                    return h
        host, boot_id = this_host()
        pid = os.getpid()
        now = time.time()
        safe_host = "".join(c if c.isalnum() or c in "-_." else "_" for c in host)
        holder = Holder(key=key, job=self.job, pid=pid, host=host, boot_id=boot_id, pid_start=process_start(pid),
                        pid_ns=this_pid_ns(), taken=now, renewed=now,
                        file=f"{_key_dir(root, key)}/{safe_host}--{pid}--{uuid.uuid4().hex[:8]}.json")
        with cache_lock(fs, root):
            write_lease(fs, holder)
        with self._lock:
            self._held[holder.file] = (fs, holder)
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._beat, name="cache-leases", daemon=True)
                self._thread.start()
        _open_sets.add(self)
        log.info("holding cache entry %s for job %r (lease %s)", key, self.job, holder.file)
        return holder

    def renew(self) -> None:
        """Rewrite every held lease with the time now; a lease another job dropped as stale is written again."""
        with self._lock:  # `release` waits: a lease it deleted is never written again
            for fs, h in self._held.values():
                h.renewed = time.time()
                try:
                    if not write_lease(fs, h):
                        log.warning("the lease on cache entry %s had been dropped as stale (was this job paused for "
                                    "more than %.0f s?); taken again, but the entry may have been deleted", h.key,
                                    STALE_S)
                except Exception as exc:
                    log.warning("could not renew the lease on cache entry %s (%s): %s", h.key, h.file, exc)

    def _beat(self) -> None:
        while not self._stop.wait(RENEW_S):
            self.renew()

    def release(self) -> None:
        """Stop renewing and delete every lease file this job holds (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for fs, h in held:
            try:
                fs.delete_file(h.file)
            except FileNotFoundError:
                pass
            except Exception as exc:  # it goes stale by itself: this pid is about to end, or the job moves on
                log.warning("could not release the lease on cache entry %s (%s): %s", h.key, h.file, exc)
            else:
                log.info("released cache entry %s (job %r)", h.key, self.job)
        _open_sets.discard(self)
