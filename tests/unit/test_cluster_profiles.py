"""The profiles in conf/ load cleanly, the cluster ones point at shared storage, and the cluster check refuses host-private paths and loopback addresses on a real cluster."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import Config, ConfigError, load_config
from pipeline.lakehouse.cluster import cluster_problems

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted(p.name for p in (ROOT / "conf").glob("*.yaml"))


def test_the_four_profiles_exist():
    assert {"base.yaml", "local.yaml", "cluster.yaml", "databricks.yaml"} <= set(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_loads_with_only_known_keys(name):
    cfg = load_config(str(ROOT / "conf" / name))
    assert isinstance(cfg, Config)
    # load_config refuses unknown keys; also check the file uses no key the dataclasses lack
    # (a misspelt key in a profile must not silently fall back to base.yaml's value).
    raw = yaml.safe_load((ROOT / "conf" / name).read_text()) or {}
    known = cfg.to_dict()

    def walk(data, ref, prefix):
        for key, value in data.items():
            assert key in ref, f"{name}: unknown key {prefix}{key}"
            if isinstance(value, dict) and key != "conf":
                walk(value, ref[key], f"{prefix}{key}.")

    walk({k: v for k, v in raw.items() if k != "extends"}, known, "")


def test_cluster_profile_runs_on_spark_tasks_with_shared_storage():
    cfg = load_config(str(ROOT / "conf/cluster.yaml"))
    assert cfg.spark.master.startswith("spark://")
    assert cfg.delta.engine == "spark"
    assert cfg.spark.conf["spark.jars.packages"] == "io.delta:delta-spark_2.13:4.0.1"
    assert cfg.train.np > 0
    assert cfg.data.cache_dir.startswith(("hdfs://", "s3://", "s3a://", "dbfs:/", "file:///mnt/"))
    assert cfg.mlflow.tracking_uri.startswith("http")
    # the placeholder master is a one-machine cluster, and with a real master every path stays reachable
    assert cluster_problems(cfg) == []
    assert cluster_problems(with_master(cfg, "spark://10.0.0.5:7077")) == []


def with_master(cfg: Config, master: str, **keys) -> Config:
    from pipeline.config import apply_overrides

    return apply_overrides(cfg, {"spark.master": master, **keys})


def test_databricks_profile():
    cfg = load_config(str(ROOT / "conf/databricks.yaml"))
    assert cfg.delta.engine == "spark"
    assert cfg.train.np == 2
    assert cfg.mlflow.tracking_uri == "databricks"
    assert cfg.mlflow.registered_model.count(".") == 2, "Unity Catalog names are catalog.schema.model"
    assert cfg.data.cache_dir.startswith("file:///Volumes/")
    # runs on both runtimes (17.3 ML ships neither Horovod nor Petastorm): Arrow reader, DDP via TorchDistributor
    assert (cfg.data.reader, cfg.train.backend) == ("arrow", "ddp")
    # /Volumes is a FUSE mount on every node: in spark.shared_paths by default
    assert cluster_problems(cfg) == []
    problems = cluster_problems(with_master(cfg, "databricks", **{"spark.shared_paths": ["/dbfs"]}))
    assert len(problems) == 3 and all("/Volumes/" in p for p in problems), problems


LOCAL = {"delta.table": "/data/t", "data.cache_dir": "/data/cache", "train.checkpoint_dir": "/data/ckpt",
         "mlflow.tracking_uri": "http://mlflow.internal:5000", "mlflow.artifact_location": None, "train.np": 2}


@pytest.mark.parametrize("key,value", [("data.cache_dir", "work/petastorm_cache"), ("data.cache_dir", "/tmp/cache"),
                                       ("data.cache_dir", "file:///tmp/cache"), ("train.checkpoint_dir", "/tmp/c"),
                                       ("delta.table", "work/delta/t"),
                                       ("mlflow.tracking_uri", "sqlite:////tmp/mlflow.db"),
                                       ("mlflow.artifact_location", "/tmp/artifacts")])
@pytest.mark.parametrize("master", ["spark://10.0.0.5:7077", "yarn", "k8s://https://api:6443"])
def test_cluster_check_refuses_a_host_private_path_naming_its_key(key, value, master):
    cfg = with_master(Config(), master, **{**LOCAL, "spark.shared_paths": ["/data"], key: value})
    problems = cluster_problems(cfg)
    assert len(problems) == 1, problems
    assert f"'{key}'" in problems[0] and value in problems[0] and master in problems[0]


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "http://localhost:5000"])
def test_cluster_check_refuses_a_loopback_tracking_server_when_ranks_run_on_executors(uri):
    cfg = with_master(Config(), "spark://10.0.0.5:7077", **{**LOCAL, "spark.shared_paths": ["/data"],
                                                             "mlflow.tracking_uri": uri})
    problems = cluster_problems(cfg)
    assert len(problems) == 1 and "'mlflow.tracking_uri'" in problems[0] and "another host" in problems[0], problems
    # ranks in this process (train.np=1) or on this machine (-N) log from here: the loopback server is fine
    assert cluster_problems(with_master(cfg, "spark://10.0.0.5:7077", **{"train.np": -2})) == []


@pytest.mark.parametrize("master", ["local[2]", "local[*]", "local", "spark://127.0.0.1:7077",
                                    "spark://localhost:7077"])
def test_cluster_check_accepts_local_paths_when_every_process_is_on_this_machine(master):
    assert cluster_problems(with_master(Config(), master, **{"train.np": 2})) == []


@pytest.mark.parametrize("cache_dir", ["hdfs:///tmp/cache", "s3://bucket/cache", "dbfs:/tmp/cache"])
def test_cluster_check_accepts_cluster_storage(cache_dir):
    cfg = with_master(Config(), "spark://10.0.0.5:7077", **{**LOCAL, "spark.shared_paths": ["/data"],
                                                             "data.cache_dir": cache_dir})
    assert cluster_problems(cfg) == []


def test_a_symlink_out_of_a_shared_folder_is_not_shared(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "private").mkdir()
    (tmp_path / "shared" / "link").symlink_to(tmp_path / "private")
    cfg = with_master(Config(), "spark://10.0.0.5:7077",
                      **{**LOCAL, "spark.shared_paths": ["/data", str(tmp_path / "shared")],
                         "data.cache_dir": str(tmp_path / "shared" / "link" / "cache")})
    assert [p for p in cluster_problems(cfg) if "data.cache_dir" in p]


def test_the_refusal_reaches_the_user_as_a_config_error():
    from pipeline.workflow import prepare_data

    cfg = load_config(str(ROOT / "conf/local.yaml"), ["spark.master=spark://10.0.0.5:7077"])
    with pytest.raises(ConfigError, match="data.cache_dir"):
        prepare_data(None, cfg)  # refused before any Spark work


@pytest.mark.parametrize("job,command", [("ingest.py", "ingest"), ("train.py", "train"), ("promote.py", "promote"),
                                         ("predict.py", "predict")])
def test_jobs_are_thin_guarded_calls_of_the_cli(job, command):
    path = ROOT / "jobs" / job
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{job} needs a docstring"
    assert not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body), f"{job} must hold no logic"
    guard = [n for n in tree.body if isinstance(n, ast.If)]
    assert len(guard) == 1 and "__main__" in ast.unparse(guard[0].test)
    assert f'main([{command!r}, *sys.argv[1:]])'.replace("'", '"') in ast.unparse(guard[0]).replace("'", '"')


@pytest.mark.parametrize("job,command", [("ingest.py", "ingest"), ("train.py", "train"), ("promote.py", "promote"),
                                         ("predict.py", "predict")])
def test_a_job_script_is_the_cli_subcommand(job, command):
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: lakehouse {command} "), done.stdout


def test_databricks_bundle_runs_the_four_jobs_with_the_target_profile():
    bundle = yaml.safe_load((ROOT / "conf/databricks/databricks.yml").read_text())
    assert "bundle" in bundle and "targets" in bundle
    jobs = {}
    for path in sorted((ROOT / "conf/databricks/resources").glob("*.yml")):
        jobs.update((yaml.safe_load(path.read_text()).get("resources") or {}).get("jobs") or {})
    assert jobs, "no job in conf/databricks/resources"
    (job,) = jobs.values()
    tasks = {t["task_key"]: t for t in job["tasks"]}
    assert set(tasks) == {"ingest", "train", "promote", "predict"}
    assert tasks["train"]["depends_on"] == [{"task_key": "ingest"}]
    assert tasks["promote"]["depends_on"] == [{"task_key": "train"}]
    assert tasks["predict"]["depends_on"] == [{"task_key": "promote"}]
    for key, task in tasks.items():
        spt = task["spark_python_task"]
        assert spt["python_file"].endswith(f"jobs/{key}.py")
        params = spt["parameters"]
        assert params[params.index("--conf") + 1].endswith("conf/databricks/${bundle.target}.yaml")
        assert any(str(p).startswith("train.np=") for p in params)
        assert task["job_cluster_key"] in {c["job_cluster_key"] for c in job["job_clusters"]}
        # Databricks installs a library with its dependencies: the project's would replace the runtime's pyspark
        # and torch, so the cluster's init script adds the project instead (scripts/databricks/init-lakehouse.sh)
        assert ".whl" not in json.dumps(task.get("libraries", []))
    cluster = job["job_clusters"][0]["new_cluster"]
    assert cluster["num_workers"] == 2
    assert "LAKEHOUSE_SHARED_FS" not in cluster["spark_env_vars"]  # spark.shared_paths says it (/Volumes)
    assert "init-lakehouse.sh" in json.dumps(cluster["init_scripts"])
    assert (ROOT / "conf/databricks/README.md").is_file()
