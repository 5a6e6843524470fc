"""bench/step_profile.py's pure parts: where a profiled function's time is counted, the functions that differ most
between train() and the plain loop, and the file each rank writes."""
from __future__ import annotations

from bench.step_profile import difference, rank_path, where


def test_functions_are_counted_where_their_code_lives():
    assert where("~") == "builtins"
    assert where("/v/site-packages/pytorch_lightning/loops/fit_loop.py") == "lightning"
    assert where("/v/site-packages/lightning_fabric/utilities/apply_func.py") == "lightning"
    assert where("/v/site-packages/torch/nn/modules/module.py") == "torch"
    assert where("/v/site-packages/horovod/torch/optimizer.py") == "horovod"
    assert where("/work/main/pipeline/model/module.py") == "project"
    assert where("/usr/lib/python3.11/inspect.py") == "python"


def test_the_largest_differences_come_first_and_a_function_on_one_side_only_counts_in_full():
    train = {"functions": {"a": (1.0, 0.50), "b": (2.0, 0.10), "only_train": (13.0, 0.30)}}
    plain = {"functions": {"a": (1.0, 0.45), "b": (2.0, 0.40), "only_plain": (1.0, 0.05)}}
    rows = difference(train, plain, top=3)
    assert [r["function"] for r in rows] == ["only_train", "a", "only_plain"]
    assert rows[0] == {"function": "only_train", "train_ms": 0.3, "plain_ms": 0, "train_calls": 13.0}
    assert rows[1]["train_ms"] - rows[1]["plain_ms"] == 0.5 - 0.45


def test_each_rank_of_a_job_writes_its_own_file():
    assert rank_path("step_profile.json", 0, 1) == "step_profile.json"
    assert rank_path("out/p.json", 1, 2) == "out/p.rank1.json"
    assert rank_path("out/p", 0, 2) == "out/p.rank0.json"
