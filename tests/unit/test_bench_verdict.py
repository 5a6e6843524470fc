"""The bench report's verdict: `all_passed` and `complete` against failed parts, NaN figures, skipped parts (asked for
by name or only implied) and an empty result list; `lakehouse bench --gpu`'s report when its photo part fails."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from bench.core import VERDICT_RULE, Result, verdict
from pipeline.config import Config


def _ok(name="loader_efficiency", ratio=0.95, dataset="sample"):
    return Result(name, dataset, ratio, {"reader": "arrow"}, 1, [ratio])


def test_every_figure_passed_and_nothing_failed():
    v = verdict([_ok()], {"cross_host": "no multi-host cluster is up"}, {}, explicit=())
    assert v == {"all_passed": True, "complete": True, "failed": {}}  # skipped, only implied: does not count


def test_no_figure_at_all_is_neither_passed_nor_complete():
    assert verdict([], {}, {}, explicit=()) == {"all_passed": False, "complete": False, "failed": {}}


def test_a_part_that_failed_or_gave_nothing_fails_the_verdict():
    v = verdict([_ok()], {}, {"step_overhead": "yielded no figure"}, explicit=())
    assert v["failed"] == {"step_overhead": "yielded no figure"} and not v["all_passed"] and not v["complete"]


def test_a_nan_figure_is_failed_with_its_note():
    nan = Result("step_overhead_ms", "tiny_cnn_16px", float("nan"), {}, 0, [], variant="ddp/np2",
                 note="not measured: the job failed: RuntimeError: boom")
    v = verdict([_ok(), nan], {}, {}, explicit=("step_overhead",))
    assert v["failed"] == {"step_overhead_ms/tiny_cnn_16px/ddp/np2": "not measured: the job failed: RuntimeError: boom"}
    assert not v["all_passed"] and not v["complete"]


def test_a_skipped_part_counts_only_when_asked_for_by_name():
    skipped = {"gpu": "torch 2.x sees no CUDA device (CUDA build: none)"}
    assert verdict([_ok()], skipped, {}, explicit=())["all_passed"]  # `lakehouse bench` on a CPU machine
    named = verdict([_ok()], skipped, {}, explicit=("gpu", "loader"))  # `--only gpu,loader`
    assert not named["all_passed"] and not named["complete"]
    # a figure a part leaves out (keyed by the figure, not a part) never counts
    assert verdict([_ok()], {"gpu_photos_images_per_s/photos/timm/resnet50/decode=cpu": "by design"}, {},
                   explicit=("photos",))["all_passed"]


def test_a_miss_is_complete_but_not_passed():
    v = verdict([_ok(), _ok(ratio=0.5, dataset="synthetic")], {}, {}, explicit=())
    assert v["complete"] and not v["all_passed"]
    assert "all_passed" in VERDICT_RULE and "complete" in VERDICT_RULE and "--only" in VERDICT_RULE


@pytest.fixture
def photos_on_cpu(monkeypatch):
    """`bench --gpu --only photos` on this CPU machine (the test-only switch), reading with the arrow reader."""
    from bench import photos_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(photos_gpu.ON_CPU_ENV, "1")
    return dataclasses.replace(Config(), data=dataclasses.replace(Config().data, reader="arrow"))


def _gpu_bench(cfg, tmp_path):
    from bench.gpu import run_gpu_bench

    out = tmp_path / "gpu.json"
    report = run_gpu_bench(cfg, str(out), quick=True, rows=64, only=["photos"])
    assert json.loads(out.read_text())["complete"] == report["complete"]
    return report


def test_gpu_bench_whose_photo_part_raised_is_not_complete(photos_on_cpu, tmp_path, monkeypatch):
    from bench import photos_gpu

    def boom(*a, **kw):
        raise RuntimeError("nvJPEG exploded")

    monkeypatch.setattr(photos_gpu, "measure_photos", boom)
    report = _gpu_bench(photos_on_cpu, tmp_path)
    assert report["failed"] == {"photos": "RuntimeError: nvJPEG exploded"}
    assert report["photos"]["failed"] == "RuntimeError: nvJPEG exploded"
    assert report["finished"] and not report["complete"] and not report["all_passed"]
    assert report["verdict_rule"] == VERDICT_RULE


def test_gpu_bench_whose_photo_part_gave_nothing_is_not_complete(photos_on_cpu, tmp_path, monkeypatch):
    from bench import photos_gpu

    monkeypatch.setattr(photos_gpu, "measure_photos",
                        lambda *a, **kw: ([], {"errors": {"data": "OSError: disk full"}}))
    report = _gpu_bench(photos_on_cpu, tmp_path)
    assert "disk full" in report["failed"]["photos"] and not report["complete"] and not report["all_passed"]


def test_gpu_bench_lists_the_figures_a_part_left_out_and_passes(photos_on_cpu, tmp_path, monkeypatch):
    from bench import photos_gpu

    ok = Result("gpu_photos_cpu_decode_per_core", "photos", 1.0, {"workers": 2}, 1, [1.0])
    left_out = {"gpu_photos_loader_images_per_s/photos/decode=gpu": "no CUDA device is visible"}
    monkeypatch.setattr(photos_gpu, "measure_photos", lambda *a, **kw: ([ok], {"skipped": left_out}))
    report = _gpu_bench(photos_on_cpu, tmp_path)
    assert report["skipped"] == left_out and report["failed"] == {}
    assert report["complete"] and report["all_passed"] and not math.isnan(report["ratios"][ok.key])


@pytest.fixture
def fake_bench(monkeypatch):
    """run_bench with Spark, the data sets, the conversion, the MLflow run and the timed jobs replaced: what runs
    in which order, and the report's verdict."""
    import contextlib
    from types import SimpleNamespace

    from bench import conversion, datasets, gpu, input_bound, scaling
    from pipeline.data import cache
    from pipeline.lakehouse import spark
    from pipeline.tracking import runs

    calls = []

    def convert(spark, cfg, name, table, sizes, work_dir):
        calls.append(("conversion", name))
        prep = SimpleNamespace(name=name, rows=10, table=table, data=SimpleNamespace(entry_url=f"file:///x/{name}"),
                               info=lambda: {"rows": 10})
        return prep, [Result("conversion_cache_hit", name, 0.01, {}, 1, [0.01])]

    monkeypatch.setattr(spark, "spark_session", lambda cfg: contextlib.nullcontext("spark"))
    monkeypatch.setattr(datasets, "ensure_sample", lambda spark, cfg, work_dir: None)
    monkeypatch.setattr(datasets, "ensure_synthetic", lambda spark, cfg, rows: {"table": "synthetic_table"})
    monkeypatch.setattr(conversion, "measure_conversion", convert)
    monkeypatch.setattr(conversion, "remove_bench_cache", lambda cfg, work_dir: None)
    monkeypatch.setattr(cache, "remove_entry", lambda url: None)
    monkeypatch.setattr(runs, "tracked_run", lambda *a, **kw: contextlib.nullcontext(SimpleNamespace(run_id="r")))
    monkeypatch.setattr(input_bound, "one_rank_job",
                        lambda cfg, prep, sizes: calls.append(("one_rank_job", prep.name)) or f"job of {prep.name}")
    figures = {"scaling": [Result("horovod_cpu_scaling", "synthetic", 1.9, {}, 1, [1.9])]}
    monkeypatch.setattr(scaling, "measure_horovod_scaling",
                        lambda cfg, prep, sizes, job: calls.append(("scaling", prep.name, job)) or figures["scaling"])
    monkeypatch.setattr(gpu, "cuda_problem", lambda: "torch sees no CUDA device")
    return calls, figures


def test_run_bench_scales_right_after_the_one_rank_job_and_a_named_skipped_part_fails_the_verdict(fake_bench,
                                                                                                   tmp_path):
    from bench import run_bench

    calls, _ = fake_bench
    report = run_bench(Config(), quick=True, out=str(tmp_path / "b.json"), only=["scaling", "gpu"])
    assert calls == [("conversion", "sample"), ("conversion", "synthetic"), ("one_rank_job", "synthetic"),
                     ("scaling", "synthetic", "job of synthetic")]
    assert report["skipped"] == {"gpu": "torch sees no CUDA device"} and report["failed"] == {}
    assert not report["all_passed"] and not report["complete"]  # --only gpu on a machine without CUDA
    assert set(report["measurement_s"]) == {"conversion", "input_bound", "scaling", "gpu"}
    assert json.loads((tmp_path / "b.json").read_text())["all_passed"] is False


def test_run_bench_passes_when_every_part_asked_for_passed(fake_bench, tmp_path):
    from bench import run_bench

    report = run_bench(Config(), quick=True, out=str(tmp_path / "b.json"), only=["scaling"])
    assert report["all_passed"] and report["complete"] and report["skipped"] == {} and report["failed"] == {}


def test_run_bench_part_that_gives_no_figure_is_failed(fake_bench, tmp_path):
    from bench import run_bench

    _, figures = fake_bench
    figures["scaling"] = []
    report = run_bench(Config(), quick=True, out=str(tmp_path / "b.json"), only=["scaling"])
    assert report["failed"] == {"scaling": "yielded no figure"} and not report["all_passed"] and not report["complete"]
