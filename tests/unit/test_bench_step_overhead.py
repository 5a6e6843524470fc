"""The step-overhead bench's arithmetic: ms per step from the slowest rank, train() minus the plain loop window by
window, the warm-up (a compilation) counted over whole runs, and the Result each job gives."""
from __future__ import annotations

import pytest

from bench.step_overhead import (RUNS, counted_overhead_ms, mean_step_ms, overhead_per_window,
                                 overhead_result, result_name, run_total, step_ms)


def _rank(windows, steps=100, warmup_s=0.5, cpu=None):
    return {"window_s": windows, "steps": steps, "warmup_s": warmup_s, "batch_size": 16, "precision": "32-true",
            "main_thread_cpu_s": cpu or windows, "cpu_s": [2 * c for c in cpu or windows]}


def test_step_ms_takes_the_slowest_rank_per_window():
    assert step_ms([_rank([0.2, 0.3]), _rank([0.25, 0.1])]) == pytest.approx([2.5, 3.0])


def test_overhead_is_train_minus_plain_per_window_over_the_mean_of_runs():
    train = [[_rank([0.30, 0.40])], [_rank([0.34, 0.36])]]  # 3.2 and 3.8 ms mean per window
    plain = [[_rank([0.25, 0.25])], [_rank([0.27, 0.29])]]  # 2.6 and 2.7
    assert mean_step_ms(train) == pytest.approx([3.2, 3.8])
    assert overhead_per_window(train, plain) == pytest.approx([0.6, 1.1])
    assert overhead_per_window(plain, train) == pytest.approx([-0.6, -1.1])  # a faster train() comes out negative


def test_the_warm_up_is_counted_over_whole_runs():
    # one run: 10 warm-up steps then 2 windows of 100 steps
    assert run_total([_rank([0.2, 0.2], warmup_s=3.0), _rank([0.25, 0.1], warmup_s=1.0)], warmup=10) == (
        pytest.approx(3.4), 210)
    train = [[_rank([0.2, 0.2], warmup_s=2.1)]]  # a compiling warm-up: 2.1 s
    plain = [[_rank([0.2, 0.2], warmup_s=0.0)]]
    # same steady speed, 2.1 s more in 210 steps: 10 ms per step counted
    assert counted_overhead_ms(train, plain, warmup=10) == pytest.approx(10.0)


def test_a_job_gives_one_result_named_by_device_with_the_backend_and_world_in_its_key():
    job = []
    for rank in range(2):
        runs = []
        for kind in RUNS:
            w = {"warmup": [0.5], "plain": [0.20, 0.22], "train": [0.21, 0.23]}[kind]
            runs.append({"kind": kind, **_rank(w)})
        job.append({"rank": rank, "runs": runs})
    cpu = overhead_result("horovod", 2, job, "cpu", warmup=10)
    assert cpu.name == "step_overhead_ms" and cpu.key == "step_overhead_ms/tiny_cnn_16px/horovod/np2"
    assert cpu.per_repeat == pytest.approx([0.1, 0.1]) and cpu.ratio == pytest.approx(0.1)
    assert cpu.passed and cpu.target == 0.5 and cpu.op == "<="
    assert cpu.parts["train_ms_per_step"] == pytest.approx(2.2) and cpu.parts["plain_ms_per_step"] == pytest.approx(2.1)
    assert cpu.parts["cpu_overhead_ms"] == pytest.approx(0.2)  # from the processes' CPU time (here 2x the wall)
    assert step_ms([_rank([0.2], cpu=[0.1]), _rank([0.1], cpu=[0.3])], "cpu_s") == pytest.approx([6.0])
    gpu = overhead_result("ddp", 1, job, "cuda", warmup=10, compiled=True)
    assert gpu.name == result_name("cuda") == "gpu_step_overhead_ms" and gpu.target == 0.25
    assert gpu.key.endswith("ddp/np1/compile") and gpu.ratio == gpu.parts["overhead_ms_with_warmup_counted"]


def test_a_job_that_raises_gives_a_nan_figure_with_its_error(tmp_path, monkeypatch):
    """Every job failing (`--only step_overhead`) leaves one NaN figure per job, not an empty result list."""
    import math

    from bench import step_overhead
    from bench.core import QUICK
    from pipeline.config import Config

    def failing(cfg, data, backend, world, warmups, steps, windows):
        raise RuntimeError(f"{backend} np{world}: rank 1 exited with code 1\ntraceback ...")

    monkeypatch.setattr(step_overhead, "launch", failing)
    monkeypatch.setattr(step_overhead, "placeable_worlds", lambda worlds: list(worlds))
    results = step_overhead.measure_step_overhead(Config(), QUICK, str(tmp_path), quick=True)
    assert {r.variant for r in results} == {"horovod/np1", "horovod/np2", "ddp/np1", "ddp/np2"}
    for r in results:
        assert math.isnan(r.ratio) and not r.passed and r.repeats == 0 and r.per_repeat == []
        assert r.name == result_name("cpu") or r.name == result_name("cuda")
        assert "RuntimeError" in r.note and "rank 1 exited" in r.note and "traceback" not in r.note
        assert r.parts["backend"] == r.variant.split("/")[0] and r.parts["world_size"] == int(r.variant[-1])
    assert not list(tmp_path.glob("step_overhead_*"))  # its scratch data set is removed
    compiled = step_overhead.failed_result("ddp", 2, "cuda", "OSError: x", compiled=True)
    assert compiled.key == "gpu_step_overhead_ms/tiny_cnn_16px/ddp/np2/compile" and compiled.parts["compile"]
