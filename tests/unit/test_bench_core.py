"""Unit tests of the bench's pure parts: ratios, verdicts, keys, windows, the reader choice."""
from __future__ import annotations

import math

import pytest

from bench import loaders_side_by_side
from bench.core import Result, input_bound_fraction, ratio, windows_rate
from bench.lightning_path import MemoryLoader, step_windows
from bench.loader import available_readers, configured_reader, with_reader
from pipeline.config import Config


def test_result_verdict_spread_and_key():
    r = Result("loader_efficiency", "sample", 0.95, {"reader": "arrow"}, 3, [0.9, 0.95, 1.0])
    assert r.passed and r.op == ">=" and r.target == 0.9
    assert r.spread["min"] == 0.9 and r.spread["max"] == 1.0 and r.spread["rel"] == pytest.approx(0.1 / 0.95)
    assert r.key == "loader_efficiency/sample"
    low = Result("input_bound_fraction", "synthetic", 0.2, {}, 1, [0.2], variant="bf16-mixed")
    assert not low.passed and low.key == "input_bound_fraction/synthetic/bf16-mixed"
    with pytest.raises(KeyError):
        Result("no_such_ratio", "sample", 1.0, {}, 1, [1.0])


def test_ratio_and_input_bound_fraction():
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(1.0, float("nan")))
    assert input_bound_fraction(0.030, 0.040) == pytest.approx(0.25)
    assert input_bound_fraction(0.040, 0.040) == 0.0
    assert input_bound_fraction(0.050, 0.040) < 0  # the in-memory stretch was the slower one: noise, not input


def test_windows_rate_uses_the_slowest_rank():
    ranks = [{"batch_size": 32, "steps": 10, "window_s": [1.0, 2.0]},
             {"batch_size": 32, "steps": 10, "window_s": [0.5, 4.0]}]
    assert windows_rate(ranks, 0) == pytest.approx(640 / 1.0)
    assert windows_rate(ranks, 1) == pytest.approx(640 / 4.0)


def test_step_windows_drops_epoch_boundaries_and_warmup():
    # (epoch, wall, process cpu, thread cpu) at each training_step start; epoch 0 has 4 steps, epoch 1 has 4
    stamps = [(0, t, t / 2, t / 4) for t in (0.0, 1.0, 2.0, 3.0)] + [(1, t, t / 2, t / 4) for t in (10.0, 12.0, 14.0, 16.0)]
    # intervals inside epochs: 1, 1, 1, (boundary 7 dropped), 2, 2, 2
    out = step_windows(stamps, warmup=1, steps=2, windows=2)
    assert out["window_s"] == [2.0, 4.0]  # [1, 1], [2, 2]
    assert out["cpu_s"] == [1.0, 2.0] and out["main_thread_cpu_s"] == [0.5, 1.0]
    with pytest.raises(RuntimeError, match="needed"):
        step_windows(stamps, warmup=1, steps=3, windows=2)


def test_memory_loader_serves_planned_steps_in_turn():
    batches = [("x0", [0, 1]), ("x1", [2, 3]), ("x2", [4, 5])]
    loader = MemoryLoader(batches, steps=2)
    assert len(loader) == 2
    assert [x for x, _ in loader] == ["x0", "x1"]
    assert [x for x, _ in loader] == ["x2", "x0"]  # the next pass continues
    assert loader.rows_read == 4 and loader.wait_s == 0.0


def test_readers_configured_first_and_cfg_rewritten():
    cfg = Config()
    readers = available_readers(cfg)
    assert readers and readers[0] == configured_reader(cfg) and set(readers) <= {"petastorm", "arrow"}
    assert "arrow" in readers  # pyarrow is in every profile
    arrow_first = with_reader(cfg, "arrow", memory_cache_mb=0)
    assert arrow_first.data.reader == "arrow" and arrow_first.data.memory_cache_mb == 0
    assert cfg.data.memory_cache_mb != 0  # the original is left alone
    assert available_readers(arrow_first)[0] == "arrow"


def test_loaders_side_by_side():
    rs = [Result("loader_efficiency", "sample", 1.2, {"reader": "petastorm"}, 1, [1.2]),
          Result("loader_efficiency_uncached", "sample", 0.6, {"reader": "petastorm"}, 1, [0.6]),
          Result("loader_efficiency", "sample", 1.5, {"reader": "arrow"}, 1, [1.5], variant="arrow"),
          Result("shard_balance", "sample", 1.0, {}, 1, [1.0])]
    assert loaders_side_by_side(rs) == {"sample": {"petastorm": {"cached": 1.2, "uncached": 0.6},
                                                   "arrow": {"cached": 1.5}}}


def test_memory_batches_gather_rows_across_small_row_groups(tmp_path):
    """Row groups smaller than a batch (a small table over many ranks) still give full batches, in file order."""
    from types import SimpleNamespace

    import pyarrow as pa
    import torch
    import pyarrow.parquet as pq

    from bench.reference import memory_batch_list

    rows = 50
    pixels = [bytes([i % 256]) * 4 for i in range(rows)]  # 1 channel, 2x2
    table = pa.table({"pixels": pa.array(pixels, pa.binary()), "label_index": pa.array(range(rows), pa.int32())})
    path = tmp_path / "part-0.parquet"
    pq.write_table(table, path, row_group_size=7)
    split = SimpleNamespace(file_urls=[f"file://{path}"], cache_dir_url=f"file://{tmp_path}")
    data = SimpleNamespace(train=split, channels=1, image_size=2, plan=SimpleNamespace(train=SimpleNamespace(batch_size=16)))
    batches = memory_batch_list(data, count=8)
    assert len(batches) == 3  # 50 rows: three full batches of 16, the rest dropped
    assert [b[1].tolist() for b in batches] == [list(range(i * 16, (i + 1) * 16)) for i in range(3)]
    assert tuple(batches[0][0].shape) == (16, 1, 2, 2) and batches[0][0].dtype == torch.float32
    with pytest.raises(ValueError, match="full batch of 64"):
        memory_batch_list(data, batch_size=64)


def _exit_with(code):
    import sys

    sys.exit(code)


def test_control_processes_that_die_are_an_error_not_a_wait():
    import multiprocessing as mp
    import time

    from bench.reference import _collect

    ctx = mp.get_context("spawn")
    worker = ctx.Process(target=_exit_with, args=(3,))
    worker.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"pid {worker.pid} exited with code 3"):
        _collect(ctx.Queue(), [worker], timeout_s=600)
    assert time.monotonic() - t0 < 60
    worker.join()


def test_bench_only_names_unknown_measurements_before_any_work():
    from bench import MEASUREMENTS, run_bench
    from pipeline.config import Config, ConfigError

    assert "loader" in MEASUREMENTS and "restart_cost" in MEASUREMENTS
    with pytest.raises(ConfigError, match="unknown measurement.*loaders.*choose from loader"):
        run_bench(Config(), only=["loaders"], out="/nonexistent/bench.json")


def test_the_direct_pyfunc_calls_of_predict_throughput_stay_within_the_row_limit():
    """The full bench scores 50,000 rows directly; the model refuses more than its limit in one call (the serving
    bound), so the bench sends them as a client must: every row once, no call over the limit."""
    import pandas as pd

    from bench.predict_throughput import score_directly

    class Limited:
        calls = []

        def predict(self, frame, params=None):
            if len(frame) > 4:
                raise ValueError(f"{len(frame)} rows in one call, over the limit of 4")
            self.calls.append(list(frame["content"]))
            return frame.assign(label="x")

    frame = pd.DataFrame({"content": list(range(11))})
    model = Limited()
    assert score_directly(model, frame, 4) == 11
    assert [len(c) for c in model.calls] == [4, 4, 3]
    assert sum(model.calls, []) == list(range(11))
    with pytest.raises(ValueError, match="over the limit"):
        score_directly(model, frame, 5)
