"""Reading checkpoint bytes without running code: a file with `torch.load(weights_only=True)`, a sharded (torch.
distributed.checkpoint) folder's `.metadata` with an unpickler of that format's own record types, and its shard
files' non-tensor items with `weights_only=True`; anything more is refused with `CheckpointError` naming the file.

torch.distributed.checkpoint itself unpickles `.metadata` with plain pickle and every non-tensor item of a shard (an
optimizer's param groups, any value that is not a tensor) with `torch.load(weights_only=False)`: a pickle planted in
either runs when torch's own reader opens the folder. So a folder is read here (`sharded_state`) with a reader and a
planner of our own, and checked (`check_sharded`) before anything hands it to Lightning.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from typing import Any, Dict, Optional, Sequence

import torch

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded folder's tensors (a pickle)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: unreadable, unsafe to read, or missing what a restart needs (names the file)."""


def _refused(path: str, what: str, exc: BaseException) -> CheckpointError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(f"checkpoint {path} holds objects other than {what}; refused (reading it could run code "
                           f"stored in the file): {first}")


def read_checkpoint(path: str) -> Dict[str, Any]:
    """One checkpoint file with `weights_only=True`; refused (CheckpointError naming it) when it holds more."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refused(path, "tensors and plain values", exc) from None
    except (OSError, EOFError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {type(exc).__name__}: {exc}") from exc


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
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a torch.distributed.checkpoint index")


def read_index(folder: str) -> Any:
    """A sharded folder's `.metadata` (torch.distributed.checkpoint's `Metadata`), read with `_DcpMetadataUnpickler`.

    Raises:
        CheckpointError: it holds anything but the format's own records, or cannot be read; naming it.
    """
    index = os.path.join(folder, DCP_METADATA)
    try:
        with open(index, "rb") as fh:
            metadata = _DcpMetadataUnpickler(fh).load()
    except pickle.UnpicklingError as exc:
        raise _refused(index, "a sharded checkpoint's index", exc) from None
    except (OSError, EOFError) as exc:
        raise CheckpointError(f"checkpoint {folder} is incomplete: {index} cannot be read ({exc})") from exc
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


def check_sharded(folder: str) -> None:
    """Refuse sharded folder `folder` unless its index is plain (`read_index`) and every non-tensor item of its shards
    is tensors and plain values (each read here with `weights_only=True`; torch's reader would unpickle it whole).

    Raises:
        CheckpointError: naming the index, or the shard file and the item.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_index(folder)
    plain = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    for storage_index, info in metadata.storage_data.items():
        fqn = getattr(storage_index, "fqn", None)
        shard = _shard_file(folder, metadata, storage_index)  # every item's file inside the folder
        if fqn not in plain:
            continue  # a tensor's bytes: torch reads those with weights_only=True itself
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {shard}: item '{fqn}' is stored transformed "
                                  f"({', '.join(info.transform_descriptors)}), which is not read here")
        try:
            with open(shard, "rb") as fh:
                fh.seek(int(info.offset))
                data = fh.read(int(info.length))
        except OSError as exc:
            raise CheckpointError(f"checkpoint {folder} is incomplete: {shard} cannot be read ({exc})") from exc
        _plain_item(shard, fqn, io.BytesIO(data))


def sharded_state(folder: str, keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The full state a sharded folder holds (only the top-level `keys` when given), in one process and without a
    process group: its index read by `read_index`, its non-tensor items with `weights_only=True` (the file named when
    one holds more), its tensors as torch reads them (`weights_only=True`).

    Raises:
        CheckpointError: naming the index or the shard file.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint._traverse import set_element

    class PlainIndexReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_index(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class PlainItemsPlanner(_EmptyStateDictLoadPlanner):
        def _should_include_key(self, key: str, metadata: Any) -> bool:  # by the item's top-level key
            where = (metadata.planner_data or {}).get(key) or (key,)
            return self.keys is None or str(where[0]) in self.keys

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            item = _plain_item(_shard_file(folder, self.metadata, read_item.storage_index), fqn, value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], item)
            else:
                self.state_dict[fqn] = item

    state: Dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=PlainIndexReader(folder),
                         planner=PlainItemsPlanner(keys=list(keys) if keys is not None else None), no_dist=True)
    except CheckpointException as exc:  # torch hands a failure inside its steps on wrapped: ours is said as it was
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                raise inner from None
        raise CheckpointError(f"checkpoint {folder} cannot be read: {exc}") from None
    return state
