"""Interleaved job_phases: c912d8d (before issue 38), 7ad91d9 (after), 12c8d05 early_start off/on; horovod and ddp;
the digits sample (1797 rows), 3 epochs, 2 ranks, warm cache; converted source."""
import json, os, subprocess, sys, time
sys.path.insert(0, "/work/main")
from bench.job_phases import timeline, _last_json
from mlflow import MlflowClient

TABLE = "/tmp/before/work/delta/digits"
VARIANTS = {"before": ("/tmp/before", []), "after38": ("/tmp/after", []),
            "early_off": ("/tmp/now", ["train.early_start=false"]), "early_on": ("/tmp/now", ["train.early_start=true"])}
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
out = {}

def job(name, backend, i):
    tree, extra = VARIANTS[name]
    db = f"/tmp/jp2/{name}.db"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--conf", f"{tree}/conf/local.yaml",
           f"delta.table={TABLE}", "delta.version=0", f"data.cache_dir=/tmp/jp2/cache-{name}", "train.np=-2",
           "train.max_epochs=3", "train.early_stopping.enabled=false", "train.warmup_epochs=0",
           f"mlflow.registered_model=jp-{name}", "mlflow.gate_min_lift=null", f"mlflow.tracking_uri=sqlite:///{db}",
           f"mlflow.artifact_location=/tmp/jp2/art-{name}", f"train.backend={backend}",
           f"train.checkpoint_dir=/tmp/jp2/ckpt-{name}-{backend}-{i}", *extra]
    env = {**os.environ, "PYTHONPATH": tree, "LAKEHOUSE_PROGRESS": "0"}
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=900)
    t1 = time.time()
    if done.returncode:
        print(name, backend, "FAILED", done.stderr[-2000:], flush=True)
        return None
    s = _last_json(done.stdout)
    client = MlflowClient(f"sqlite:///{db}")
    ph = timeline(s, t0, t1, client.get_metric_history(s["run_id"], "epoch_time_s"))
    ph["wall_s"] = t1 - t0
    ph["before_first_step_s"] = sum(ph[k] for k in ("process_and_spark_s", "prepare_data_s", "run_setup_s", "rank_start_s"))
    print(name, backend, i, {k: round(v, 2) for k, v in ph.items()}, flush=True)
    return ph

names = list(VARIANTS)
for i in range(ROUNDS + 1):  # round 0: warm-up (cache entries, experiments, models)
    order = names if i % 2 == 0 else names[::-1]
    for backend in ("horovod", "ddp") if i % 2 == 0 else ("ddp", "horovod"):
        for name in order:
            ph = job(name, backend, i)
            if i and ph:
                out.setdefault(f"{name}/{backend}", []).append(ph)
    json.dump(out, open("/tmp/jp2/compare.json", "w"), indent=1)
print("done", flush=True)
