"""The Horovod build decisions (pipeline.buildinfo.plan) for described machines: flags, C++ standard, NCCL, cache key."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.buildinfo import (GCC13_CXXFLAGS, BuildHost, BuildPlanError, NcclCandidate, cache_key,
                                cxx_standard_for_torch, plan, shell_exports)

ROOT = Path(__file__).resolve().parents[2]
SITE = "/venv/lib/python3.12/site-packages/nvidia/nccl"
PIP_NCCL = NcclCandidate("nvidia-nccl package", SITE, header=f"{SITE}/include/nccl.h",
                         library=f"{SITE}/lib/libnccl.so.2")


def cpu_host(**kw) -> BuildHost:
    base = dict(torch="2.13.0+cpu", python=(3, 11), gcc="12.2.0", cmake="3.31.6", jobs=2)
    base.update(kw)
    return BuildHost(**base)


def gpu_host(**kw) -> BuildHost:
    base = dict(torch="2.11.0+cu130", torch_cuda="13.0", python=(3, 12), gcc="13.3.0", cmake="4.1.2",
                nvcc="/usr/local/cuda/bin/nvcc", cuda_capabilities=[(9, 0)], nccl=[PIP_NCCL], jobs=16)
    base.update(kw)
    return BuildHost(**base)


def test_cpu_torch_gcc12_cmake3_builds_gloo_only_cxx17_without_workarounds():
    p = plan(cpu_host())
    assert p.cxx_standard == 17 and p.cxx_standard_root == 17
    assert p.gpu_operations is None
    assert p.env["HOROVOD_CPU_OPERATIONS"] == "gloo" and p.env["HOROVOD_WITH_GLOO"] == "1"
    assert p.env["HOROVOD_WITH_PYTORCH"] == "1" and p.env["HOROVOD_WITHOUT_MPI"] == "1"
    assert p.env["MAKEFLAGS"] == "-j2"
    for absent in ("HOROVOD_GPU_OPERATIONS", "HOROVOD_NCCL_HOME", "CXXFLAGS", "CMAKE_POLICY_VERSION_MINIMUM"):
        assert absent not in p.env
    assert p.cache_key == "horovod-0.28.1-torch2.13.0_cpu-cpu-cp311-gloo"


def test_cuda_torch_gcc13_cmake4_builds_nccl_from_the_pip_package():
    shim = "/tmp/build/nccl-home"
    p = plan(gpu_host(), shim_dir=shim)
    assert p.cxx_standard == 17
    assert p.env["CXXFLAGS"] == GCC13_CXXFLAGS == "-include string -include cstdint -include stdexcept"
    assert p.env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert p.env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and p.gpu_operations == "NCCL"
    assert p.env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert p.env["HOROVOD_NCCL_HOME"] == shim
    assert p.env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert p.env["MAKEFLAGS"] == "-j16"
    # the pip package has libnccl.so.2 only: the shim folder gets include/ and a libnccl.so link to it
    assert p.nccl_links == [(f"{shim}/include", f"{SITE}/include"), (f"{shim}/lib/libnccl.so", f"{SITE}/lib/libnccl.so.2")]
    assert p.cache_key == "horovod-0.28.1-torch2.11.0_cu130-cuda13.0-cp312-nccl"


def test_nccl_home_already_laid_out_is_used_as_is():
    home = NcclCandidate("NCCL_HOME", "/opt/nccl", header="/opt/nccl/include/nccl.h", library="/opt/nccl/lib/libnccl.so")
    p = plan(gpu_host(nccl=[home, PIP_NCCL]))
    assert p.env["HOROVOD_NCCL_HOME"] == "/opt/nccl" and p.nccl_links == [] and p.nccl_source == "NCCL_HOME"


def test_torch_2_14_needs_cxx20_for_the_torch_extension_only():
    p = plan(gpu_host(torch="2.14.1+cu130"))
    assert p.cxx_standard == 20 and p.cxx_standard_root == 17
    assert [cxx_standard_for_torch(v) for v in ("2.0.1", "2.1.0", "2.13.0+cpu", "2.14.1", "3.0.0a0+git")] == \
        [14, 17, 17, 20, 20]


def test_cuda_torch_without_nccl_stops_naming_what_is_missing():
    with pytest.raises(BuildPlanError) as err:
        plan(gpu_host(nccl=[]))
    msg = str(err.value)
    assert "torch 2.11.0+cu130 has CUDA 13.0 but no NCCL" in msg
    assert "nvidia-nccl-cu13" in msg and "NCCL_HOME" in msg and "LAKEHOUSE_HOROVOD_GLOO_ONLY=1" in msg

    headerless = NcclCandidate("NCCL_HOME", "/opt/nccl", header=None, library="/opt/nccl/lib/libnccl.so")
    with pytest.raises(BuildPlanError, match=r"NCCL_HOME at /opt/nccl lacks include/nccl.h"):
        plan(gpu_host(nccl=[headerless]))


def test_cuda_torch_without_nvcc_stops_with_the_reason():
    with pytest.raises(BuildPlanError, match=r"no nvcc was found.*CUDA_HOME.*LAKEHOUSE_HOROVOD_GLOO_ONLY=1"):
        plan(gpu_host(nvcc=None))
    assert plan(gpu_host(nvcc=None, gloo_only=True)).gpu_operations is None


def test_gloo_only_override_builds_without_nccl_and_keys_the_cache_apart():
    p = plan(gpu_host(nccl=[], gloo_only=True))
    assert p.gpu_operations is None and "HOROVOD_GPU_OPERATIONS" not in p.env
    assert p.cache_key.endswith("-cuda13.0-cp312-gloo")
    assert p.cache_key != plan(gpu_host()).cache_key
    assert any("gloo-only" in n for n in p.notes)


def test_no_visible_gpu_builds_for_every_architecture_torch_has():
    p = plan(gpu_host(cuda_capabilities=[], cuda_arch_list=["sm_80", "sm_90", "sm_100", "compute_90"]))
    assert p.env["HOROVOD_BUILD_CUDA_CC_LIST"] == "100,80,90"


def test_missing_cmake_is_an_error_and_unknown_gcc_gets_the_includes():
    with pytest.raises(BuildPlanError, match="cmake not found"):
        plan(cpu_host(cmake=None))
    assert plan(cpu_host(gcc=None)).env["CXXFLAGS"] == GCC13_CXXFLAGS


def test_cache_key_ignores_everything_but_horovod_torch_cuda_python_and_ops():
    a, b = cpu_host(), cpu_host(gcc="13.1.0", cmake="4.0.0", jobs=8)
    assert cache_key(a, None) == cache_key(b, None)
    assert cache_key(cpu_host(python=(3, 12)), None) != cache_key(a, None)
    assert cache_key(cpu_host(torch="2.13.1+cpu"), None) != cache_key(a, None)


def test_shell_exports_are_quoted_for_bash():
    out = shell_exports(plan(gpu_host(), shim_dir="/tmp/a b/nccl"))
    env = subprocess.run(["bash", "-c", out + "\nenv"], capture_output=True, text=True, check=True).stdout
    assert f"CXXFLAGS={GCC13_CXXFLAGS}" in env.splitlines()
    assert "HOROVOD_NCCL_HOME=/tmp/a b/nccl" in env.splitlines()
    assert "LAKEHOUSE_HVD_CXX_STANDARD=17" in env.splitlines()


def test_plan_command_on_this_machine_describes_the_installed_torch():
    import torch

    proc = subprocess.run([sys.executable, "-m", "pipeline.buildinfo", "plan"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    if torch.version.cuda and proc.returncode == 2:  # a CUDA torch without NCCL: the stated stop
        assert "no NCCL" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert f"torch{torch.__version__.replace('+', '_')}" in proc.stdout
