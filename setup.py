"""Package `pipeline` and the `lakehouse` console script, on the stack measured to work together (see README)."""
from setuptools import find_packages, setup

# Pinned to the set in the README's "Stack" table; a resolver left alone picks pyarrow >= 15 and
# petastorm 0.13, and nothing imports. Horovod is built separately (scripts/build_horovod.sh): its
# 0.28.1 sdist needs a C++17 patch to build against torch 2.13.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "pytorch-lightning==2.6.6",
    "torchmetrics==1.9.0",
    "pyspark==4.0.5",
    "delta-spark==4.0.1",
    "deltalake==1.6.6",
    "petastorm==0.12.1",
    "pyarrow==14.0.2",
    "numpy==1.26.4",
    "pandas==2.2.3",
    "mlflow==3.17.2",
    "scikit-learn==1.9.1",
    "pillow==13.0.0",
    "pyyaml==6.0.3",
    "matplotlib==3.11.2",
    "cloudpickle==3.1.2",
    "psutil==7.2.2",
]

setup(
    name="lakehouse-pipeline",
    version="0.1.0",
    description="Delta Lake -> Spark -> Petastorm -> PyTorch Lightning on Horovod -> MLflow registry",
    packages=find_packages(include=["pipeline", "pipeline.*"]),
    python_requires=">=3.11,<3.12",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "dev": ["pytest==9.2.0", "pytest-timeout==2.4.0", "nbclient==0.11.0", "nbformat==5.11.1",
                "ipykernel==7.4.0", "cmake==4.4.4"],
    },
    entry_points={"console_scripts": ["lakehouse=pipeline.cli:main"]},
)
