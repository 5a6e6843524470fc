"""Where checkpoints live and what they are called: the file names, the run's folder, the one resolver of the restore
point, and settling what an interrupted write or swap left beside a checkpoint. No torch: the driver imports it.

A run writes `best.ckpt` (the monitored metric's best epoch) and `last.ckpt` (every epoch, and with
train.checkpoint_every_n_steps every N steps) into its own folder, `<train.checkpoint_dir>/<run_id>`. A checkpoint is
a file or, with FSDP, a folder of per-rank shards (`.metadata`, torch.distributed.checkpoint's index) plus `meta.pt`
(Lightning's non-tensor state). A sharded folder is written into `<name>.lakehouse-staged-<step>-<id>` beside its
name and swapped in (the old folder renamed to `<name>.lakehouse-aside-<id>`, the new one in, the old one removed);
`settle` finishes or undoes a swap a crash interrupted and removes what an interrupted write left, only entries named
exactly so (`<id>`: 8 hex digits); every reader of a checkpoint name in the job's own folder settles it first. A
checkpoint in another run's folder is read as it stands: that run may be writing it (its staged folder is never
removed, nor read, from outside).

A checkpoint file is written to `.tmp-<host>-<pid>-<random>.ckpt` beside its name and renamed into place
(`temporary_prefix`); one a killed writer left is removed when the job settles its own folder
(`remove_stale_temporaries`): its writer's process gone (this host), or untouched for `STALE_TEMPORARY_S`.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import time
import uuid
from typing import Callable, Dict, List, Optional, Tuple

from pipeline.config import Config, ConfigError
from pipeline.log import get_logger

log = get_logger(__name__)

SUFFIX = ".ckpt"
# The stems of the two files a run writes: best.ckpt (Lightning's ModelCheckpoint, top 1 by the monitored metric)
# and last.ckpt (callbacks.LastCheckpoint: each epoch's end, and every train.checkpoint_every_n_steps).
BEST_STEM, LAST_STEM = "best", "last"
LAST = LAST_STEM + SUFFIX  # what a restart resumes from
BEST = BEST_STEM + SUFFIX  # what a run registers
NAMES: Dict[str, str] = {"last": LAST, "best": BEST}  # train.ckpt_restore's run-scoped names
META_FILE = "meta.pt"  # Lightning's file of the non-tensor state inside a sharded checkpoint folder
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded folder's tensors (a pickle)
# The names this project gives what it writes beside a checkpoint <name>: its marker, then an id of 8 hex digits the
# writer drew. Only entries named exactly so are ever settled (renamed or removed): never a user's <name>.old-2024-06-01
STAGED = ".lakehouse-staged-"  # <name>.lakehouse-staged-<step>-<id>: a sharded checkpoint every rank is writing
ASIDE = ".lakehouse-aside-"  # <name>.lakehouse-aside-<id>: the previous folder of <name>, set aside during a swap
_OURS = re.compile(rf"(?:{re.escape(STAGED)}(?P<step>\d+)-|{re.escape(ASIDE)})[0-9a-f]{{8}}")
# A checkpoint file's temporary name (`write_atomically`): `.tmp-<host>-<pid>-<random>.ckpt` (<host>: 8 hex digits of
# the writer's host name, <random>: tempfile's 8 characters); `.tmp-<random>.ckpt` as written before it named its
# writer. Only names of exactly this form are ever removed (`remove_stale_temporaries`).
TEMPORARY = ".tmp-"
_TEMPORARY = re.compile(rf"{re.escape(TEMPORARY)}(?:(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-)?[a-z0-9_]{{8}}"
                        rf"{re.escape(SUFFIX)}")
# a temporary file untouched this long is a dead writer's, whoever wrote it (a live one writes, then renames it)
STALE_TEMPORARY_S = 3600.0
# the folder, inside a job's own checkpoint folder, of its snapshot of the restore point it was given from another
# run's folder (`snapshot`): what every rank of every launch of the job resumes from, whatever that run writes since
RESTORE_POINT = "restore-point"


# ------------------------------------------------------------------------------------------------------- names
def last_checkpoint(checkpoint_dir: str) -> str:
    """The last.ckpt of a checkpoint folder: what a restart resumes from."""
    return os.path.join(checkpoint_dir, LAST)


def is_last(path: str) -> bool:
    """Whether `path` names a folder's last.ckpt."""
    return os.path.basename(os.fspath(path)) == LAST


def run_checkpoint_dir(cfg: Config, run_id: str, root: Optional[str] = None) -> str:
    """The run's own checkpoint folder, `<root>/<run_id>` (root None: `train.checkpoint_dir`; a tune trial's own
    folder under it): jobs sharing a checkpoint_dir never overwrite or reload each other's checkpoints."""
    return os.path.join(os.path.abspath(root or cfg.train.checkpoint_dir), run_id)


def restated_path(path: str, batch_size: int, world_size: int, old_world: int, folder: Optional[str] = None,
                  steps_per_epoch: Optional[int] = None) -> str:
    """Where checkpoint `path` restated for `batch_size` per rank on `world_size` ranks is written: `<stem>-batch<B>`
    (`-np<N>` when the world size changed; `-steps<S>` when only the steps per epoch did, `steps_per_epoch` given)
    `.ckpt`, in `folder` (default: beside `path`)."""
    stem = os.path.splitext(os.path.basename(os.fspath(path).rstrip(os.sep)))[0]
    name = f"{stem}-batch{batch_size}" + ("" if old_world == world_size else f"-np{world_size}")
    if steps_per_epoch is not None:
        name += f"-steps{int(steps_per_epoch)}"
    return os.path.join(folder or os.path.dirname(path), name + SUFFIX)


def snapshot_path(path: str, folder: str) -> str:
    """Where a job keeps its snapshot of another run's checkpoint `path` (`snapshot`): `<folder>/restore-point/<its
    name>`, in the job's own checkpoint folder `folder` (beside none of the names Lightning writes there)."""
    return os.path.join(folder, RESTORE_POINT, os.path.basename(os.path.abspath(os.fspath(path))))


def staged_name(path: str, step: int) -> str:
    """A new staged folder beside sharded checkpoint `path`, for the write of global step `step` (a fresh id)."""
    return f"{path}{STAGED}{int(step)}-{uuid.uuid4().hex[:8]}"


def _host_id() -> str:
    """8 hex digits of this host's name and PID namespace: a pid is judged only where it means the same process
    (containers or pods sharing a host name and the checkpoint folder, not their pids, get other ids: the age rule)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha1(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def temporary_prefix() -> str:
    """The prefix of a checkpoint file's temporary name (tempfile adds 8 random characters and `SUFFIX`): it names
    the writer's host and process, so a leftover is known to be a dead writer's (`remove_stale_temporaries`)."""
    return f"{TEMPORARY}{_host_id()}-{os.getpid()}-"


# ----------------------------------------------------------------------------------------- the restore point
def restore_path(value: Optional[str], checkpoint_dir: str, root: Optional[str] = None,
                 exists: Callable[[str], bool] = os.path.exists) -> Optional[str]:
    """`train.ckpt_restore` (or a job's restore point) as a path, without touching the disk but through `exists`:
    None / '' -> None; `last` / `best` -> that checkpoint in `checkpoint_dir` (the job's own folder);
    `<run_id>/last` / `<run_id>/best` -> that run's folder under `root` (train.checkpoint_dir), when `root` is given
    and no such path exists as typed; anything else -> the path itself."""
    if not value:
        return None
    owner, _, which = value.rpartition("/")
    if value in NAMES:
        return os.path.join(checkpoint_dir, NAMES[value])
    if root is not None and which in NAMES and owner and "/" not in owner and not exists(value):
        return os.path.join(os.path.abspath(root), owner, NAMES[which])
    return value


def is_inside(path: str, folder: str) -> bool:
    """Whether `path` lies in `folder` or a folder under it (the job's own checkpoint folder, its snapshot included)."""
    real = os.path.realpath(os.fspath(folder))
    return os.path.commonpath([os.path.realpath(os.fspath(path)), real]) == real


def is_own(path: str, checkpoint_dir: str) -> bool:
    """Whether checkpoint `path` lies in the job's own folder `checkpoint_dir` (not in another run's)."""
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))  # the folder it is named in (a link to it: too)
    return os.path.realpath(folder) == os.path.realpath(os.fspath(checkpoint_dir))


def resolve_restore_point(value: Optional[str], checkpoint_dir: str, root: Optional[str] = None,
                          required: bool = True) -> Optional[str]:
    """The one resolver of the restore point (the driver's, the launcher's and every rank's): `restore_path`. In the
    job's own folder `checkpoint_dir` it is settled first (a swap a crash interrupted is finished, an interrupted
    write's folder and a dead writer's temporary file removed); anywhere else (another run's folder, which that run
    may be writing right now) nothing is renamed or removed: the checkpoint is taken as it stands. The temporary
    files a killed writer left in the job's own folder are removed either way (`remove_stale_temporaries`).
    `required`: a checkpoint that does not exist is an error; else its path is returned all the same (the ranks then
    refuse it).

    Raises:
        ConfigError: it does not exist (with the runs under `root` that have one), naming the key.
    """
    remove_stale_temporaries(checkpoint_dir)  # what a killed write of this run left, whatever it resumes from
    path = restore_path(value, checkpoint_dir, root)
    if path is None:
        return None
    own = is_own(path, checkpoint_dir)
    if own:
        settle(path)
    if os.path.exists(path) or not required:
        return path
    owner, _, which = value.rpartition("/")
    name = NAMES.get(which or value, LAST)
    hint = mine = ""
    if not own:
        staged, aside = leftovers(path)
        if staged or aside:  # that run is swapping it in now, or a crash cut its swap (its own restart settles it)
            hint = (f"; beside it: {', '.join(os.path.basename(p) for p in aside + staged)} (a save of that run under "
                    f"way, or one a crash cut: only that run settles its folder)")
    if root is not None:
        base = os.path.abspath(root)
        found = sorted((d for d in os.listdir(base) if os.path.exists(os.path.join(base, d, name))),
                       key=lambda d: -os.path.getmtime(os.path.join(base, d, name))) if os.path.isdir(base) else []
        hint += (f"; runs with a {name} under {base} (newest first): {', '.join(found[:5])} (set train.ckpt_restore="
                 f"<run_id>/{name[:-len(SUFFIX)]})") if found else ""
        mine = " (this run's own folder: checkpoints are kept per MLflow run)" if value in NAMES else ""
    raise ConfigError(f"config key 'train.ckpt_restore': checkpoint {path} does not exist{mine}{hint}")


# ------------------------------------------------------------------------------------------------- settling
def fsync_folder(folder: str) -> None:
    """Make the renames in `folder` durable (where the file system lets a folder be opened and synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def is_complete(folder: str) -> bool:
    """A staged folder every rank finished: meta.pt (written by rank 0 after every shard and the index) is there."""
    return os.path.isfile(os.path.join(folder, META_FILE)) and os.path.isfile(os.path.join(folder, DCP_METADATA))


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META_FILE))


def leftovers(path: str) -> Tuple[List[str], List[str]]:
    """(staged folders, folders set aside) of checkpoint `path` that an interrupted write or swap left beside it:
    only entries named as this project names them (`STAGED`, `ASIDE`, each with its writer's 8-hex-digit id)."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        entries = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    staged: List[Tuple[int, str]] = []
    aside: List[str] = []
    for entry in entries:
        ours = _OURS.fullmatch(entry, len(name)) if entry.startswith(name) else None
        if ours is not None and ours.group("step") is not None:
            staged.append((int(ours.group("step")), entry))
        elif ours is not None:
            aside.append(entry)
    return [os.path.join(folder, e) for _, e in sorted(staged)], [os.path.join(folder, e) for e in sorted(aside)]


def _writer_gone(host: Optional[str], pid: Optional[str]) -> bool:
    """Whether the process named by a temporary file's name is known to be gone: one of this host's, not running."""
    if host != _host_id() or pid is None or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False  # running as another user (or not a pid this system can name): kept
    return False


def remove_stale_temporaries(folder: str, stale_s: float = STALE_TEMPORARY_S) -> List[str]:
    """Remove the temporary checkpoint files (`temporary_prefix`) a killed writer left in `folder` (a job's own
    checkpoint folder): one whose writer was a process of this host that is gone, or any untouched for `stale_s`
    seconds (a writer elsewhere, or a name that does not record it). One a live writer may still be writing stays.
    Returns the paths removed."""
    try:
        entries = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    now = time.time()
    for entry in entries:
        match = _TEMPORARY.fullmatch(entry)
        if match is None:
            continue
        tmp = os.path.join(folder, entry)
        try:
            if not os.path.isfile(tmp) or os.path.islink(tmp):
                continue
            age = now - os.path.getmtime(tmp)
        except OSError:
            continue
        if not (_writer_gone(match.group("host"), match.group("pid")) or age >= stale_s):
            continue
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            continue
        log.info("checkpoint folder %s: removed %s, left by a killed write (%s)", folder, entry,
                 "its writer is gone" if age < stale_s else f"untouched for {age:.0f} s")
        removed.append(tmp)
    return removed


def settle(path: str) -> Optional[str]:
    """Leave checkpoint `path` as its last complete write left it, and nothing of this project's writes beside it.
    Only ever in the job's own folder: another run's may be in the middle of a write (`resolve_restore_point`).

    A crash between the two renames of a swap (`swap_in`) left no `path`, the old checkpoint set aside and the new one
    staged and complete: the new one is renamed in (the old one when the staged folder is incomplete). Then every
    staged folder (a write interrupted before its swap: shards of an epoch no checkpoint completed) and every folder
    set aside are removed: only what this project names so (`leftovers`), never another file beside `path`; and the
    temporary files a killed writer left in its folder (`remove_stale_temporaries`). Safe
    when several processes settle the same path at once (each rename is tried once and a rename another process made
    first is taken as done); never while ranks are writing that checkpoint.

    Returns `path` when a checkpoint is there afterwards, else None.
    """
    path = os.path.abspath(os.fspath(path))
    staged, aside = leftovers(path)
    if aside and not os.path.lexists(path):
        complete = [s for s in staged if is_complete(s)]
        source = complete[-1] if complete else max(aside, key=lambda a: os.path.getmtime(a)
                                                   if os.path.lexists(a) else 0.0)
        try:
            os.replace(source, path)
            fsync_folder(os.path.dirname(path))
            log.warning("checkpoint %s: a swap interrupted by a crash finished from %s", path,
                        "the new folder" if complete else "the previous folder")
        except FileNotFoundError:
            pass  # another process settled it first
    for stale in staged + aside:
        if os.path.lexists(stale):
            log.info("checkpoint %s: removing %s, left by an interrupted write", path, os.path.basename(stale))
            _remove(stale)
    remove_stale_temporaries(os.path.dirname(path))
    return path if os.path.lexists(path) else None


def swap_in(staged: str, path: str) -> None:
    """Put the complete folder `staged` in place of checkpoint `path`: the old one renamed aside, the new one renamed
    in, the old one removed. A crash between the renames leaves both, which `settle` resolves to the new one.

    Raises:
        FileNotFoundError: `staged` is not there (removed under its writers), naming it; `path` is left as it was.
    """
    if not os.path.isdir(staged):
        raise FileNotFoundError(errno.ENOENT, f"checkpoint {path} cannot be swapped in: its staged folder is gone "
                                f"(removed while it was written); {path} is left as it was", staged)
    aside = None
    if os.path.lexists(path):
        aside = f"{path}{ASIDE}{uuid.uuid4().hex[:8]}"
        os.replace(path, aside)
    os.replace(staged, path)
    fsync_folder(os.path.dirname(path))
    if aside is not None:
        _remove(aside)


# ------------------------------------------------------------------------------------ a snapshot, and what changed
def identity(path: str) -> Optional[Tuple[int, int, int, int]]:
    """What tells one write of checkpoint `path` from another, whatever any clock says: (device, inode, mtime in ns,
    size) of the file or folder under that name, or None when there is none. Every write of a checkpoint renames a new
    file (or folder) into place, so a write since changes it; the times are the file server's own, compared only with
    each other (never with this machine's clock)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _link_or_copy(name: str, dst: str, src_dir_fd: Optional[int] = None) -> bool:
    """`name` (relative to `src_dir_fd`, or a path) as a new file `dst`: a hard link to the very file the name
    resolves to now, else (another file system, one without hard links, a file of another user) a copy read from one
    open file. Either way a rename over `name` meanwhile leaves what `dst` holds whole. Returns whether it linked."""
    try:
        os.link(name, dst, src_dir_fd=src_dir_fd)
        return True
    except FileNotFoundError:
        raise
    except OSError:
        pass
    fd = os.open(name, os.O_RDONLY, dir_fd=src_dir_fd)
    with os.fdopen(fd, "rb") as src, open(dst, "wb") as out:
        shutil.copyfileobj(src, out, 16 << 20)
        out.flush()
        os.fsync(out.fileno())
    return False


def _snapshot_file(path: str, dst: str) -> bool:
    tmp = os.path.join(os.path.dirname(dst), f"{temporary_prefix()}{uuid.uuid4().hex[:8]}{SUFFIX}")
    try:
        linked = _link_or_copy(path, tmp)
        os.replace(tmp, dst)
    except BaseException:
        _remove(tmp)
        raise
    return linked


def _snapshot_folder(path: str, dst: str, before_swap: Optional[Callable[[str], None]] = None) -> bool:
    """Every file of the one folder `path` names when it is opened, staged beside `dst` and swapped in
    (`before_swap(staged)` first, when given). A swap renaming another folder in meanwhile is never mixed in: the files
    are taken through the opened folder's descriptor, and that folder must still be the one `path` names once they
    are all taken (a folder set aside never comes back, and the one in place is complete and never written again);
    else, or when a file is removed under it (the folder set aside is removed), FileNotFoundError."""
    staged = staged_name(dst, 0)
    os.makedirs(staged)
    linked = True
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            for name in os.listdir(fd):
                linked &= _link_or_copy(name, os.path.join(staged, name), src_dir_fd=fd)
            opened, now = os.fstat(fd), os.stat(path)
        finally:
            os.close(fd)
        if (opened.st_dev, opened.st_ino) != (now.st_dev, now.st_ino) or not is_complete(staged):
            raise FileNotFoundError(errno.ENOENT, f"checkpoint {path} was swapped for a newer save (or removed) while "
                                                  f"its files were read", path)
        if before_swap is not None:
            before_swap(staged)
        fsync_folder(staged)
        swap_in(staged, dst)
    except BaseException:
        _remove(staged)
        raise
    return linked


def linked_copy(path: str, dst: str, before_swap: Optional[Callable[[str], None]] = None) -> bool:
    """`dst`: a copy of checkpoint `path` (a file, or a sharded folder taken through one descriptor), each file
    hard-linked where the file system allows, else copied; put in place whole (a folder: staged beside `dst`,
    `before_swap(staged)` called, then swapped in). Returns whether every file was linked.

    Raises:
        FileNotFoundError: `path`, or a file of it, disappeared while it was taken (a folder: or it lacks meta.pt or
            its index).
    """
    if os.path.lexists(dst) and os.path.isdir(dst) != os.path.isdir(path):
        _remove(dst)  # a copy of another kind (a file where a folder goes, or the reverse)
    if os.path.isdir(path):
        return _snapshot_folder(path, dst, before_swap)
    return _snapshot_file(path, dst)


def snapshot(path: str, folder: str, attempts: int = 5, wait_s: float = 0.2) -> str:
    """A snapshot of checkpoint `path` (a file, or a sharded folder), which another run may be saving right now, in
    the job's own checkpoint folder `folder` (`snapshot_path`): one write of it, whole, that every later read (the
    driver's checks, every rank's, Lightning's load, a relaunch) sees the same whatever that run writes since. Each
    file is hard-linked where the file system allows (writers rename a new file in, never write one in place, so the
    link keeps the bytes it was made with), else copied. A checkpoint removed or swapped while it was taken is taken
    again, up to `attempts` times. `path` itself when it is one of `folder`'s own (named in it, or a snapshot already).
    Returns the snapshot's path.

    Raises:
        FileNotFoundError: `path` kept disappearing (or losing files) while it was taken, naming it.
        OSError: the snapshot cannot be written into `folder`.
    """
    if is_own(path, folder) or is_inside(path, os.path.join(folder, RESTORE_POINT)):
        return path  # (a folder holding runs' folders, a job's without a run: another run's in it is taken too)
    dst = snapshot_path(path, folder)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    settle(dst)  # what an interrupted snapshot of an earlier job of this run left
    for attempt in range(1, attempts + 1):
        try:
            linked = linked_copy(path, dst)
        except FileNotFoundError as exc:
            if attempt == attempts:
                raise FileNotFoundError(errno.ENOENT, f"checkpoint {path} could not be taken whole into {dst}: it "
                                        f"disappeared, or a folder of it lacked {META_FILE} or {DCP_METADATA}, "
                                        f"{attempts} times ({exc})", path) from exc
            time.sleep(wait_s * attempt)  # that run is swapping a save in: the next look finds it whole
            continue
        fsync_folder(os.path.dirname(dst))
        log.info("checkpoint %s taken as it stands (%s) into this job's folder: %s", path,
                 "hard-linked" if linked else "copied", dst)
        return dst
    raise AssertionError("unreachable")


def discard_snapshot(path: str, folder: str) -> None:
    """Remove `path` when it is a snapshot in `folder`'s restore-point folder (`snapshot`), nothing else: a refused
    restore point's copy is not kept in the run's folder."""
    if is_inside(path, os.path.join(folder, RESTORE_POINT)) and os.path.lexists(path):
        _remove(path)
