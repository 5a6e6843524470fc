"""The converted-data cache: content keys, entry manifests, listing, a size bound (least recently used first) and clearing.

An entry is ``<data.cache_dir>/<key>/`` holding ``lakehouse-cache-entry.json`` (the marker, written before anything
else: `mark_entry`), a conversion's ``run-*/train/`` and ``run-*/val/`` Parquet files and ``manifest.json``, written
last and naming its run: an entry without a manifest is incomplete and is rebuilt. An entry's size is its whole folder
(`entry_bytes`): the run folders of earlier or concurrent conversions the manifest does not name count too, and so does
an incomplete entry's folder (listed with its size, counted against the bound, never evicted by it). Only a
folder carrying the marker is an entry: listing, the size bound and `clear` never touch anything else in
`data.cache_dir` (a shared folder may hold Delta tables and checkpoints). The key is a hash of everything that decides
the files' content, so a later job (or a tuning trial, or another process) on the same pinned table reuses them.

An entry a job reads is leased (`pipeline.data.leases`: who holds it, taken before the job looks at the entry, held
until its training ends): the size bound and `clear` delete only entries nobody live holds, under the cache's lock.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple
from urllib.parse import urlparse

from pipeline.data.leases import JobLeases, cache_lock, drop_key, live_holders, read_holders, stale_reason, this_host
from pipeline.data.shards import FORMAT_VERSION, ConversionError
from pipeline.log import get_logger

log = get_logger(__name__)

MANIFEST = "manifest.json"
MARKER = "lakehouse-cache-entry.json"  # names the folder as an entry of this cache; written before its first byte
MARKER_KIND = "lakehouse converted-data cache entry"


def filesystem(url: str) -> Tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a cache URL or local path."""
    import pyarrow.fs as pafs

    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return pafs.LocalFileSystem(), os.path.abspath(parsed.path if parsed.scheme else url)
    try:
        return pafs.FileSystem.from_uri(url)
    except Exception as exc:
        raise ConversionError(f"config key 'data.cache_dir': cannot open {url} ({type(exc).__name__}: {exc}); use a "
                              f"local path, a shared mount (e.g. file:///dbfs/...) or s3://, hdfs://, gs://") from None


def root_url(cache_dir: str) -> str:
    """`data.cache_dir` as a URL (local paths become absolute file:// URLs); the folder is created."""
    fs, path = filesystem(cache_dir)
    fs.create_dir(path, recursive=True)
    scheme = urlparse(cache_dir).scheme
    return "file://" + path if scheme in ("", "file") else cache_dir.rstrip("/")


def content_key(parts: Dict[str, Any]) -> str:
    """A short stable hash of the inputs that decide an entry's content."""
    blob = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def entry_url(cache_dir: str, key: str) -> str:
    return f"{root_url(cache_dir)}/{key}"


def read_manifest(url: str) -> Optional[Dict[str, Any]]:
    """The entry's manifest, or None when the entry is absent, incomplete or unreadable (then it is rebuilt)."""
    fs, path = filesystem(url)
    try:
        with fs.open_input_stream(f"{path}/{MANIFEST}") as fh:
            return json.loads(fh.read().decode())
    except FileNotFoundError:
        return None
    except Exception as exc:
        log.warning("cache entry %s has an unreadable %s (%s); it will be rebuilt", url, MANIFEST, exc)
        return None


def mark_entry(url: str) -> None:
    """Mark the folder of entry `url` as this cache's own (created if absent), before any of its files is written:
    only a marked folder is ever listed, evicted or cleared. Written through a rename: a half-written marker is never
    seen (and a folder whose marker is unreadable is not an entry, so it is left alone)."""
    fs, path = filesystem(url)
    fs.create_dir(path, recursive=True)
    tmp = f"{path}/.{MARKER}.{os.getpid()}.tmp"
    with fs.open_output_stream(tmp) as fh:
        fh.write(json.dumps({"kind": MARKER_KIND, "key": url.rstrip("/").rsplit("/", 1)[-1],
                             "created": time.time()}, sort_keys=True).encode())
    fs.move(tmp, f"{path}/{MARKER}")


def is_marked(url: str) -> bool:
    """Whether the folder at `url` carries this cache's marker (`mark_entry`)."""
    fs, path = filesystem(url)
    try:
        with fs.open_input_stream(f"{path}/{MARKER}") as fh:
            return json.loads(fh.read().decode()).get("kind") == MARKER_KIND
    except FileNotFoundError:
        return False
    except Exception as exc:
        log.warning("%s/%s is unreadable (%s): the folder is not treated as a cache entry", url, MARKER, exc)
        return False


def write_manifest(url: str, manifest: Dict[str, Any]) -> None:
    """Write the manifest through a temporary file and a rename, so a reader never sees half of it."""
    fs, path = filesystem(url)
    tmp = f"{path}/.{MANIFEST}.{os.getpid()}.tmp"
    with fs.open_output_stream(tmp) as fh:
        fh.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
    fs.move(tmp, f"{path}/{MANIFEST}")


def touch(url: str, manifest: Dict[str, Any]) -> None:
    """Record a use of the entry (the size bound evicts the least recently used first). An entry written before the
    marker existed is marked now: a cache hit (its content key, its format) shows the cache wrote it."""
    manifest["last_used"] = time.time()
    try:
        if not is_marked(url):
            mark_entry(url)
        write_manifest(url, manifest)
    except OSError as exc:  # a read-only cache still serves
        log.warning("could not record the use of cache entry %s: %s", url, exc)


def remove_entry(url: str) -> None:
    if not url:
        return
    fs, path = filesystem(url)
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not delete cache entry %s: %s", url, exc)


def entry_bytes(url: str, manifest: Dict[str, Any]) -> int:
    """What entry `url` takes on storage: the files its manifest lists (at the sizes written) and every other file in
    its folder, the marker, the manifest and above all a `run-*` folder the manifest does not name (a conversion that
    failed midway and was retried leaves the finished part files of the first run; of two jobs converting the entry at
    once the last manifest wins, and the other run stays). An incomplete entry (no manifest: `manifest` is {}) is the
    files in its folder.

    Such a folder is counted (against `data.cache_max_gb`, in `lakehouse cache ls`), never deleted but with its entry:
    a run folder no manifest names may be another job's conversion still writing, and nothing tells it from a
    leftover (a converting job's lease is the same as a reader's, and a job without leases takes none).
    """
    import pyarrow.fs as pafs

    listed = {f"{s.get('folder', '')}/{f['name']}": int(f["bytes"])
              for s in manifest.get("splits", {}).values() for f in s.get("files", [])}
    fs, path = filesystem(url)
    path = path.rstrip("/")
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    except OSError as exc:
        log.warning("could not list cache entry %s (%s): counting only the files its manifest lists", url, exc)
        infos = []
    unlisted = sum(info.size or 0 for info in infos
                   if info.type == pafs.FileType.File and info.path[len(path) + 1:] not in listed)
    return sum(listed.values()) + unlisted


def _live(fs, root: str) -> Dict[str, List[Any]]:
    """The live leases by key, without deleting the stale ones (a listing changes nothing)."""
    host, boot_id = this_host()
    now = time.time()
    return {key: live for key, holders in read_holders(fs, root).items()
            if (live := [h for h in holders if stale_reason(h, now, host, boot_id) is None])}


def list_entries(cache_dir: str, holders: Optional[Dict[str, List[Any]]] = None,
                 others: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Every entry under `data.cache_dir` (a folder carrying the cache's marker: complete with a manifest, incomplete
    without), most recently used first, with its size, what it was made from and the jobs holding it now (`held_by`:
    job, pid, host). The names of the other folders there, which are not the cache's, are appended to `others`."""
    import pyarrow.fs as pafs

    fs, path = filesystem(cache_dir)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    base = root_url(cache_dir)
    holders = _live(fs, path) if holders is None else holders
    out = []
    for info in infos:
        if info.type != pafs.FileType.Directory or info.base_name.startswith("."):  # .leases
            continue
        url = f"{base}/{info.base_name}"
        if not is_marked(url):  # not written by this cache (a Delta table, checkpoints, ...): never listed
            if others is not None:
                others.append(info.base_name)
            continue
        held_by = [h.public() for h in holders.get(info.base_name, [])]
        manifest = read_manifest(url)
        if manifest is None:  # a conversion under way, or one that died: its folder's files count all the same
            out.append({"key": info.base_name, "url": url, "complete": False, "bytes": entry_bytes(url, {}),
                        "last_used": None, "held_by": held_by})
            continue
        inputs = manifest.get("inputs", {})
        out.append({"key": info.base_name, "url": url, "complete": True, "bytes": entry_bytes(url, manifest),
                    "last_used": manifest.get("last_used"), "created": manifest.get("created"),
                    "table": inputs.get("table"), "version": inputs.get("version"),
                    "world_size": inputs.get("world_size"), "image_size": inputs.get("image_size"),
                    "rows": {k: s.get("rows") for k, s in manifest.get("splits", {}).items()}, "held_by": held_by})
    out.sort(key=lambda e: e.get("last_used") or 0, reverse=True)
    return out


def take_lease(leases: JobLeases, cache_dir: str, key: str) -> None:
    """Hold entry `key` for the job owning `leases`, before the job looks at it (see `pipeline.data.leases`)."""
    root_url(cache_dir)  # the folder exists
    fs, path = filesystem(cache_dir)
    leases.take(fs, path, key)


def clear(cache_dir: str, keys: Optional[Iterable[str]] = None, force: bool = False) -> Dict[str, Any]:
    """Delete the given entries (all when None), except those a live job holds unless `force`. Only folders carrying
    the cache's marker are entries: anything else under `data.cache_dir` is left alone.

    Returns {"cleared": [keys], "kept": [{"key", "held_by": [{job, pid, host, taken, renewed}]}]}.

    Raises:
        ConversionError: a key in `keys` is not in the cache, or names a folder the cache did not write.
    """
    wanted = set(keys) if keys is not None else None
    done: List[str] = []
    kept: List[Dict[str, Any]] = []
    root_url(cache_dir)
    fs, path = filesystem(cache_dir)
    with cache_lock(fs, path):
        holders = live_holders(fs, path, prune=True)
        others: List[str] = []
        entries = list_entries(cache_dir, holders, others)
        missing = sorted((wanted or set()) - {e["key"] for e in entries})
        foreign = [k for k in missing if k in others]
        if foreign:
            raise ConversionError(f"{path}/{foreign[0]} is not a converted-data cache entry (it carries no valid "
                                  f"{MARKER}, which the cache writes before anything else): `lakehouse cache clear` "
                                  f"leaves it alone; nothing was deleted")
        if missing:
            raise ConversionError(f"no cache entry {missing[0]!r} under data.cache_dir={cache_dir}")
        if others and wanted is None:
            log.info("left alone under data.cache_dir=%s, not written by the cache: %s", cache_dir,
                     ", ".join(sorted(others)))
        for entry in entries:
            if wanted is not None and entry["key"] not in wanted:
                continue
            held = holders.get(entry["key"], [])
            who = "; ".join(h.describe() for h in held)
            if held and not force:
                log.warning("kept cache entry %s: in use by %s (`lakehouse cache clear --force` deletes it anyway)",
                            entry["key"], who)
                kept.append({"key": entry["key"], "held_by": [h.public() for h in held]})
                continue
            if held:
                log.warning("--force: deleting cache entry %s while %s holds it", entry["key"], who)
            remove_entry(entry["url"])
            if not held:
                drop_key(fs, path, entry["key"])
            done.append(entry["key"])
    return {"cleared": done, "kept": kept}


def enforce_bound(cache_dir: str, max_gb: float, keep: str) -> List[str]:
    """Evict least recently used complete entries until the cache holds at most `max_gb`; never `keep`, never an entry
    a live job holds (the cache then stays above the bound, logged with the holders). Incomplete entries count towards
    the bound but are never evicted by it: one may be another job's conversion still writing (a job without leases
    holds none); `lakehouse cache clear` deletes them."""
    if max_gb <= 0:
        return []
    fs, path = filesystem(cache_dir)
    evicted: List[str] = []
    with cache_lock(fs, path):
        holders = live_holders(fs, path, prune=True)
        entries = list_entries(cache_dir, holders)
        total = sum(e["bytes"] for e in entries)
        incomplete = [e for e in entries if not e["complete"]]
        in_use = []
        for entry in reversed([e for e in entries if e["complete"]]):  # least recently used first
            if total <= max_gb * 2 ** 30:
                break
            if entry["key"] == keep:
                continue
            if entry["key"] in holders:
                in_use.append(entry["key"])
                continue
            remove_entry(entry["url"])
            drop_key(fs, path, entry["key"])
            total -= entry["bytes"]
            evicted.append(entry["key"])
            log.info("evicted cache entry %s (%.1f MB, data.cache_max_gb=%g)", entry["key"],
                     entry["bytes"] / 2 ** 20, max_gb)
        if total > max_gb * 2 ** 30 and in_use:
            log.warning("the converted-data cache holds %.2f GB, above data.cache_max_gb=%g: entries in use are kept "
                        "(%s)", total / 2 ** 30, max_gb,
                        "; ".join(f"{k} by {', '.join(h.describe() for h in holders[k])}" for k in in_use))
        if total > max_gb * 2 ** 30 and incomplete:
            log.warning("the converted-data cache holds %.2f GB, above data.cache_max_gb=%g, with %d incomplete "
                        "entr%s (no %s: a conversion still writing, or one that died), never evicted by the bound: "
                        "%s; `lakehouse cache clear --key K` deletes one no job is writing", total / 2 ** 30, max_gb,
                        len(incomplete), "y" if len(incomplete) == 1 else "ies", MANIFEST,
                        ", ".join(f"{e['key']} ({e['bytes'] / 2 ** 20:.1f} MB)" for e in incomplete))
    return evicted
