"""Horovod build decisions: from a description of torch, CUDA, compilers and NCCL to env vars, C++ standards and cache key.

`plan(BuildHost)` is pure (unit-tested with made-up hosts); `describe()` reads this machine. scripts/build_horovod.sh
runs `python -m pipeline.buildinfo plan --shell DIR`, which prints `export` lines, or stops with the reason.
Only the standard library is imported here: the script runs before anything else of the project is installed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

HOROVOD_VERSION = "0.28.1"
GLOO_ONLY_VAR = "LAKEHOUSE_HOROVOD_GLOO_ONLY"
# Extra includes GCC >= 13 needs in Horovod 0.28.1's sources (no longer pulled in transitively).
GCC13_CXXFLAGS = "-include string -include cstdint -include stdexcept"


class BuildPlanError(RuntimeError):
    """The Horovod build this machine needs cannot be made; the message says what is missing and what to do."""


@dataclass
class NcclCandidate:
    """A place NCCL may come from: `$NCCL_HOME`, or the `nvidia-nccl-*` package a CUDA torch wheel installs."""

    source: str  # e.g. "NCCL_HOME" or "nvidia-nccl-cu13 (site-packages/nvidia/nccl)"
    root: str
    header: Optional[str] = None  # path of nccl.h, None when absent
    library: Optional[str] = None  # path of libnccl.so or libnccl.so.N, None when absent


@dataclass
class BuildHost:
    """What decides the build; `describe()` fills it from this machine, tests write it by hand."""

    torch: str  # torch.__version__, e.g. "2.13.0+cpu", "2.11.0+cu130"
    python: Tuple[int, int]
    torch_cuda: Optional[str] = None  # torch.version.cuda, e.g. "13.0"; None for a CPU torch
    gcc: Optional[str] = None  # "13.3.0"; None when unknown (another compiler, or none found)
    cmake: Optional[str] = None  # "4.1.2"; None when no cmake on PATH
    nvcc: Optional[str] = None  # path of nvcc, None when not found
    cuda_capabilities: List[Tuple[int, int]] = field(default_factory=list)  # visible devices
    cuda_arch_list: List[str] = field(default_factory=list)  # torch.cuda.get_arch_list(), e.g. ["sm_80", "sm_90"]
    nccl: List[NcclCandidate] = field(default_factory=list)
    gloo_only: bool = False
    jobs: int = 2
    horovod: str = HOROVOD_VERSION


@dataclass
class BuildPlan:
    env: Dict[str, str]
    cxx_standard: int  # for horovod/torch (torch's headers decide)
    cxx_standard_root: int  # for Horovod's core and gloo
    cache_key: str
    gpu_operations: Optional[str]  # "NCCL" or None (gloo only)
    nccl_source: Optional[str] = None
    nccl_links: List[Tuple[str, str]] = field(default_factory=list)  # (link path, target) the script creates
    notes: List[str] = field(default_factory=list)


def _version_tuple(v: Optional[str]) -> Tuple[int, ...]:
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", v or "")
    return tuple(int(x) for x in m.groups() if x is not None) if m else ()


def cxx_standard_for_torch(torch_version: str) -> int:
    """C++ standard torch's headers need: 14 before 2.1, 17 up to 2.13, 20 from 2.14 (`std::strong_ordering`)."""
    v = _version_tuple(torch_version)
    if not v:
        raise BuildPlanError(f"torch version {torch_version!r} cannot be parsed")
    if v[:2] >= (2, 14):
        return 20
    if v[:2] >= (2, 1):
        return 17
    return 14


def cache_key(host: BuildHost, gpu_operations: Optional[str]) -> str:
    """Horovod, torch with its CUDA version, Python and the GPU operations; never numpy/pyarrow (profiles share it)."""
    torch = host.torch.replace("+", "_")
    cuda = f"cuda{host.torch_cuda}" if host.torch_cuda else "cpu"
    ops = gpu_operations.lower() if gpu_operations else "gloo"
    return f"horovod-{host.horovod}-torch{torch}-{cuda}-cp{host.python[0]}{host.python[1]}-{ops}"


def _cc_list(host: BuildHost) -> str:
    if host.cuda_capabilities:
        ccs = sorted({f"{major}{minor}" for major, minor in host.cuda_capabilities})
    else:  # no device visible (a build node): every architecture this torch was built for
        ccs = sorted({a.split("_", 1)[1] for a in host.cuda_arch_list if a.startswith("sm_")})
    return ",".join(ccs)


def _pick_nccl(host: BuildHost, shim_dir: str) -> Tuple[NcclCandidate, str, List[Tuple[str, str]]]:
    """The first candidate with both nccl.h and a library; HOROVOD_NCCL_HOME and the links that make it one."""
    for cand in host.nccl:
        if not (cand.header and cand.library):
            continue
        inc = os.path.dirname(cand.header)
        lib_name = os.path.basename(cand.library)
        if (os.path.basename(inc) == "include" and lib_name == "libnccl.so"
                and os.path.dirname(inc) == os.path.dirname(os.path.dirname(cand.library))):
            return cand, os.path.dirname(inc), []  # already laid out as HOROVOD_NCCL_HOME expects
        # e.g. site-packages/nvidia/nccl/{include/nccl.h, lib/libnccl.so.2}: no libnccl.so for the linker
        links = [(os.path.join(shim_dir, "include"), inc), (os.path.join(shim_dir, "lib", "libnccl.so"), cand.library)]
        return cand, shim_dir, links
    return None, "", []


def _describe_missing(host: BuildHost) -> str:
    if not host.nccl:
        return "no NCCL_HOME is set and no nvidia-nccl-* package is installed beside torch"
    parts = []
    for cand in host.nccl:
        missing = [what for what, have in (("include/nccl.h", cand.header), ("lib/libnccl.so*", cand.library))
                   if not have]
        parts.append(f"{cand.source} at {cand.root} lacks {' and '.join(missing)}")
    return "; ".join(parts)


def plan(host: BuildHost, shim_dir: str = "nccl-home") -> BuildPlan:
    """The build of Horovod `host` needs.

    Raises:
        BuildPlanError: a CUDA torch with no NCCL to build against (unless `gloo_only`), or an unparsable torch.
    """
    std = cxx_standard_for_torch(host.torch)
    env = {
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_MPI": "1",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "MAKEFLAGS": f"-j{max(1, host.jobs)}",
    }
    notes = [f"torch {host.torch}: Horovod's torch extension built as C++{std}"]
    gcc = _version_tuple(host.gcc)
    if not gcc or gcc[0] >= 13:
        env["CXXFLAGS"] = GCC13_CXXFLAGS
        notes.append(f"GCC {host.gcc or 'unknown'}: {GCC13_CXXFLAGS}")
    cmake = _version_tuple(host.cmake)
    if not cmake:
        raise BuildPlanError("cmake not found on PATH: Horovod's build needs CMake >= 3.13 (pip install cmake)")
    if cmake[0] >= 4:
        # CMake 4 refuses gloo's `cmake_minimum_required(VERSION 2.8...)`
        env["CMAKE_POLICY_VERSION_MINIMUM"] = "3.5"
        notes.append(f"CMake {host.cmake}: CMAKE_POLICY_VERSION_MINIMUM=3.5")

    gpu_ops, nccl_source, links = None, None, []
    if host.torch_cuda:
        if host.gloo_only:
            notes.append(f"{GLOO_ONLY_VAR}=1: CUDA torch {host.torch} but a gloo-only build; CUDA tensors "
                         "will be all-reduced through host memory")
        else:
            cand, nccl_home, links = _pick_nccl(host, shim_dir)
            if cand is None:
                raise BuildPlanError(
                    f"torch {host.torch} has CUDA {host.torch_cuda} but no NCCL was found to build Horovod with "
                    f"({_describe_missing(host)}). Install the nvidia-nccl-cu{_version_tuple(host.torch_cuda)[0]} "
                    f"package torch depends on, or set NCCL_HOME to a folder with include/nccl.h and lib/libnccl.so; "
                    f"or set {GLOO_ONLY_VAR}=1 to build without NCCL (slow: GPU tensors go through host memory)")
            if not host.nvcc:
                raise BuildPlanError(
                    f"torch {host.torch} has CUDA {host.torch_cuda} but no nvcc was found (PATH, $CUDA_HOME/bin): "
                    f"Horovod's NCCL build compiles CUDA kernels. Install the CUDA toolkit or set CUDA_HOME; or set "
                    f"{GLOO_ONLY_VAR}=1 to build without NCCL (e.g. a CUDA torch on a machine without GPUs)")
            gpu_ops, nccl_source = "NCCL", cand.source
            env.update({"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_LINK": "SHARED",
                        "HOROVOD_NCCL_HOME": nccl_home})
            ccs = _cc_list(host)
            if ccs:
                env["HOROVOD_BUILD_CUDA_CC_LIST"] = ccs
            notes.append(f"CUDA {host.torch_cuda}: NCCL from {cand.source}, compute capabilities {ccs or 'default'}")
    return BuildPlan(env=env, cxx_standard=std, cxx_standard_root=min(std, 17), cache_key=cache_key(host, gpu_ops),
                     gpu_operations=gpu_ops, nccl_source=nccl_source, nccl_links=links, notes=notes)


# ---------------------------------------------------------------- reading this machine


def _tool_version(cmd: List[str], pattern: str) -> Optional[str]:
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(pattern, out.stdout + out.stderr)
    return m.group(1) if m else None


def _nccl_candidates() -> List[NcclCandidate]:
    found = []
    home = os.environ.get("NCCL_HOME") or os.environ.get("HOROVOD_NCCL_HOME")
    if home:
        header = os.path.join(home, "include", "nccl.h")
        libs = sorted(glob.glob(os.path.join(home, "lib*", "libnccl.so*")))
        found.append(NcclCandidate("NCCL_HOME", home, header if os.path.exists(header) else None,
                                   libs[0] if libs else None))
    try:
        import nvidia.nccl as pkg  # the nvidia-nccl-cuXX wheel a CUDA torch installs (a namespace package)

        roots = list(pkg.__path__)
    except ImportError:
        roots = []
    for root in roots:
        header = os.path.join(root, "include", "nccl.h")
        libs = sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
        found.append(NcclCandidate(f"nvidia-nccl package ({root})", root, header if os.path.exists(header) else None,
                                   libs[0] if libs else None))
    return found


def describe() -> BuildHost:
    """This machine: the torch importable here, gcc/cmake/nvcc on PATH, NCCL candidates, visible GPUs."""
    import torch

    caps: List[Tuple[int, int]] = []
    arch: List[str] = []
    cuda = torch.version.cuda
    if cuda:
        arch = list(torch.cuda.get_arch_list())
        if torch.cuda.is_available():
            caps = [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
    nvcc = shutil.which("nvcc")
    if not nvcc and os.environ.get("CUDA_HOME"):
        cand = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
        nvcc = cand if os.path.exists(cand) else None
    return BuildHost(
        torch=torch.__version__, python=sys.version_info[:2], torch_cuda=cuda,
        gcc=_tool_version([os.environ.get("CXX", "g++"), "-dumpfullversion"], r"^(\d+(?:\.\d+)*)"),
        cmake=_tool_version(["cmake", "--version"], r"cmake version (\d+\.\d+(?:\.\d+)?)"),
        nvcc=nvcc, cuda_capabilities=caps, cuda_arch_list=arch, nccl=_nccl_candidates(),
        gloo_only=os.environ.get(GLOO_ONLY_VAR, "") == "1", jobs=os.cpu_count() or 2)


def shell_exports(p: BuildPlan) -> str:
    """`export` lines for the build script: Horovod's env plus LAKEHOUSE_HVD_* decisions."""
    values = dict(p.env)
    values.update({
        "LAKEHOUSE_HVD_CACHE_KEY": p.cache_key,
        "LAKEHOUSE_HVD_CXX_STANDARD": str(p.cxx_standard),
        "LAKEHOUSE_HVD_CXX_STANDARD_ROOT": str(p.cxx_standard_root),
        "LAKEHOUSE_HVD_GPU_OPERATIONS": p.gpu_operations or "",
        "LAKEHOUSE_HVD_NCCL_LINKS": " ".join(f"{link}={target}" for link, target in p.nccl_links),
    })
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in values.items())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.buildinfo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="the build this machine needs")
    p.add_argument("--shell", metavar="NCCL_SHIM_DIR", help="print export lines; NCCL links go under this folder")
    p.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    host = describe()
    if args.jobs:
        host.jobs = args.jobs
    try:
        result = plan(host, shim_dir=os.path.abspath(args.shell) if args.shell else "nccl-home")
    except BuildPlanError as exc:
        print(f"build_horovod: {exc}", file=sys.stderr)
        return 2
    if args.shell:
        for note in result.notes:
            print(f"build_horovod: {note}", file=sys.stderr)
        print(shell_exports(result))
    else:
        print(json.dumps({"host": asdict(host), "plan": asdict(result)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
