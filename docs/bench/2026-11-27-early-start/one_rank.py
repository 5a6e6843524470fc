"""train.early_start on/off with ONE local rank (train.np=-1) beside the driver on this 2-core machine: a core free for
the rank's imports while the driver prepares. Interleaved; horovod and ddp; direct source and converted (warm)."""
import json, os, subprocess, sys, time, statistics as st
sys.path.insert(0, "/work/main")
from bench.job_phases import timeline, _last_json
from mlflow import MlflowClient
TABLE = "/tmp/before/work/delta/digits"
out = {}
def job(flag, backend, source, i):
    db = "/tmp/jp2/np1.db"
    extra = ["data.source=direct", "data.decode=cpu", "data.decode_workers=1"] if source == "direct" else []
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--conf", "/work/main/conf/local.yaml", f"delta.table={TABLE}",
           "delta.version=0", "data.cache_dir=/tmp/jp2/cache-np1", "train.np=-1", "train.max_epochs=2",
           "train.early_stopping.enabled=false", "train.warmup_epochs=0", "mlflow.registered_model=np1",
           "mlflow.gate_min_lift=null", f"mlflow.tracking_uri=sqlite:///{db}", "mlflow.artifact_location=/tmp/jp2/art-np1",
           f"train.backend={backend}", f"train.checkpoint_dir=/tmp/jp2/ckpt-np1-{i}", f"train.early_start={flag}", *extra]
    t0 = time.time(); d = subprocess.run(cmd, capture_output=True, text=True, cwd="/work/main", env={**os.environ, "LAKEHOUSE_PROGRESS": "0"}); t1 = time.time()
    if d.returncode: print("FAILED", d.stderr[-1500:]); return None
    s = _last_json(d.stdout)
    ph = timeline(s, t0, t1, MlflowClient(f"sqlite:///{db}").get_metric_history(s["run_id"], "epoch_time_s"))
    ph["b1st"] = sum(ph[k] for k in ("process_and_spark_s", "prepare_data_s", "run_setup_s", "rank_start_s")); ph["wall_s"] = t1 - t0
    return ph
for i in range(4):
    for backend in ("horovod", "ddp"):
        for source in ("direct", "converted"):
            for flag in (("true", "false") if i % 2 else ("false", "true")):
                ph = job(flag, backend, source, i)
                if i and ph: out.setdefault(f"{backend}/{source}/{flag}", []).append(ph)
                if ph: print(i, backend, source, flag, round(ph["b1st"], 2), {k[:8]: round(ph[k], 2) for k in ("prepare_data_s", "run_setup_s", "rank_start_s")}, flush=True)
json.dump(out, open("/tmp/jp2/np1.json", "w"))
for k, v in sorted(out.items()):
    print(k, "b1st median %.2f" % st.median([x["b1st"] for x in v]), [round(x["b1st"], 2) for x in v], "wall %.2f" % st.median([x["wall_s"] for x in v]))
