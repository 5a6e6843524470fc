"""`lakehouse bench --quick` end to end: every path in tmp, exit 0, a JSON report with every ratio numeric, loader
efficiency for every available reader, scaling through the product's train() (no timing asserts)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli, make_config

pytestmark = pytest.mark.integration

RATIOS = ["loader_efficiency", "loader_efficiency_uncached", "input_bound_fraction", "conversion_vs_plain_write",
          "conversion_cache_hit", "horovod_cpu_scaling", "horovod_pipeline_over_alone", "shard_balance",
          "checkpoint_overhead", "tracking_overhead", "tune_overhead", "restart_cost", "predict_throughput",
          "job_fixed_cost", "horovod_epoch_over_ddp", "direct_wall", "direct_before_first_step",
          "direct_reader_over_pyarrow", "direct_rank_memory", "early_start_before_first_step",
          "cpu_decode_large_photo_speedup", "cpu_photos_decode_per_core", "cpu_photos_decode_over_pillow_every_core",
          "split_plan_digest_speedup"]
GPU_RATIOS = ["gpu_lightning_over_plain", "gpu_input_bound_fraction"]  # only where torch sees CUDA
STEP_OVERHEAD = {"cpu": "step_overhead_ms", "cuda": "gpu_step_overhead_ms"}  # named by the device it ran on
STEP_OVERHEAD_VARIANTS = {"horovod/np1", "horovod/np2", "ddp/np1", "ddp/np2"}


@pytest.mark.timeout(2400)  # quick, yet ~15 train() runs (tune, restarts) and Spark jobs: minutes on a loaded host
def test_bench_quick_writes_every_ratio(tmp_path: Path):
    out = tmp_path / "bench" / "bench.json"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, LAKEHOUSE_PROGRESS="0")
    proc = subprocess.run(
        cli("bench", "--quick", "--out", str(out), "--conf", str(ROOT / "conf/local.yaml"),
            f"delta.table={tmp_path}/delta/digits",
            f"data.cache_dir={tmp_path}/petastorm_cache",
            f"train.checkpoint_dir={tmp_path}/checkpoints",
            f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            f"mlflow.artifact_location={tmp_path}/mlartifacts"),
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=2390)
    assert proc.returncode == 0, proc.stderr[-4000:]

    report = json.loads(out.read_text())
    printed = json.loads(proc.stdout.strip().splitlines()[-1])  # the CLI prints the same report
    assert printed["ratios"] == report["ratios"]
    assert report["quick"] is True and report["repeats"] == 2 and "quick" in report["repeats_note"]

    names = {r["name"] for r in report["results"]}
    device = report["machine"]["device"]
    assert names == set(RATIOS) | (set(GPU_RATIOS) if device == "cuda" else set()) | {STEP_OVERHEAD[device]}, names
    assert len(report["ratios"]) == len(report["results"])  # every figure has its own key
    for r in report["results"]:
        assert isinstance(r["ratio"], float) and math.isfinite(r["ratio"]), r
        assert r["target"] > 0 and r["op"] in (">=", "<=") and isinstance(r["passed"], bool), r
        assert r["repeats"] >= 1 and len(r["per_repeat"]) == r["repeats"], r
        assert r["parts"] and r["spread"], r
        key = f"{r['name']}/{r['dataset']}" + (f"/{r['variant']}" if r["variant"] else "")
        assert report["ratios"][key] == r["ratio"]
    # the verdict: every part asked for gave its figures; a part this machine cannot run is skipped with the reason
    assert report["failed"] == {} and report["complete"] is True, report["failed"]
    assert report["all_passed"] == all(report["passed"].values()) and "all_passed" in report["verdict_rule"]
    if device == "cpu":
        assert "CUDA" in report["skipped"]["gpu"], report["skipped"]
    assert {r["dataset"] for r in report["results"]} == {"sample", "synthetic", "tiny_cnn_16px", "photos_4032x3024",
                                                       "photos_imagenet_shaped", "imagenet_shaped_photos_delta"}
    # where the run's time went, per measurement (the conversion prepares both data sets)
    spent = report["measurement_s"]
    assert set(spent) == {"conversion", "loader", "input_bound", "shard_balance", "predict_throughput", "overheads",
                          "tune_overhead", "restart_cost", "job_phases", "direct_source", "epoch_parity", "scaling",
                          "step_overhead", "photo_decode", "split_digest", "gpu"}, spent
    assert all(v >= 0 for v in spent.values()) and sum(spent.values()) <= report["duration_s"], spent
    # the content split planned from the stored digests against hashing every photo (the two plans checked equal)
    digest = next(r for r in report["results"] if r["name"] == "split_plan_digest_speedup")
    p = digest["parts"]
    assert p["rows"] == 400 and 0 < p["val_rows"] < 400 and 0 < p["stored_s"] < p["hashed_s"], p
    assert digest["repeats"] == 2 and math.isfinite(digest["ratio"]) and digest["ratio"] > 1, digest
    # the step overhead: train() against a plain loop on the same in-memory batches, one job per backend and world
    # size (also alone, without Spark: test_bench_photo_decode_quick runs a standalone part by itself)
    steps = [r for r in report["results"] if r["name"] == STEP_OVERHEAD[device]]
    assert {r["variant"] for r in steps} == STEP_OVERHEAD_VARIANTS
    for r in steps:
        p = r["parts"]
        assert r["repeats"] == 2 and r["ratio"] == pytest.approx(sorted(r["per_repeat"])[0] / 2 +
                                                                 sorted(r["per_repeat"])[1] / 2), r
        assert p["train_ms_per_step"] > 0 and p["plain_ms_per_step"] > 0 and p["train_cpu_ms_per_step"] > 0, p
        assert p["world_size"] == int(r["variant"][-1]) and p["backend"] == r["variant"].split("/")[0]
        assert p["steps_per_window"] == 30 and p["batch_per_rank"] == 16 and p["compile"] is False
        assert r["target"] == (0.25 if device == "cuda" else 0.5) and r["op"] == "<="
    assert not list((tmp_path / "bench").glob("step_overhead_*"))  # its scratch data set is removed
    scaling = next(r for r in report["results"] if r["name"] == "horovod_cpu_scaling")["parts"]
    for control in ("plain_1_proc", "plain_2_procs", "horovod_2_ranks_in_memory",
                    "pipeline_2_ranks_in_memory"):  # measured, not assumed
        assert scaling["control_samples_per_s"][control] > 0, scaling
    assert "train()" in scaling["path"] and scaling["samples_per_s_1_rank"] > 0 and scaling["samples_per_s_2_ranks"] > 0
    # the 1-rank rate brackets the 2-rank job: a 1-rank job just before it and one just after
    assert scaling["samples_per_s_1_rank_before"] > 0 and scaling["samples_per_s_1_rank_after"] > 0
    alone = next(r for r in report["results"] if r["name"] == "horovod_pipeline_over_alone")
    assert alone["ratio"] == pytest.approx(scaling["pipeline_2_ranks_over_horovod_alone_2_ranks"])
    assert scaling["control_machine_2_procs_over_1"] == pytest.approx(
        scaling["control_samples_per_s"]["plain_2_procs"] / scaling["control_samples_per_s"]["plain_1_proc"])
    assert report["datasets"]["sample"]["rows"] > 0 and report["datasets"]["synthetic"]["rows"] == 2000
    readers = report["readers"]["measured"]
    assert readers and readers[0] == report["readers"]["configured"]
    loaders = {(r["name"], r["dataset"], r["parts"]["reader"]): r["parts"]["kept_in_memory"] for r in report["results"]
               if r["name"].startswith("loader_efficiency")}
    assert loaders == {("loader_efficiency", d, rd): True for d in ("sample", "synthetic") for rd in readers} | {
        ("loader_efficiency_uncached", d, rd): False for d in ("sample", "synthetic") for rd in readers}
    assert set(report["loaders"]) == {"sample", "synthetic"}  # side by side: data set -> reader -> cached/uncached
    assert all(set(report["loaders"][d]) == set(readers) for d in report["loaders"])

    tune = next(r for r in report["results"] if r["name"] == "tune_overhead")
    assert tune["dataset"] == "sample" and tune["target"] == 1.10
    assert tune["repeats"] == tune["parts"]["timed_pairs"] == 1  # --quick: one timed pair of whole trainings
    assert tune["parts"]["dropped_pairs"] == {}
    assert set(tune["parts"]["trial_states"].values()) == {"COMPLETE"} and tune["parts"]["conversions"] == 1
    assert tune["parts"]["trial_s"] > 0 and tune["parts"]["train_alone_s"] > 0
    assert tune["parts"]["study_one_off_s"]["register_best"] > 0  # apart from the per-trial figure
    assert "tune_overhead/sample/from_parts" in report["ratios"]  # the same ratio from the directly measured parts

    restart = next(r for r in report["results"] if r["name"] == "restart_cost")
    assert restart["dataset"] == "sample" and [h[-1] for h in restart["parts"]["restarts_per_run_with_failure"]] == [1]
    assert restart["parts"]["with_failure_s"] > 0 and restart["parts"]["epoch_s"] > 0
    assert restart["parts"]["dropped_pairs"] == {} and restart["repeats"] == 1
    assert restart["parts"]["process_start_s"] > 0
    predict = {r["dataset"]: r["parts"] for r in report["results"] if r["name"] == "predict_throughput"}
    assert set(predict) == {"sample", "synthetic"}
    assert predict["synthetic"]["rows"] == 2000 and predict["sample"]["rows"] == report["datasets"]["sample"]["rows"]
    assert all(p["predict_rows_per_s"] > 0 and p["pyfunc_rows_per_s"] > 0 for p in predict.values())
    # the Spark job that scores nothing is a part of predict's time, measured on the same rows
    assert all(0 < p["spark_job_floor_s"] for p in predict.values())
    assert not list((tmp_path / "bench").glob("predict_*"))  # its scratch tables are removed
    # a 2-rank `lakehouse train` per backend, phase by phase: the phases add up to the process's wall time
    phases = {r["variant"]: r["parts"] for r in report["results"] if r["name"] == "job_fixed_cost"}
    assert set(phases) == {"horovod", "ddp"}
    from bench.job_phases import PHASES
    for parts in phases.values():
        assert all(parts[k] >= 0 for k in PHASES) and parts["epochs_s"] > 0 and parts["rank_start_s"] > 0, parts
        assert sum(parts[k] for k in PHASES) == pytest.approx(parts["wall_s"], rel=0.01), parts
    assert not (tmp_path / "bench" / "job_phases").exists()  # its scratch folder is removed
    # train.early_start on / off side by side (--quick: the direct source, one round): the phases before the first
    # step of both, the ratio theirs
    early = {r["variant"]: r for r in report["results"] if r["name"] == "early_start_before_first_step"}
    assert set(early) == {"horovod/direct", "ddp/direct"}
    for r in early.values():
        p = r["parts"]
        assert p["before_first_step_on_s"] > 0 and p["before_first_step_off_s"] > 0 and p["data_source"] == "direct"
        assert r["ratio"] == pytest.approx(p["before_first_step_on_s"] / p["before_first_step_off_s"], rel=0.01)
        assert sum(p["phases_on"][k] for k in PHASES[:4]) == pytest.approx(p["before_first_step_on_s"], rel=0.05)
    assert not list((tmp_path / "bench").glob("early_*"))
    # Horovod's steady epoch over DDP's, on the synthetic table's longer epochs: one job per backend in --quick
    parity = [r for r in report["results"] if r["name"] == "horovod_epoch_over_ddp"]
    assert [p["dataset"] for p in parity] == ["synthetic"]
    parts = parity[0]["parts"]
    assert parts["horovod_epoch_s"] > 0 and parts["ddp_epoch_s"] > 0 and parts["batch_per_rank"] == 32
    assert parity[0]["ratio"] == pytest.approx(parts["horovod_epoch_s"] / parts["ddp_epoch_s"], rel=0.01)
    assert not (tmp_path / "bench" / "epoch_parity").exists()
    # data.source=direct beside converted: on the sample against a first run and a warm cache, on the synthetic table
    # against a first run with the ranks' peak memory and the reader over every row; direct writes nothing
    direct = {(r["name"], r["dataset"], r["variant"]): r["parts"] for r in report["results"]
              if r["name"].startswith("direct_")}
    assert set(direct) == {("direct_wall", "sample", "vs_first"), ("direct_wall", "sample", "vs_warm"),
                           ("direct_before_first_step", "sample", "vs_first"),
                           ("direct_before_first_step", "sample", "vs_warm"),
                           ("direct_wall", "synthetic", "vs_first"),
                           ("direct_before_first_step", "synthetic", "vs_first"),
                           ("direct_rank_memory", "synthetic", "vs_first"),
                           ("direct_reader_over_pyarrow", "synthetic", "")}
    for dataset in ("sample", "synthetic"):
        first = direct[("direct_wall", dataset, "vs_first")]
        assert first["direct_extra_disk_bytes"] == 0 < first["converted_first_extra_disk_bytes"], first
    assert direct[("direct_wall", "synthetic", "vs_first")]["rows"] == 2000  # --quick: the quick synthetic table
    # --quick: one round, the direct job first (its place rotates from round to round)
    assert direct[("direct_wall", "sample", "vs_warm")]["order_per_round"] == [
        ["direct", "converted_first", "converted_warm"]]
    assert direct[("direct_wall", "synthetic", "vs_first")]["order_per_round"] == [["direct", "converted_first"]]
    memory = direct[("direct_rank_memory", "synthetic", "vs_first")]
    assert all(len(p) == 2 and min(p) > 0 for p in memory["direct_rank_peak_rss_mb"] +
               memory["converted_first_rank_peak_rss_mb"]), memory
    assert direct[("direct_reader_over_pyarrow", "synthetic", "")]["rows"] == 2000

    # everything it wrote stayed under tmp: the sample table was ingested there, the synthetic one beside it
    assert (tmp_path / "delta" / "digits" / "_delta_log").is_dir()
    assert any(p.name.startswith("bench_synthetic_") for p in (tmp_path / "delta").iterdir())
    assert not list((tmp_path / "checkpoints").glob("bench/*/*.ckpt"))  # the bench's checkpoints are removed
    # the bench converted into its own cache, removed at the end; the user's (data.cache_dir) got nothing
    assert not (tmp_path / "bench" / "cache").exists() and not (tmp_path / "bench" / "tune").exists()
    assert not [p for p in (tmp_path / "petastorm_cache").glob("*") if p.is_dir()]


@pytest.mark.timeout(600)
def test_bench_photo_decode_quick(tmp_path: Path):
    """`lakehouse bench --only photo_decode --quick`: phone-sized JPEGs' crops decoded at a reduced JPEG scale
    against full size in one run, without Spark or a table; the pixels moved a level or two at most on average."""
    out = tmp_path / "bench" / "bench.json"
    proc = subprocess.run(
        cli("bench", "--quick", "--only", "photo_decode", "--out", str(out), "--conf", str(ROOT / "conf/local.yaml"),
            f"train.checkpoint_dir={tmp_path}/checkpoints", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            f"mlflow.artifact_location={tmp_path}/mlartifacts"),
        cwd=str(ROOT), capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["only"] == ["photo_decode"] and report["datasets"] == {}
    r, per_core, every = report["results"]
    p = r["parts"]
    assert r["name"] == "cpu_decode_large_photo_speedup" and r["dataset"] == "photos_4032x3024"
    assert r["repeats"] == 2 and len(r["per_repeat"]) == 2 and math.isfinite(r["ratio"]) and r["ratio"] > 0
    assert r["target"] == 1.3 and r["op"] == ">="
    assert p["photos"] == 4 and p["crops"] == 8 and p["draft_images_per_s"] > 0 and p["full_decode_images_per_s"] > 0
    assert set(p["scales_taken"]) <= {"1", "2", "4", "8"} and p["scales_taken"].get("4", 0) >= 4  # the val crops
    assert 0 < p["pixels_mean_abs_diff"] < 1.5, p
    # ImageNet-shaped JPEGs through the rank's decoder, 1 worker and one per core, against Pillow on one core
    p = per_core["parts"]
    assert per_core["name"] == "cpu_photos_decode_per_core" and per_core["dataset"] == "photos_imagenet_shaped"
    assert per_core["target"] == 0.9 and per_core["op"] == ">=" and len(per_core["per_repeat"]) == 2
    assert p["photos"] == 128 and p["pillow_one_core_images_per_s"] > 0
    assert set(p["decoder"]) == {"1", str(p["cores"])}, p
    assert all(d["images_per_s"] > 0 and d["per_core_over_pillow"] > 0 for d in p["decoder"].values())
    assert per_core["ratio"] == p["decoder"][str(p["cores"])]["per_core_over_pillow"]
    # the same decoder against Pillow run on every core at once: the host's own scaling beside it
    assert p["pillow_every_core_images_per_s"] > 0 and p["pillow_every_core_per_core_over_one"] > 0
    assert every["name"] == "cpu_photos_decode_over_pillow_every_core" and every["target"] == 0.9
    assert len(every["per_repeat"]) == 2 and every["parts"]["cores"] == p["cores"]
    assert every["parts"]["decoder_images_per_s"] == p["decoder"][str(p["cores"])]["images_per_s"]
    assert every["ratio"] > 0 and math.isfinite(every["ratio"])


@pytest.mark.timeout(600)
def test_conversion_measurement_leaves_the_users_cache_entry(spark, digits_table, tmp_path: Path):
    """The bench converts into its own cache: the user's entry of the same table, under the very key the bench
    deletes and rewrites on every repeat, is still there afterwards, untouched."""
    from bench.conversion import bench_cache_dir, measure_conversion, remove_bench_cache
    from bench.core import QUICK
    from pipeline.data.cache import list_entries, read_manifest, remove_entry
    from pipeline.workflow import prepare_data

    cfg = make_config(tmp_path, f"delta.table={digits_table}", f"data.cache_dir={tmp_path}/user_cache")
    data, _ = prepare_data(spark, cfg)  # the user's conversion, for 2 ranks as the bench's
    before = read_manifest(data.entry_url)
    assert before is not None and [e["key"] for e in list_entries(cfg.data.cache_dir)] == [data.key]
    work = tmp_path / "bench"
    prep, results = measure_conversion(spark, cfg, "sample", str(digits_table), dataclasses.replace(QUICK, repeats=1),
                                       str(work))
    try:
        assert prep.data.key == data.key  # the same content key: only the cache folder tells them apart
        assert prep.data.entry_url.startswith("file://" + bench_cache_dir(cfg, str(work)))
        assert {r.name for r in results} == {"conversion_vs_plain_write", "conversion_cache_hit"}
    finally:
        remove_entry(prep.data.entry_url)
        remove_bench_cache(cfg, str(work))
    assert read_manifest(data.entry_url) == before  # neither deleted nor rewritten
    assert [e["key"] for e in list_entries(cfg.data.cache_dir)] == [data.key]
    assert not (work / "cache").exists()
