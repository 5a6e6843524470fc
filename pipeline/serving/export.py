"""Export a registered model version's network to ONNX or TorchScript with its preprocessing contract, checked and logged to its run."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch

from pipeline.log import get_logger
from pipeline.serving.contract import CONTRACT_FILE, INPUT_NAME, OUTPUT_NAME, preprocessing_contract
from pipeline.serving.models import load_network, resolve
from pipeline.tracking.runs import configure

log = get_logger(__name__)

FORMATS = ("onnx", "torchscript")
FILES = {"onnx": "model.onnx", "torchscript": "model.pt"}
# An ONNX model is one protobuf message, which cannot pass 2 GiB: a larger one keeps its weights in this one file
# beside model.onnx (ONNX external data; onnxruntime reads it from beside the model). Models over ONNX_INLINE_LIMIT
# bytes (2 GiB less room for the graph and the contract) are written so.
ONNX_DATA_FILE = "model.onnx.data"
ONNX_INLINE_LIMIT = 2 ** 31 - 2 ** 26
# The legacy (TorchScript-based) ONNX exporter: it needs only torch and writes opset 17, which
# onnxruntime runs. torch 2.13's default (dynamo=True) needs onnxscript, another dependency for
# no gain on these plain conv nets.
ONNX_OPSET = 17
PARITY_TOL = 1e-4
EXPORT_ARTIFACT_DIR = "export"
# Exports into one --out move their files in one at a time under this lock file in --out (created exclusively, gone
# once they are moved): two exports at once leave --out holding every file of one of them, never a mix. A move takes
# milliseconds; an export waits at most LOCK_WAIT_S for another's, then fails naming the lock and its holder.
LOCK_FILE = ".export.lock"
LOCK_WAIT_S = 60.0


class ExportError(RuntimeError):
    """The export cannot be written or does not reproduce the network; the message names the model and format."""


class _WithSoftmax(torch.nn.Module):
    """The exported graph: normalised pixels (N, C, H, W) -> class probabilities (N, K)."""

    def __init__(self, network: torch.nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.network(pixels), dim=1)


def _probe(meta: Dict[str, Any], n: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.rand((n, meta["channels"], meta["image_size"], meta["image_size"]), generator=gen) * 2 - 1


def export_onnx(module: torch.nn.Module, meta: Dict[str, Any], contract: Dict[str, Any], path: Path) -> None:
    """Write `module` as ONNX (dynamic batch) with the contract in the model's metadata_props; a model over
    ONNX_INLINE_LIMIT bytes keeps its weights in ONNX_DATA_FILE beside `path`."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    with tempfile.TemporaryDirectory(prefix="onnx-", dir=path.parent) as raw_dir:
        # torch writes a model over 2 GB as model.onnx plus a file per weight beside it: kept apart, then dropped
        raw = Path(raw_dir) / path.name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter announces itself
            torch.onnx.export(module, (_probe(meta, 2),), str(raw), dynamo=False, opset_version=ONNX_OPSET,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
        size = sum(f.stat().st_size for f in Path(raw_dir).iterdir() if f.is_file())
        model = onnx.load(str(raw), load_external_data=False)
        entry = model.metadata_props.add()
        entry.key, entry.value = "preprocessing_contract", json.dumps(contract, sort_keys=True)
        external = any(uses_external_data(t) for t in model.graph.initializer)
        if size > ONNX_INLINE_LIMIT or external:
            if external:
                load_external_data_for_model(model, raw_dir)
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=ONNX_DATA_FILE)
            os.chmod(path.parent / ONNX_DATA_FILE, path.stat().st_mode & 0o777)  # onnx creates it owner-only
        else:
            onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))  # by path: a model with external data is checked without loading it


def export_torchscript(module: torch.nn.Module, meta: Dict[str, Any], contract: Dict[str, Any], path: Path) -> None:
    """Write `module` traced to TorchScript with the contract inside (`_extra_files` contract.json)."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(module, (_probe(meta, 2),), check_inputs=[(_probe(meta, 3),)])
        traced = torch.jit.freeze(traced.eval())
    torch.jit.save(traced, str(path), _extra_files={CONTRACT_FILE: json.dumps(contract, sort_keys=True)})


def run_exported(fmt: str, path: Path, pixels: np.ndarray) -> np.ndarray:
    """Run an exported file on normalised pixels (N, C, H, W) -> probabilities, with its own runtime."""
    pixels = np.ascontiguousarray(pixels, dtype=np.float32)
    if fmt == "onnx":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        return session.run([OUTPUT_NAME], {INPUT_NAME: pixels})[0]
    if fmt == "torchscript":
        module = torch.jit.load(str(path), map_location="cpu")
        with torch.no_grad():
            return module(torch.from_numpy(pixels)).numpy()
    raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")


def _who(meta: Dict[str, Any], model_info: Optional[Dict[str, Any]]) -> str:
    info = model_info or {}
    if info.get("name") is not None:
        return f"model {info['name']!r} version {info.get('version')}"
    return f"network {meta.get('arch')!r}"


@contextlib.contextmanager
def out_lock(dest: Path, who: str, wait_s: Optional[float] = None) -> Iterator[None]:
    """Hold LOCK_FILE in `dest` for the block: created exclusively (O_EXCL: local disks, NFS, most FUSE mounts),
    holding this host, pid and time, removed afterwards. Another export's lock is waited for, up to `wait_s`
    (LOCK_WAIT_S by default). A lock is never taken from its holder: one left by a process that is gone (killed
    while it moved its files) is named at once when it was of this host, after the wait otherwise.

    Raises:
        ExportError: naming the lock file and its holder, and that nothing was moved into `dest`.
    """
    lock = dest / LOCK_FILE
    deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
    host = socket.gethostname()
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            holder = _holder(lock)
            gone = _gone_here(holder, host)
            if gone or time.monotonic() > deadline:
                why = ("left by a process of this host that is gone: remove it" if gone else
                       "run one export at a time per --out, or remove it if no export runs")
                raise ExportError(f"{who}: checked, but {lock} is held ({holder}); nothing moved into {dest}: "
                                  f"{why}") from None
            time.sleep(0.05)
    try:
        os.write(fd, f"host {host} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode())
    finally:
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def _holder(lock: Path) -> str:
    try:
        return lock.read_text().strip() or "by a process that has not written its name yet"
    except OSError:
        return "by a process that has just released it"


def _gone_here(holder: str, host: str) -> bool:
    """Whether `holder` (a lock's text: host H pid N since T) names a process of `host` that no longer runs."""
    parts = holder.split()
    if len(parts) < 4 or parts[:1] != ["host"] or parts[1] != host or parts[2] != "pid" or not parts[3].isdigit():
        return False
    try:
        os.kill(int(parts[3]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it runs
        return False
    return False


def export_network(network: torch.nn.Module, meta: Dict[str, Any], fmt: str, out_dir: Path,
                   model_info: Optional[Dict[str, Any]] = None,
                   log_files: Optional[Callable[[Path, List[str]], None]] = None) -> Dict[str, Any]:
    """Write the network (`fmt`) and contract.json to `out_dir`; check it against torch on probe inputs.

    The files are written to a hidden folder of this call inside `out_dir` and moved into place only once checked: a
    failed export leaves `out_dir` as it was (removed again if this call made it). A successful one replaces the files
    of an earlier export of this format there. Only `out_dir` itself must be writable (a volume's root, a mount
    point). `log_files(folder, names)`, when given, is called with that private folder once the files are checked
    and before any is moved: what it logs is exactly this export's files, whatever another export does to `out_dir`
    meanwhile; if it raises, nothing is moved. The moves (one rename per file) hold `out_lock`: exports into one
    `out_dir` at once leave it holding one export's files, the last to move, never a mix of two.

    Raises:
        ExportError: unknown format, the export failed (naming the model and version), the exported model's
        probabilities differ from torch's by more than 1e-4, or another export held `out_dir`'s lock too long.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    who = _who(meta, model_info)
    contract = preprocessing_contract(meta, {**(model_info or {}), "format": fmt, "file": FILES[fmt]})
    out_dir = Path(out_dir)
    dest = out_dir.resolve()  # the staging folder sits inside it, on its file system: the moves are renames
    made = not dest.exists()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=dest))
    except OSError as exc:
        raise ExportError(f"{fmt} export of {who}: cannot write to {out_dir}: {exc}") from None
    moved = False
    try:
        module = _WithSoftmax(network).eval()
        try:
            (export_onnx if fmt == "onnx" else export_torchscript)(module, meta, contract, staging / FILES[fmt])
            (staging / CONTRACT_FILE).write_text(json.dumps(contract, indent=2, sort_keys=True))
            probe = _probe(meta, 8)
            with torch.no_grad():
                expected = module(probe).numpy()
            got = run_exported(fmt, staging / FILES[fmt], probe.numpy())
        except Exception as exc:
            raise ExportError(f"{fmt} export of {who} failed ({type(exc).__name__}: {exc}); nothing written to "
                              f"{out_dir}, not logged") from exc
        diff = float(np.abs(got - expected).max())
        if not diff <= PARITY_TOL:
            raise ExportError(f"{fmt} export of {who}: probabilities differ from torch by {diff:.3g} "
                              f"(> {PARITY_TOL}) on probe inputs; nothing written to {out_dir}, not logged")
        files = [name for name in (ONNX_DATA_FILE, FILES[fmt], CONTRACT_FILE) if (staging / name).is_file()]
        size = sum((staging / name).stat().st_size for name in files if name != CONTRACT_FILE)
        if log_files is not None:
            log_files(staging, files)
        try:
            with out_lock(dest, f"{fmt} export of {who}"):
                for name in files:  # the weights first: model.onnx never names a data file not there yet
                    os.replace(staging / name, dest / name)
                    moved = True
                if fmt == "onnx" and ONNX_DATA_FILE not in files and (dest / ONNX_DATA_FILE).is_file():
                    (dest / ONNX_DATA_FILE).unlink()  # an earlier, larger export's weights: not this model's
        except OSError as exc:
            raise ExportError(f"{fmt} export of {who}: checked, but moving it into {out_dir} failed: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if made and not moved:
            with contextlib.suppress(OSError):
                dest.rmdir()  # this call made it and put nothing in it: left as it was (absent)
    return {"format": fmt, "path": str(out_dir / FILES[fmt]), "contract": str(out_dir / CONTRACT_FILE),
            "files": files, "max_abs_diff": diff, "bytes": size}


def export_model(cfg, model_uri: str, fmt: str, out_dir: Optional[str] = None) -> Dict[str, Any]:
    """Export the registered version `model_uri` pins; log the files under `export/<fmt>/` of its run.

    Returns what the CLI prints: model name/version/run, the local files, the artifact URI, the parity figure.
    """
    from mlflow.exceptions import MlflowException

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    client = configure(cfg.mlflow)
    pinned = resolve(client, model_uri)
    network, meta = load_network(pinned)
    info = {"name": pinned.name, "version": pinned.version, "run_id": pinned.run_id, "requested": model_uri}
    started = time.monotonic()
    artifact_path = f"{EXPORT_ARTIFACT_DIR}/{fmt}"

    def log_files(folder: Path, names: List[str]) -> None:
        """Log the checked files from the export's own staging folder (before they are moved into `--out`, which
        another export may be writing at the same time), then tag the version."""
        try:
            for name in names:
                client.log_artifact(pinned.run_id, str(folder / name), artifact_path=artifact_path)
            client.set_model_version_tag(pinned.name, pinned.version, f"export_{fmt}",
                                         f"runs:/{pinned.run_id}/{artifact_path}")
        except MlflowException as exc:
            raise ExportError(f"model {pinned.name!r} version {pinned.version}: exported and checked, but logging to "
                              f"run {pinned.run_id} failed: {exc.message}; nothing moved into "
                              f"{out_dir or 'the output folder'}") from None

    with tempfile.TemporaryDirectory(prefix="lakehouse-export-") as tmp:
        target = Path(out_dir) if out_dir else Path(tmp) / fmt
        result = export_network(network, meta, fmt, target, info, log_files=log_files if pinned.run_id else None)
        artifact_uri = None
        if pinned.run_id:
            artifact_uri = f"runs:/{pinned.run_id}/{artifact_path}"
        else:
            log.warning("model %r version %s has no run; the export is not logged", pinned.name, pinned.version)
        if not out_dir:
            result.pop("path"), result.pop("contract")
    log.info("exported model %r version %s as %s in %.1f s (max |diff| %.2g)", pinned.name, pinned.version, fmt,
             time.monotonic() - started, result["max_abs_diff"])
    return {"model_name": pinned.name, "model_version": pinned.version, "run_id": pinned.run_id,
            "artifact_uri": artifact_uri, "out_dir": os.path.abspath(out_dir) if out_dir else None, **result}
