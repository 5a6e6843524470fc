"""Unit tests of the GPU measurement's pure parts, on CPU: precisions, autocast, batch size, ratios and fractions."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.gpu import MIN_BATCH, PRECISIONS, gpu_batch_size, gpu_results, installed_reader
from bench.jobs import autocast_dtype
from pipeline.config import Config, ConfigError


def test_autocast_dtype_per_precision():
    assert autocast_dtype("32-true") is None and autocast_dtype(None) is None
    assert autocast_dtype("bf16-mixed") is torch.bfloat16
    assert autocast_dtype("16-mixed") is torch.float16
    with pytest.raises(ValueError, match="precision"):
        autocast_dtype("64-true")


def test_gpu_batch_is_at_least_256():
    cfg = Config()
    assert gpu_batch_size(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=32))) == MIN_BATCH
    assert gpu_batch_size(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=512))) == 512


def test_every_precision_is_a_config_choice():
    from pipeline.config import CHOICES

    assert set(PRECISIONS) <= set(CHOICES["train.precision"]) and "32-true" in PRECISIONS


def test_gpu_results_ratio_and_input_bound_fraction():
    figures = {"32-true": {"plain": [1000.0, 1000.0], "memory": [900.0, 800.0], "loader": [900.0, 400.0]},
               "bf16-mixed": {"plain": [2000.0], "memory": [1500.0], "loader": [1500.0]}}
    results, per_dev = gpu_results("synthetic", figures)
    by_key = {r.key: r for r in results}
    fp32 = by_key["gpu_lightning_over_plain/synthetic/32-true"]
    assert fp32.per_repeat == [0.9, 0.8] and fp32.ratio == pytest.approx(0.85) and fp32.passed
    bound = by_key["gpu_input_bound_fraction/synthetic/32-true"]
    # step time in memory 1/900 vs with the loader 1/900 -> 0; 1/800 vs 1/400 -> 0.5
    assert bound.per_repeat == pytest.approx([0.0, 0.5]) and not bound.passed
    bf16 = by_key["gpu_lightning_over_plain/synthetic/bf16-mixed"]
    assert bf16.ratio == pytest.approx(0.75) and not bf16.passed
    assert by_key["gpu_input_bound_fraction/synthetic/bf16-mixed"].ratio == pytest.approx(0.0)
    assert per_dev["bf16-mixed"]["images_per_s_per_gpu_plain_loop"] == 2000.0
    assert per_dev["32-true"]["lightning_over_plain"] == pytest.approx(0.85)


def _runs(missing):
    """A stand-in for the install: the readers in `missing` cannot run, with require_reader's kind of message."""
    return lambda name: (f"config key 'data.reader' is {name!r} but it is not installed" if name in missing else None)


def test_gpu_figures_read_with_the_configured_reader_where_it_runs():
    assert installed_reader("petastorm", _runs(set())) == ("petastorm", None)
    assert installed_reader("arrow", _runs({"petastorm"})) == ("arrow", None)


def test_gpu_figures_fall_back_to_arrow_on_an_image_without_petastorm():
    reader, why = installed_reader("petastorm", _runs({"petastorm"}))
    assert reader == "arrow"
    assert "data.reader=petastorm" in why and "data.reader=arrow" in why and "not installed" in why


def test_gpu_figures_refuse_a_reader_that_cannot_run_naming_the_key():
    with pytest.raises(ConfigError, match="data.reader"):
        installed_reader("arrow", _runs({"arrow"}))
    with pytest.raises(ConfigError, match="data.reader"):  # no arrow to fall back to either
        installed_reader("petastorm", _runs({"petastorm", "arrow"}))
