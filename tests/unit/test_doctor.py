"""`lakehouse doctor`'s checks on described machines: profile, known-bad package sets, Horovod vs CUDA, ranks vs GPUs, Databricks targets."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.doctor import (GpuFacts, HorovodBuild, backend_problems, databricks_problems, detect_profile,
                             gpu_problems, horovod_problems, known_problems, reader_problems)

ROOT = Path(__file__).resolve().parents[2]
CLASSIC = {"torch": "2.13.0+cpu", "pytorch_lightning": "2.6.6", "pyspark": "4.0.5", "delta": "4.0.1",
           "deltalake": "1.6.6", "petastorm": "0.12.1", "pyarrow": "14.0.2", "numpy": "1.26.4", "pandas": "2.2.3",
           "mlflow": "3.17.2", "horovod": "0.28.1"}
MODERN = {**CLASSIC, "petastorm": None, "pyarrow": "25.0.1", "numpy": "2.4.6", "pandas": "2.3.3"}
DBR154 = {**CLASSIC, "pyspark": "3.5.0", "delta": "3.2.0", "pyarrow": "14.0.1", "numpy": "1.23.5", "pandas": "1.5.3"}
CPU = GpuFacts(torch="2.13.0+cpu")
H100 = GpuFacts(torch="2.11.0+cu130", torch_cuda="13.0", device_names=["NVIDIA H100 80GB HBM3"],
                capabilities=[(9, 0)], dist_nccl=True)
GLOO_HVD = HorovodBuild(installed=True, pytorch=True, gloo=True)
NCCL_HVD = HorovodBuild(installed=True, pytorch=True, gloo=True, nccl=True)


def test_profiles_are_told_from_what_is_installed():
    assert detect_profile(CLASSIC)[0] == "classic"
    assert detect_profile(MODERN) == ("modern", "no petastorm, pyarrow 25.0.1, numpy 2.4.6")
    profile, why = detect_profile({**CLASSIC, "pyarrow": "25.0.1"})  # petastorm beside a pyarrow it cannot read
    assert profile == "unknown" and "petastorm 0.12.1, pyarrow 25.0.1" in why
    assert detect_profile(DBR154) == ("dbr-15.4", "petastorm 0.12.1 with pyarrow 14.0.1 on Spark 3.5.0")


def test_the_dbr_15_4_profile_passes_and_delta_3_goes_with_spark_3_5_only():
    assert known_problems(DBR154, "17.0.13") == []
    assert any("delta-spark 4.0.1 does not match Spark 3.5.0" in p
               for p in known_problems({**DBR154, "delta": "4.0.1"}, "17.0.13"))
    assert any("delta-spark 3.2.0 does not match Spark 4.0.5" in p
               for p in known_problems({**CLASSIC, "delta": "3.2.0"}, "17.0.13"))


def test_both_profiles_pass_the_package_checks_and_mixtures_do_not():
    assert known_problems(CLASSIC, "17.0.13") == []
    assert known_problems(MODERN, "17.0.13") == []
    mixed = known_problems({**CLASSIC, "pyarrow": "16.1.0"}, "17.0.13")
    assert any("Petastorm 0.12 fails with pyarrow >= 15" in p for p in mixed)
    assert any("numpy 2.0.0: pyarrow 14.0.2 is built for numpy 1.x" in p
               for p in known_problems({**CLASSIC, "numpy": "2.0.0"}, "17.0.13"))
    assert any("delta-spark 4.1.0 does not match Spark 4.0.5" in p
               for p in known_problems({**MODERN, "delta": "4.1.0"}, "17.0.13"))
    assert "java not found: Spark 4.0 needs Java 17" in known_problems(MODERN, None)


def test_petastorm_reader_without_petastorm_says_what_to_do():
    (msg,) = reader_problems("petastorm", None)
    assert "data.reader=petastorm" in msg and "make setup PROFILE=classic" in msg and "data.reader=arrow" in msg
    assert reader_problems("arrow", None) == []
    assert reader_problems("petastorm", "0.12.1") == []


def test_cuda_torch_with_gloo_only_horovod_is_named():
    (msg,) = horovod_problems(GLOO_HVD, H100)
    assert "CUDA torch 2.11.0+cu130 beside a Horovod built without NCCL" in msg and "build_horovod.sh" in msg
    assert horovod_problems(NCCL_HVD, H100) == []
    assert horovod_problems(GLOO_HVD, CPU) == []
    # a CUDA torch on a machine without GPUs (PyPI's torch on Python 3.12): no CUDA tensors to all-reduce
    assert horovod_problems(GLOO_HVD, GpuFacts(torch="2.13.0+cu128", torch_cuda="12.8")) == []
    assert any("built with NCCL but torch 2.13.0+cpu has no CUDA" in p for p in horovod_problems(NCCL_HVD, CPU))
    absent = HorovodBuild(installed=False, error="ModuleNotFoundError")
    assert any("horovod is not importable" in p for p in horovod_problems(absent, CPU))
    # the horovod backend names itself; another backend, or a Databricks runtime's own check (None), does not
    (msg,) = backend_problems(CPU, absent, "horovod", -2)
    assert "train.backend=horovod but horovod is missing" in msg
    assert backend_problems(CPU, absent, "ddp", -2) == [] and backend_problems(CPU, None, "horovod", -2) == []


def test_more_local_ranks_than_gpus():
    (msg,) = gpu_problems(H100, -2)
    assert "train.np=-2: 2 local ranks but 1 visible GPU(s)" in msg and "train.np=-1" in msg
    assert gpu_problems(H100, -1) == []
    assert gpu_problems(H100, 4) == []  # 4 Spark tasks: placed by the cluster, not this host
    assert gpu_problems(CPU, -4) == []  # CPU ranks: no GPU to share


def test_ddp_checks_the_process_group_the_ranks_will_pick():
    # the ranks pick NCCL where they see CUDA, gloo elsewhere (devices.ddp_backend); there is no key to ask otherwise
    assert backend_problems(CPU, GLOO_HVD, "ddp", -2) == []  # gloo on CPU
    assert backend_problems(GpuFacts(torch="2.11.0+cu130", torch_cuda="13.0"), GLOO_HVD, "ddp", -2) == []  # gloo
    assert backend_problems(H100, GLOO_HVD, "ddp", -1) == []  # NCCL on the GPU
    no_dist_nccl = GpuFacts(**{**H100.__dict__, "dist_nccl": False})
    assert "has no NCCL" in backend_problems(no_dist_nccl, GLOO_HVD, "ddp", -1)[0]


def test_doctor_reads_no_key_the_config_does_not_have():
    """The doctor read train.ddp_backend (gone) and kept its own default for data.reader: every key it reads is one
    the config defines."""
    import re

    from pipeline.config import Config

    source = (ROOT / "pipeline" / "doctor.py").read_text()
    assert "getattr(cfg." not in source
    keys = set(Config().flat())
    for key in set(re.findall(r"\bcfg\.((?:data|train|model|delta|mlflow|tune|spark)\.[a-z_]+)", source)):
        assert key in keys, key


def test_doctor_imports_without_pyspark_or_petastorm():
    code = ("import sys; sys.modules['pyspark'] = None; sys.modules['petastorm'] = None\n"
            "import pipeline.doctor, pipeline.buildinfo; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# --- on Databricks: the target recognized and what the runtime lacks (the start-up check's own messages) ---

DBR_15_4_RUNTIME = {"pyspark": "3.5.0", "pyarrow": "14.0.1", "numpy": "1.23.5", "pandas": "1.5.3",
                    "torch": "2.3.1+cu121", "mlflow": "3.17.2", "horovod": "0.28.1", "petastorm": "0.12.1",
                    "pytorch_lightning": "2.6.6", "deltalake": "1.6.6"}


def test_databricks_15_4_is_recognized_and_passes_with_its_profile():
    cfg = load_config(str(ROOT / "conf/databricks/dbr-15.4-ml.yaml"))
    target, problems, notes = databricks_problems(cfg, "15.4", "3.11", DBR_15_4_RUNTIME)
    assert (target, problems, notes) == ("dbr-15.4-ml", [], [])


def test_databricks_17_3_without_horovod_or_petastorm_says_what_is_missing():
    cfg = load_config(str(ROOT / "conf/databricks/dbr-17.3-ml.yaml"), ["train.backend=horovod", "data.reader=petastorm"])
    versions = {**DBR_15_4_RUNTIME, "pyspark": "4.0.0", "pyarrow": "19.0.1", "numpy": "2.1.3", "pandas": "2.2.3",
                "torch": "2.7.1", "mlflow": "3.0.1", "horovod": None, "petastorm": None}
    target, problems, notes = databricks_problems(cfg, "17.3", "3.12", versions)
    assert target == "dbr-17.3-ml" and notes == []
    text = "\n".join(problems)
    assert "horovod is not installed" in text and "init-lakehouse.sh" in text
    assert "petastorm is not installed" in text and "data.reader=arrow" in text


def test_an_unsupported_runtime_is_a_note_and_a_patch_difference_too():
    cfg = load_config(str(ROOT / "conf/databricks/dbr-15.4-ml.yaml"))
    target, problems, notes = databricks_problems(cfg, "16.4", "3.12", DBR_15_4_RUNTIME)
    assert target is None and problems == []
    assert "Databricks Runtime 16.4 is not a supported target (dbr-15.4-ml: 15.4 LTS ML" in notes[0]
    target, problems, notes = databricks_problems(cfg, "15.4.x-gpu-ml-scala2.12", "3.11",
                                                  {**DBR_15_4_RUNTIME, "pyarrow": "14.0.2"})
    assert target == "dbr-15.4-ml" and problems == []
    assert notes == ["pyarrow 14.0.2 on this runtime, 14.0.1 recorded in constraints-dbr-15.4-ml.txt"]

