"""Which world sizes the step-overhead bench measures: every one on a CPU, at most one rank per GPU."""
from bench.step_overhead import placeable_worlds


def test_world_sizes_are_bounded_by_the_gpus_and_free_on_a_cpu():
    assert placeable_worlds((1, 2), gpus=0) == [1, 2]
    assert placeable_worlds((1, 2), gpus=1) == [1]
    assert placeable_worlds((1, 2), gpus=8) == [1, 2]
