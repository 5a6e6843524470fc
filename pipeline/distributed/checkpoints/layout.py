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
# The stems Lightning's ModelCheckpoint is given (`filename=`): best.ckpt, and the two whose `save_last` writes
# last.ckpt (Lightning names it `last` itself); latest.ckpt and step.ckpt are their top-1 copies.
BEST_STEM, LATEST_STEM, STEP_STEM, LAST_STEM = "best", "latest", "step", "last"
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


def restated_path(path: str, batch_size: int, world_size: int, old_world: int, folder: Optional[str] = None) -> str:
    """Where checkpoint `path` restated for `batch_size` per rank on `world_size` ranks is written: `<stem>-batch<B>`
    (`-np<N>` when the world size changed) `.ckpt`, in `folder` (default: beside `path`)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"{stem}-batch{batch_size}" + ("" if old_world == world_size else f"-np{world_size}")
    return os.path.join(folder or os.path.dirname(path), name + SUFFIX)


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
