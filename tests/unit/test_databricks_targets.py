"""The two Databricks targets: bundle and job schema, their profiles, the constraints that keep the runtime's packages, the start-up check and who owns the Spark session."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.lakehouse import runtime
from pipeline.lakehouse.runtime import RUNTIME_PACKAGES, TARGETS, problems, read_constraints, recognize
from pipeline.lakehouse.spark import DELTA_SESSION_CONF, plan_session, unapplied_settings, wanted_conf

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "conf/databricks"
SCRIPTS = ROOT / "scripts/databricks"
EXPECTED = {  # target: (spark_version on CPU, on GPU, reader, backend, Spark, Python)
    "dbr-15.4-ml": ("15.4.x-cpu-ml-scala2.12", "15.4.x-gpu-ml-scala2.12", "petastorm", "horovod", "3.5", "3.11"),
    "dbr-17.3-ml": ("17.3.x-cpu-ml-scala2.13", "17.3.x-gpu-ml-scala2.13", "arrow", "ddp", "4.0", "3.12"),
}


def bundle():
    return yaml.safe_load((BUNDLE / "databricks.yml").read_text())


def jobs():
    out = {}
    for path in sorted((BUNDLE / "resources").glob("*.yml")):
        out.update((yaml.safe_load(path.read_text()).get("resources") or {}).get("jobs") or {})
    return out


def resolve(text: str, target: str, **overrides) -> str:
    """${var.x} and ${bundle.target} as the bundle resolves them for `target` (the target's variables, then defaults)."""
    b = bundle()
    values = {k: v.get("default") for k, v in b["variables"].items()}
    values.update(b["targets"][target].get("variables") or {})
    values.update(overrides)
    text = text.replace("${bundle.target}", target)
    return re.sub(r"\$\{var\.([a-z_]+)\}", lambda m: str(values[m.group(1)]), text)


def test_the_bundle_has_exactly_the_two_runtime_targets_and_17_3_is_the_default():
    targets = bundle()["targets"]
    assert set(targets) == set(EXPECTED)
    assert [t for t, spec in targets.items() if spec.get("default")] == ["dbr-17.3-ml"]
    assert set(targets) == set(TARGETS)


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_each_target_resolves_to_its_runtime_image_on_cpu_and_gpu(target):
    (job,) = jobs().values()
    spec = job["job_clusters"][0]["new_cluster"]["spark_version"]
    cpu, gpu = EXPECTED[target][:2]
    assert resolve(spec, target) == cpu
    assert resolve(spec, target, compute="gpu") == gpu


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_each_target_profile_loads_with_its_reader_and_backend(target):
    (job,) = jobs().values()
    for task in job["tasks"]:
        params = task["spark_python_task"]["parameters"]
        conf = resolve(params[params.index("--conf") + 1], target)
        rel = conf.split("${workspace.file_path}/", 1)[1]
        assert (ROOT / rel).is_file(), f"task {task['task_key']} of {target} reads {rel}, which is not in the repo"
    cfg = load_config(str(BUNDLE / f"{target}.yaml"))
    reader, backend = EXPECTED[target][2:4]
    assert (cfg.data.reader, cfg.train.backend) == (reader, backend)
    assert (TARGETS[target].reader, TARGETS[target].backend) == (reader, backend)
    assert cfg.delta.engine == "spark" and cfg.mlflow.tracking_uri == "databricks"
    assert cfg.data.cache_dir.startswith("file:///Volumes/") and cfg.train.checkpoint_dir.startswith("/Volumes/")
    assert cfg.mlflow.registered_model.count(".") == 2, "Unity Catalog names are catalog.schema.model"


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_target_profiles_agree_with_the_shared_databricks_profile_except_reader_and_backend(target):
    shared = load_config(str(ROOT / "conf/databricks.yaml")).flat()
    mine = load_config(str(BUNDLE / f"{target}.yaml")).flat()
    differ = {k for k in shared if shared[k] != mine[k]}
    assert differ <= {"data.reader", "train.backend"}, differ


def test_the_job_matches_databricks_own_job_schema():
    """databricks-bundles' Job model (Databricks' own, from PyPI) refuses unknown or misplaced keys."""
    from databricks.bundles.jobs import Job

    (job,) = jobs().values()
    parsed = Job.from_dict(job)
    assert [t.task_key for t in parsed.tasks] == ["ingest", "train", "promote", "predict"]
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["job_clusters"][0]["new_cluster"]["init_script"] = bad["job_clusters"][0]["new_cluster"].pop("init_scripts")
    with pytest.raises(ValueError, match="init_script"):
        Job.from_dict(bad)


def test_the_cluster_runs_the_init_script_with_the_target_and_the_synced_tree():
    (job,) = jobs().values()
    cluster = job["job_clusters"][0]["new_cluster"]
    (script,) = cluster["init_scripts"]
    rel = script["workspace"]["destination"].split("${workspace.file_path}/", 1)[1]
    assert (ROOT / rel).is_file()
    env = cluster["spark_env_vars"]
    assert env["LAKEHOUSE_SRC"] == "${workspace.file_path}" and env["LAKEHOUSE_TARGET"] == "${bundle.target}"
    assert resolve(env["LAKEHOUSE_HOROVOD"], "dbr-17.3-ml") in {"0", "1"}
    synced = {Path(p).name for p in bundle()["sync"]["paths"]}
    assert {"jobs", "conf", "pipeline", "scripts"} <= synced


def test_the_init_script_is_valid_bash_that_pins_the_runtime_and_builds_horovod_with_its_python():
    script = SCRIPTS / "init-lakehouse.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "/databricks/python/bin/python" in text
    assert '-c "$PINS"' in text and "pip freeze" in text
    assert 'PY="$PY"' in text and "scripts/build_horovod.sh" in text and "PIP_CONSTRAINT" in text


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_constraints_pin_what_the_runtime_provides(target):
    path = TARGETS[target].constraints
    pins = read_constraints(path)
    text = path.read_text()
    for name in RUNTIME_PACKAGES:
        # pinned, or (mlflow on 15.4 only) said why not in the file
        assert name in pins or re.search(rf"^#\s+{name}\s[^\n]*(\n#[^\n]*)*?NOT pinned", text, re.M), (path.name, name)
    assert re.match(r"(\d+\.\d+)", pins["pyspark"]).group(1) == EXPECTED[target][4]
    assert set(pins) <= set(RUNTIME_PACKAGES)


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_requirements_add_only_what_the_runtime_lacks(target):
    reqs = read_constraints(SCRIPTS / f"requirements-{target}.txt")  # the same exact-pin format
    pins = read_constraints(TARGETS[target].constraints)
    assert not set(reqs) & set(pins), "a requirement would replace a pinned runtime package"
    assert {"pytorch-lightning", "deltalake"} <= set(reqs)
    setup = (ROOT / "setup.py").read_text()
    for name, version in reqs.items():
        assert f'"{name}=={version}"' in setup, f"{name}=={version} is not setup.py's pin"


def test_the_dbr_15_4_install_profile_has_the_runtime_versions():
    """`make setup PROFILE=dbr-15.4` (setup.py's dbr154 extra, scripts/setup.sh) builds 15.4 LTS ML's Python, Spark,
    Arrow, numpy and pandas with Petastorm, so the data-path tests run on them locally."""
    block = re.search(r'"dbr154": \[([^\]]*)\]', (ROOT / "setup.py").read_text()).group(1)
    extra = dict(re.findall(r'"([a-z-]+)==([^"]+)"', block))
    pins = read_constraints(TARGETS["dbr-15.4-ml"].constraints)
    for name in ("pyspark", "pyarrow", "numpy", "pandas"):
        assert extra[name] == pins[name], name
    assert "petastorm" in extra and extra["delta-spark"].startswith("3."), extra  # Delta 3.x is built for Spark 3.5
    setup_sh = (ROOT / "scripts/setup.sh").read_text()
    want = f'dbr-15.4) VENV=${{VENV:-.venv-dbr154}}; EXTRA=dbr154; PYTHONS="{TARGETS["dbr-15.4-ml"].python}"'
    assert want in setup_sh
    assert "VENV_dbr-15.4 := .venv-dbr154" in (ROOT / "Makefile").read_text()


def test_a_bad_constraints_line_is_named_by_file_and_line(tmp_path):
    bad = tmp_path / "c.txt"
    bad.write_text("# fine\npyspark==3.5.0\nnumpy>=1.23\n")
    with pytest.raises(ConfigError, match=r"c\.txt:3: 'numpy>=1\.23'"):
        read_constraints(bad)
    bad.write_text("numpy==1\nNumPy==2\n")
    with pytest.raises(ConfigError, match="c.txt:2: numpy is pinned twice"):
        read_constraints(bad)


@pytest.mark.parametrize("value,target", [("15.4", "dbr-15.4-ml"), ("17.3", "dbr-17.3-ml"),
                                          ("17.3.x-gpu-ml-scala2.13", "dbr-17.3-ml"), ("16.4", None),
                                          ("", None), (None, None), ("client.1.13", None)])
def test_recognize_the_runtime_version(value, target):
    found = recognize(value)
    assert (found.name if found else None) == target


def runtime_versions(target: str, **changes):
    """What the target's runtime has, after the documented install (constraints + requirements)."""
    versions = dict(read_constraints(TARGETS[target].constraints))
    versions.update(read_constraints(SCRIPTS / f"requirements-{target}.txt"))
    versions["pytorch_lightning"] = versions.pop("pytorch-lightning")
    for name in TARGETS[target].preinstalled:
        versions[name] = "0.28.1" if name == "horovod" else "0.12.1"
    versions.update(changes)
    return versions


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_each_target_profile_passes_on_its_runtime(target):
    cfg = load_config(str(BUNDLE / f"{target}.yaml"))
    t = TARGETS[target]
    assert problems(cfg, t, t.python, runtime_versions(target), read_constraints(t.constraints)) == []


def test_horovod_missing_on_17_3_says_to_run_the_init_script_or_use_ddp():
    t = TARGETS["dbr-17.3-ml"]
    cfg = load_config(str(BUNDLE / "dbr-17.3-ml.yaml"), ["train.backend=horovod"])
    (msg,) = problems(cfg, t, "3.12", runtime_versions(t.name), read_constraints(t.constraints))
    assert "horovod is not installed" in msg and "init-lakehouse.sh" in msg and "train.backend=ddp" in msg


def test_petastorm_missing_says_to_use_the_arrow_reader():
    t = TARGETS["dbr-17.3-ml"]
    cfg = load_config(str(BUNDLE / "dbr-17.3-ml.yaml"), ["data.reader=petastorm"])
    (msg,) = problems(cfg, t, "3.12", runtime_versions(t.name), None)
    assert "petastorm is not installed" in msg and "data.reader=arrow" in msg


def test_a_replaced_runtime_package_and_a_wrong_python_are_named():
    t = TARGETS["dbr-15.4-ml"]
    cfg = load_config(str(BUNDLE / "dbr-15.4-ml.yaml"))
    found = problems(cfg, t, "3.12", runtime_versions(t.name, pyspark="4.0.5", numpy="1.26.4"),
                     read_constraints(t.constraints))
    text = "\n".join(found)
    assert "Python 3.11, this is Python 3.12" in text
    assert "pyspark 4.0.5 is not the runtime's Spark 3.5" in text and "--no-deps" in text
    assert "numpy 1.26.4 is not the 1.23.5" in text


def test_a_patch_level_difference_is_drift_not_a_problem():
    t = TARGETS["dbr-15.4-ml"]
    pins = read_constraints(t.constraints)
    versions = runtime_versions(t.name, pyarrow="14.0.2", torch="2.3.1+cu121")
    assert problems(load_config(str(BUNDLE / "dbr-15.4-ml.yaml")), t, "3.11", versions, pins) == []
    assert runtime.drift(versions, pins) == {"pyarrow": ("14.0.2", "14.0.1")}


def test_mlflow_2_of_15_4_is_refused_with_what_to_do():
    t = TARGETS["dbr-15.4-ml"]
    cfg = load_config(str(BUNDLE / "dbr-15.4-ml.yaml"))
    (msg,) = problems(cfg, t, "3.11", runtime_versions(t.name, mlflow="2.13.1"), read_constraints(t.constraints))
    assert "mlflow 2.13.1 is older than 3" in msg


def test_require_runtime_does_nothing_off_databricks_and_raises_on_it(monkeypatch):
    cfg = load_config(str(BUNDLE / "dbr-17.3-ml.yaml"), ["train.backend=horovod"])
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    assert runtime.require_runtime(cfg) is None
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    monkeypatch.setattr(runtime, "runtime_facts", lambda: (TARGETS["dbr-17.3-ml"], "3.12",
                                                           runtime_versions("dbr-17.3-ml")))
    with pytest.raises(ConfigError, match="horovod is not installed"):
        runtime.require_runtime(cfg)
    ok = load_config(str(BUNDLE / "dbr-17.3-ml.yaml"))
    assert runtime.require_runtime(ok).name == "dbr-17.3-ml"


# --- who owns the Spark session (pipeline/lakehouse/spark.py), as pure decisions ---

@pytest.mark.parametrize("active,dbr,owned", [(False, None, True), (False, "", True), (True, None, False),
                                              (False, "17.3", False), (True, "15.4", False)])
def test_the_project_owns_the_session_only_when_it_creates_it_off_databricks(active, dbr, owned):
    plan = plan_session(active, dbr)
    assert plan.owned is owned
    assert ("Databricks Runtime" in plan.reason) == bool(dbr)


def test_wanted_conf_is_delta_only_for_the_spark_engine_plus_spark_conf():
    rs = load_config(str(ROOT / "conf/local.yaml"), ["spark.conf.spark.sql.session.timeZone=UTC"])
    assert wanted_conf(rs) == {"spark.sql.session.timeZone": "UTC"}
    sp = load_config(str(ROOT / "conf/databricks.yaml"))
    assert wanted_conf(sp) == DELTA_SESSION_CONF


def test_unapplied_settings_names_what_a_foreign_session_lacks_without_setting_it():
    have = {"a": "1", "b": "2"}
    assert unapplied_settings({"a": "1", "b": "3", "c": "x"}, have.get) == {"b": ("3", "2"), "c": ("x", None)}
    assert unapplied_settings({"a": "1"}, have.get) == {}


# --- the bundle against the keys the `databricks` CLI documents ---
# The CLI (Go) is on neither PyPI nor npm, so `databricks bundle validate` cannot run here; these are the keys of its
# bundle JSON schema (`databricks bundle schema`, bundle/schema/jsonschema.json in databricks/cli, read 2026-11-23),
# each of whose objects refuses keys it does not list (additionalProperties: false).
CLI_KEYS = {
    "root": {"artifacts", "bundle", "environments", "experimental", "include", "permissions", "presets", "python",
             "resources", "run_as", "scripts", "sync", "targets", "variables", "workspace"},
    "bundle": {"cluster_id", "compute_id", "databricks_cli_version", "deployment", "engine", "git", "name", "uuid"},
    "sync": {"exclude", "include", "paths"},
    "artifact": {"build", "dynamic_version", "executable", "files", "path", "type"},
    "variable": {"default", "description", "lookup", "type"},
    "target": {"artifacts", "bundle", "cluster_id", "compute_id", "default", "git", "mode", "permissions", "presets",
               "resources", "run_as", "sync", "variables", "workspace"},
}
CLI_ENUMS = {"artifact.type": {"whl", "jar"}, "target.mode": {"development", "production"}}
REFERENCE = re.compile(r"\$\{([^}]+)\}")


def bundle_errors(doc: dict, folder: Path) -> list:
    """What the CLI's schema (and its path and variable resolution) would refuse in a databricks.yml, as messages."""
    errs = []

    def unknown(where, obj, kind):
        if not isinstance(obj, dict):
            errs.append(f"{where}: a mapping is expected, got {type(obj).__name__}")
            return
        errs.extend(f"{where}.{k}: not a key the CLI knows" for k in sorted(set(obj) - CLI_KEYS[kind]))

    unknown("(root)", doc, "root")
    unknown("bundle", doc.get("bundle", {}), "bundle")
    if "name" not in doc.get("bundle", {}):
        errs.append("bundle.name: required")
    unknown("sync", doc.get("sync", {}), "sync")
    for p in doc.get("sync", {}).get("paths", []):
        if not (folder / p).exists():
            errs.append(f"sync.paths: {p} does not exist next to databricks.yml")
    for pattern in doc.get("include", []):
        if not list(folder.glob(pattern)):
            errs.append(f"include: {pattern} matches no file")
    for name, art in (doc.get("artifacts") or {}).items():
        unknown(f"artifacts.{name}", art, "artifact")
        if art.get("type") not in CLI_ENUMS["artifact.type"]:
            errs.append(f"artifacts.{name}.type: {art.get('type')!r} is not whl or jar")
        if not (folder / art.get("path", ".") / "setup.py").is_file():
            errs.append(f"artifacts.{name}.path: no setup.py to build a wheel from")
    declared = set(doc.get("variables") or {})
    for name, var in (doc.get("variables") or {}).items():
        unknown(f"variables.{name}", var, "variable")
    for name, target in (doc.get("targets") or {}).items():
        unknown(f"targets.{name}", target, "target")
        if target.get("mode", "development") not in CLI_ENUMS["target.mode"]:
            errs.append(f"targets.{name}.mode: {target['mode']!r} is not development or production")
        for var, value in (target.get("variables") or {}).items():
            if var not in declared:
                errs.append(f"targets.{name}.variables.{var}: not declared under variables")
            if isinstance(value, dict):
                unknown(f"targets.{name}.variables.{var}", value, "variable")
    texts = [yaml.safe_dump(doc)] + [p.read_text() for pattern in doc.get("include", []) for p in folder.glob(pattern)]
    for ref in {r for text in texts for r in REFERENCE.findall(text)}:
        if ref.startswith("var."):
            if ref[4:] not in declared:
                errs.append(f"${{{ref}}}: variable {ref[4:]} is not declared")
        elif ref not in {"bundle.target", "bundle.name", "workspace.file_path", "workspace.root_path",
                         "workspace.current_user.userName"}:
            errs.append(f"${{{ref}}}: not a reference this bundle can resolve")
    return errs


def test_the_bundle_uses_only_keys_the_databricks_cli_documents():
    assert bundle_errors(bundle(), BUNDLE) == []


def test_the_bundle_check_refuses_what_the_cli_would():
    bad = bundle()
    bad["sync"]["path"] = bad["sync"].pop("paths")
    bad["artifacts"]["lakehouse"]["type"] = "wheel"
    bad["targets"]["dbr-15.4-ml"]["mode"] = "dev"
    bad["targets"]["dbr-15.4-ml"]["variables"]["runtme"] = "15.4"
    bad["bundle"]["target"] = "x"
    bad["include"] = ["resources/*.yaml"]
    errs = "\n".join(bundle_errors(bad, BUNDLE))
    for expected in ("sync.path: not a key", "artifacts.lakehouse.type: 'wheel'", "targets.dbr-15.4-ml.mode: 'dev'",
                     "variables.runtme: not declared", "bundle.target: not a key", "include: resources/*.yaml"):
        assert expected in errs, errs


def test_every_task_script_the_job_runs_is_in_the_repo():
    (job,) = jobs().values()
    for task in job["tasks"]:
        script = (BUNDLE / "resources" / task["spark_python_task"]["python_file"]).resolve()
        assert script.is_file() and script.parent == ROOT / "jobs", (task["task_key"], script)


# --- item 5 of the issue: Unity Catalog names and /Volumes paths in each target's defaults ---

@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_each_target_keeps_its_data_on_a_volume_and_its_model_in_unity_catalog(target):
    cfg = load_config(str(BUNDLE / f"{target}.yaml"))
    volume = re.compile(r"^(file://)?/Volumes/[^/]+/[^/]+/[^/]+/.+")  # /Volumes/<catalog>/<schema>/<volume>/...
    for key in ("delta.table", "data.cache_dir", "train.checkpoint_dir", "mlflow.unended_runs"):
        value = cfg.flat()[key]
        assert volume.match(str(value)), f"{target}: {key}={value} is not under a Unity Catalog volume"
    assert re.fullmatch(r"[a-z_]+\.[a-z_]+\.[a-z_]+", cfg.mlflow.registered_model), cfg.mlflow.registered_model
    (job,) = jobs().values()
    (predict,) = [t for t in job["tasks"] if t["task_key"] == "predict"]
    params = predict["spark_python_task"]["parameters"]
    assert params[params.index("--model") + 1] == f"models:/{cfg.mlflow.registered_model}@champion"
    assert params[params.index("--table") + 1] == cfg.delta.table


def test_the_databricks_tracking_uri_registers_in_unity_catalog():
    """mlflow.tracking_uri=databricks: MLflow 3 (3.0.1 on 17.3 too) takes databricks-uc as the registry, so
    `main.ml.lakehouse_classifier` is a Unity Catalog model; nothing in the profiles points elsewhere."""
    uris = {load_config(str(BUNDLE / f"{t}.yaml")).mlflow.tracking_uri for t in EXPECTED}
    assert uris == {"databricks"}
    code = "import mlflow; mlflow.set_tracking_uri('databricks'); print(mlflow.get_registry_uri())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "databricks-uc"
