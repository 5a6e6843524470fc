"""Reading and writing checkpoints: each written whole or not at all, each read without running code.

Writing. A file is written beside its name and renamed into place (`write_atomically`); a sharded (FSDP) folder is
written by every rank into a new folder beside its name and swapped in by rank 0 once every shard and `meta.pt` are on
disk (`write_sharded`; the names and the swap: layout.py).

Reading. A file with `torch.load(weights_only=True)` (tensors and plain values only), a sharded (torch.distributed.
checkpoint) folder's `.metadata` with an unpickler of that format's own record types, and its shard files' non-tensor
items with `weights_only=True`; anything more is refused with `CheckpointError` naming the file.

torch.distributed.checkpoint itself unpickles `.metadata` with plain pickle and every non-tensor item of a shard (an
optimizer's param groups, any value that is not a tensor) with `torch.load(weights_only=False)`: a pickle planted in
either runs when torch's own reader opens the folder. So a folder is only ever read through `plain_shard_reader`, a
storage reader that reads the index with `read_index` and unpickles every non-tensor item itself with
`weights_only=True` whatever planner torch hands it: by `sharded_state` here (one process) and by the FSDP strategy's
resume (pipeline/distributed/fsdp.py, every rank). `check_sharded` checks a whole folder before a job starts from it;
`checkpoint_meta` is every reader's way in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import io
import os
import pickle
import tempfile
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from pipeline.distributed.checkpoints.layout import (DCP_METADATA, META_FILE, SUFFIX, fsync_folder, is_complete,
                                                     is_sharded_checkpoint, settle, staged_name, swap_in,
                                                     temporary_prefix)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: unreadable, unsafe to read, or missing what a restart needs (names the file)."""


def _refused(path: str, what: str, exc: BaseException) -> CheckpointError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(f"checkpoint {path} holds objects other than {what}; refused (reading it could run code "
                           f"stored in the file): {first}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def read_checkpoint(path: str, mmap: bool = False) -> Dict[str, Any]:
    """One checkpoint file with `weights_only=True`; refused (CheckpointError naming it) when it holds more. `mmap`:
    its tensors are mapped from the file, read as they are used (a whole model's checkpoint on every rank).

    Raises:
        CheckpointError: naming the file: it holds more than tensors and plain values, it cannot be read (missing,
            truncated, garbled: whatever torch's reader raised on its bytes), or it holds something other than a
            checkpoint's dict.
    """
    try:
        whole = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise _refused(path, "tensors and plain values", exc) from None
    except Exception as exc:  # garbled bytes fail anywhere in the reader: UnicodeDecodeError, IndexError, ValueError..
        raise CheckpointError(f"checkpoint {path} cannot be read: {_first_line(exc)}") from exc
    if not isinstance(whole, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(whole).__name__}, not a checkpoint (a dict); refused")
    return whole


class _NotAnIndexRecord(pickle.UnpicklingError):
    """A `.metadata` pickle names a class or function that is not one of the format's records (a refusal, not a
    read error)."""


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Admits what torch.distributed.checkpoint writes into `.metadata` (its dataclasses and enums, dtypes, sizes,
    layouts, paths) and nothing else: no function or class that could act when the pickle is read."""

    _PLAIN = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath"), ("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._PLAIN:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint.") and "." not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise _NotAnIndexRecord(f"{module}.{name} is not part of a torch.distributed.checkpoint index")


def read_index(folder: str) -> Any:
    """A sharded folder's `.metadata` (torch.distributed.checkpoint's `Metadata`), read with `_DcpMetadataUnpickler`.

    Raises:
        CheckpointError: it holds anything but the format's own records (refused before anything in it is built), or
            cannot be read (missing, truncated, garbled: what the unpickler raised on its bytes); naming it.
    """
    index = os.path.join(folder, DCP_METADATA)
    try:
        with open(index, "rb") as fh:
            metadata = _DcpMetadataUnpickler(fh).load()
    except _NotAnIndexRecord as exc:
        raise _refused(index, "a sharded checkpoint's index", exc) from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {folder} is incomplete: {index} cannot be read ({exc})") from exc
    except Exception as exc:  # cut short or garbled: EOFError, UnpicklingError (truncated, bad opcode), ValueError..
        raise CheckpointError(f"checkpoint {folder} is incomplete or damaged: its index {index} cannot be read "
                              f"(truncated or garbled): {_first_line(exc)}") from None
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict) or not isinstance(
            getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"checkpoint {index} is not a torch.distributed.checkpoint index")
    return metadata


def _shard_file(folder: str, metadata: Any, storage_index: Any) -> str:
    """The file (inside `folder`, never outside it) that holds one item of the index."""
    info = metadata.storage_data.get(storage_index)
    relative = getattr(info, "relative_path", None)
    if not isinstance(relative, str) or os.path.isabs(relative) or os.pardir in relative.replace("\\", "/").split("/"):
        raise CheckpointError(f"checkpoint {os.path.join(folder, DCP_METADATA)} places item "
                              f"'{getattr(storage_index, 'fqn', storage_index)}' outside its folder ({relative!r})")
    return os.path.join(folder, relative)


def _plain_item(shard: str, fqn: str, value: io.BytesIO) -> Any:
    """One non-tensor item of a shard, unpickled with `weights_only=True`."""
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refused(shard, f"tensors and plain values (item '{fqn}')", exc) from None
    except (EOFError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {shard} cannot be read (item '{fqn}'): {type(exc).__name__}: {exc}") from exc


def _extent(shard: str, fqn: Any, info: Any) -> Tuple[int, int]:
    """(offset, length) of one item in its shard file, as the index places it."""
    try:
        offset, length = int(info.offset), int(info.length)
    except (AttributeError, TypeError, ValueError):
        raise CheckpointError(f"checkpoint {shard}: the index places item '{fqn}' at no readable offset and length "
                              f"({getattr(info, 'offset', None)!r}, {getattr(info, 'length', None)!r})") from None
    if offset < 0 or length < 0:
        raise CheckpointError(f"checkpoint {shard}: the index places item '{fqn}' at offset {offset}, length {length}")
    return offset, length


def check_sharded(folder: str) -> None:
    """Refuse sharded folder `folder` unless its index is plain (`read_index`), every shard file it names is there
    with every item's bytes (at least offset + length of each), and every non-tensor item of its shards is tensors and
    plain values (each read here with `weights_only=True`; torch's reader would unpickle it whole).

    Raises:
        CheckpointError: naming the index, or the shard file and the item (missing, truncated, or more than plain).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_index(folder)
    plain = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    ends: Dict[str, Tuple[int, Any]] = {}  # shard file -> (the end of its last item, that item)
    items = []
    for storage_index, info in metadata.storage_data.items():
        fqn = getattr(storage_index, "fqn", None)
        shard = _shard_file(folder, metadata, storage_index)  # every item's file inside the folder
        offset, length = _extent(shard, fqn, info)
        if offset + length >= ends.get(shard, (-1, None))[0]:
            ends[shard] = (offset + length, fqn)
        items.append((fqn, shard, info, offset, length))
    for shard, (end, fqn) in sorted(ends.items()):
        try:
            size = os.path.getsize(shard)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {folder} is incomplete: shard {shard}, which its index names (item "
                                  f"'{fqn}'), cannot be read ({exc})") from None
        if size < end:
            raise CheckpointError(f"checkpoint {folder} is incomplete: shard {shard} is truncated ({size} bytes; its "
                                  f"index places item '{fqn}' up to byte {end})")
    for fqn, shard, info, offset, length in items:
        if fqn not in plain:
            continue  # a tensor's bytes: torch reads those with weights_only=True itself
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {shard}: item '{fqn}' is stored transformed "
                                  f"({', '.join(map(str, info.transform_descriptors))}), which is not read here")
        try:
            with open(shard, "rb") as fh:
                fh.seek(offset)
                data = fh.read(length)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {folder} is incomplete: {shard} cannot be read ({exc})") from exc
        _plain_item(shard, fqn, io.BytesIO(data))


class _PlainBytes:
    """The load planner torch hands a storage reader, as `plain_shard_reader` passes it on to torch's file reading:
    a non-tensor item is unpickled here with `weights_only=True` (the shard file named when it holds more) and stored
    where `DefaultLoadPlanner.load_bytes` stores it, never handed to that method (which unpickles with
    `weights_only=False`); everything else goes to the planner itself. Every load planner of torch's (the default,
    the empty-state-dict one, the sharded optimizer's) stores its items so; another one is refused."""

    def __init__(self, planner: Any, folder: str, metadata: Any) -> None:
        self._planner, self._folder, self._metadata = planner, folder, metadata

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        shard = _shard_file(self._folder, self._metadata, read_item.storage_index)
        fqn = read_item.dest_index.fqn
        planner = self._planner
        if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
            raise CheckpointError(f"checkpoint {shard}: item '{fqn}' would be stored by {type(planner).__name__}, "
                                  f"a load planner not known to read it with weights_only=True; refused")
        item = _plain_item(shard, fqn, value)
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], item)
        else:
            planner.state_dict[fqn] = item


def plain_shard_reader(folder: str) -> Any:
    """A torch.distributed.checkpoint storage reader of sharded folder `folder` (for `torch.distributed.checkpoint.
    load` and `load_sharded_optimizer_state_dict`, any planner) that reads its index with `read_index`, refuses an
    index placing an item outside the folder, and unpickles every non-tensor item with `weights_only=True`
    (`_PlainBytes`; tensors torch reads with `weights_only=True` itself). A refusal inside torch's load steps comes
    back wrapped in its CheckpointException: `refusals_unwrapped` says it as it was.

    Raises (from the load):
        CheckpointError: naming the index, or the shard file and the item.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class PlainShardReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_index(os.fspath(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            for storage_index in metadata.storage_data:  # every file read is inside the folder
                _shard_file(os.fspath(self.path), metadata, storage_index)
            self._index = metadata
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

        def read_data(self, plan: Any, planner: Any) -> Any:
            return super().read_data(plan, _PlainBytes(planner, os.fspath(self.path), self._index))

    return PlainShardReader(folder)


@contextlib.contextmanager
def refusals_unwrapped(folder: str) -> Iterator[None]:
    """A torch.distributed.checkpoint load of `folder` inside: torch wraps a failure inside its load steps (on any
    rank) in a CheckpointException; a CheckpointError of ours is raised as it was, anything else as a CheckpointError
    naming the folder."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                raise inner from None
        raise CheckpointError(f"checkpoint {folder} cannot be read: {exc}") from None


def sharded_state(folder: str, keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The full state a sharded folder holds (only the top-level `keys` when given), in one process and without a
    process group, read through `plain_shard_reader`: its index by `read_index`, its non-tensor items with
    `weights_only=True` (the file named when one holds more), its tensors as torch reads them (`weights_only=True`).

    Raises:
        CheckpointError: naming the index or the shard file.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class KeysPlanner(_EmptyStateDictLoadPlanner):
        def _should_include_key(self, key: str, metadata: Any) -> bool:  # by the item's top-level key
            where = (metadata.planner_data or {}).get(key) or (key,)
            return self.keys is None or str(where[0]) in self.keys

    state: Dict[str, Any] = {}
    with refusals_unwrapped(folder):
        _load_state_dict(state, storage_reader=plain_shard_reader(folder),
                         planner=KeysPlanner(keys=list(keys) if keys is not None else None), no_dist=True)
    return state


# ------------------------------------------------------------------------------------ writing: whole or not at all
def write_atomically(obj: Dict[str, Any], path: str, part_written: Optional[Callable[[str], None]] = None, *,
                     make_folder: bool = True) -> None:
    """`torch.save(obj)` to a temporary file beside `path`, fsynced, then renamed into place: a crash during the write
    leaves the previous file under `path` intact. `part_written(path)` (a test's fault hook, pipeline/distributed/
    faults.py) is called once the bytes are on disk, before the rename. `make_folder`: `path`'s folder is made when
    missing; False (a staged folder's meta.pt): a missing folder is an error (FileNotFoundError naming it), never
    made again empty."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    if make_folder:
        os.makedirs(folder, exist_ok=True)
    try:  # named after this process (layout.temporary_prefix): a killed write's file is known to be a dead one's
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(), suffix=SUFFIX, dir=folder)
    except FileNotFoundError:
        if make_folder:
            raise
        raise FileNotFoundError(errno.ENOENT, f"checkpoint {path} cannot be written: its folder is gone (removed "
                                              f"while it was written)", folder) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if part_written is not None:
            part_written(path)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_folder(folder)


def _staged_lost(staged: str, final: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"the save of checkpoint {final} failed: its staged folder was removed "
                                          f"while the ranks wrote it; {final} is left as it was", staged)


def write_sharded(strategy: Any, checkpoint: Dict[str, Any], path: Any,
                  part_written: Optional[Callable[[str], None]] = None) -> None:
    """An FSDP checkpoint, whole or not at all, called on every rank (`strategy`: Lightning's FSDP strategy, its
    `broadcast`, `barrier` and `global_rank`): rank 0 settles `path` and makes a new staged folder beside it; every
    rank writes its shard of the weights and optimizer state there (torch.distributed.checkpoint, which also writes
    the index); rank 0 writes `meta.pt` (the rest of `checkpoint`, atomically); after a barrier (every rank done)
    rank 0 swaps the folder in (`layout.swap_in`). A rank that dies on the way leaves `path` as it was; so does a staged
    folder removed under the writers (FileNotFoundError naming it: never made again, never swapped in).

    `part_written(path)` (a test's fault hook, pipeline/distributed/faults.py) is called on each rank once its shard
    is on disk, before the checkpoint is complete."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.api import CheckpointException

    final = os.path.abspath(os.fspath(strategy.broadcast(os.fspath(path))))
    staged = strategy.broadcast(staged_name(final, int(checkpoint.get("global_step", 0))))  # rank 0's id
    if strategy.global_rank == 0:
        settle(final)  # what an earlier interrupted save left goes first
        os.makedirs(staged)
    strategy.barrier("lakehouse-checkpoint-staged")

    class ShardWriter(FileSystemWriter):
        def prepare_local_plan(self, plan):  # torch makes the folder when missing: one removed under us is an error
            if not os.path.isdir(staged):
                raise _staged_lost(staged, final)
            return super().prepare_local_plan(plan)

        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            written.wait()  # this rank's shard is on disk (the index is written after every rank's)
            if part_written is not None:
                part_written(final)
            return written

    state = {"model": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": opt for i, opt in enumerate(checkpoint.pop("optimizer_states", []))})
    try:
        save(state, storage_writer=ShardWriter(staged))
    except CheckpointException as exc:  # torch's wrapping (a BaseException) of a lost staged folder: said as it was
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, FileNotFoundError) and inner.filename == staged:
                raise inner from None
        raise
    if strategy.global_rank == 0:
        try:
            write_atomically(checkpoint, os.path.join(staged, META_FILE), make_folder=False)
        except FileNotFoundError as exc:
            if exc.filename != staged:
                raise
            raise _staged_lost(staged, final) from None
    strategy.barrier("lakehouse-checkpoint-written")  # every shard, the index and meta.pt are on disk
    if strategy.global_rank == 0:
        if not is_complete(staged):  # removed (or emptied) under the writers since: never swapped in
            raise _staged_lost(staged, final)
        swap_in(staged, final)
    strategy.barrier("lakehouse-checkpoint-swapped")


# ---------------------------------------------------------------------------------------------------------- reading
def checkpoint_meta(path: str) -> Dict[str, Any]:
    """The non-tensor part of a checkpoint (global_step, callbacks, lineage, trained_with): a file's whole dict, or a
    sharded checkpoint folder's meta.pt, once its `.metadata` and every non-tensor item of its shards passed
    `check_sharded` (every reader of a folder, Lightning's resume included, comes through here first)."""
    if is_sharded_checkpoint(path):
        check_sharded(path)
        return read_checkpoint(os.path.join(path, META_FILE))
    return read_checkpoint(path)


def consolidated_state(path: str) -> Dict[str, torch.Tensor]:
    """The LightningModule state dict of a checkpoint, in one process and without a process group: a file's
    `state_dict`, or the full state gathered from a sharded folder's shards (read by `sharded_state`, its weights
    only: the optimizer's state stays on disk)."""
    if not is_sharded_checkpoint(path):
        return _state_dict(path, read_checkpoint(path))
    checkpoint_meta(path)  # meta.pt, the index and the shards' non-tensor items pass the same checks first
    state = sharded_state(path, keys=["model"]).get("model")
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds no model state ('model' in its shards); refused")
    return state


def _state_dict(path: str, whole: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """A checkpoint file's `state_dict`, a dict (CheckpointError naming the file and the key when not)."""
    state = whole.get("state_dict")
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds no model state: 'state_dict' is "
                              f"{'missing' if state is None else f'a {type(state).__name__}, not a dict'}; refused")
    return state
