"""Package `pipeline` and the `lakehouse` console script, on the stack measured to work together (docs/install.md)."""
import os

from setuptools import find_packages, setup

# The core, common to every install profile. Pinned: a resolver left alone picks pyarrow >= 15 and petastorm 0.13,
# and nothing imports. Horovod is built separately (scripts/build_horovod.sh): its 0.28.1 sdist needs patches to
# build against torch >= 2.1. Install with a profile: `pip install -e .[dev,classic]` or `.[dev,modern]`.
INSTALL_REQUIRES = [
    # scripts/setup.sh sets LAKEHOUSE_TORCH_REQUIREMENT=torch where the interpreter already has a CUDA torch
    os.environ.get("LAKEHOUSE_TORCH_REQUIREMENT", "torch==2.13.0"),
    "pytorch-lightning==2.6.6",
    "torchmetrics==1.9.0",
    "deltalake==1.6.6",
    "mlflow==3.17.2",
    "onnx==1.23.2",  # lakehouse export; installs beside numpy 1.26.4 (ml_dtypes 0.5.4)
    "onnxruntime==1.32.0",  # ONNX parity check (export) and tests
    "pillow==13.0.0",
    "simplejpeg==1.9.0",  # libjpeg-turbo straight into numpy: the CPU decode workers' JPEGs (pipeline.data.crops)
    "pyyaml==6.0.3",
    "cloudpickle==3.1.2",
    "psutil==7.2.2",
    "nvidia-ml-py==13.615.71",  # NVML: MLflow's system metrics sample every GPU of rank 0's machine (no-op without one)
    "optuna==5.0.0",  # lakehouse tune (pipeline/tune); only the driver imports it
    "databricks-bundles==1.22.1",  # Databricks' own job schema: tests check conf/databricks/resources against it
]

# Spark 4.0 and the libraries whose newest releases need numpy >= 1.25 (scikit-learn 1.9, matplotlib 3.11).
SPARK4 = ["pyspark==4.0.5", "delta-spark==4.0.1", "scikit-learn==1.9.1", "matplotlib==3.11.2"]

# The install profiles (`make setup PROFILE=classic|modern|dbr-15.4`); exactly one goes with the core. The extra's
# name is the profile's, except dbr-15.4's (extra `dbr154`: a dot is not kept in an extra's name).
PROFILES = {
    # Petastorm 0.12.1 fails on pyarrow >= 15; pyarrow 14 is built for numpy 1.x; pandas 3 needs numpy 2.
    "classic": SPARK4 + ["petastorm==0.12.1", "pyarrow==14.0.2", "numpy==1.26.4", "pandas==2.2.3"],
    # No Petastorm (data.reader=arrow). Installed together and checked with Spark 4.0.5 (pandas_udf, mapInArrow,
    # toPandas over Arrow) and delta-rs; pandas 3 is left out: Spark 4.0 is tested against pandas 2.
    "modern": SPARK4 + ["pyarrow==25.0.1", "numpy==2.4.6", "pandas==2.3.3"],
    # Databricks Runtime 15.4 LTS ML, locally: its Spark, Arrow, numpy and pandas (scripts/databricks/
    # constraints-dbr-15.4-ml.txt) with Petastorm; delta-spark 3.2 is Delta's release for Spark 3.5. scikit-learn and
    # matplotlib: the newest releases that install beside numpy 1.23. MLflow is the core's 3.x, as the job installs
    # it on that runtime (requirements-dbr-15.4-ml.txt).
    "dbr154": ["pyspark==3.5.0", "delta-spark==3.2.0", "scikit-learn==1.7.2", "matplotlib==3.10.9",
               "petastorm==0.12.1", "pyarrow==14.0.1", "numpy==1.23.5", "pandas==1.5.3"],
}

setup(
    name="lakehouse-pipeline",
    version="0.1.0",
    description="Delta Lake -> Spark -> Petastorm/Arrow -> PyTorch Lightning on Horovod -> MLflow registry",
    # the library only: bench/ (lakehouse bench, run from a checkout), tests/, jobs/ and scripts/ are not installed
    packages=find_packages(include=["pipeline", "pipeline.*"]),
    python_requires=">=3.11,<3.13",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "dev": ["pytest==9.2.0", "pytest-timeout==2.4.0", "nbclient==0.11.0", "nbformat==5.11.1",
                "ipykernel==7.4.0", "cmake==4.4.4", "import-linter==2.16"],
        **PROFILES,
    },
    entry_points={"console_scripts": ["lakehouse=pipeline.cli:console"]},
)
