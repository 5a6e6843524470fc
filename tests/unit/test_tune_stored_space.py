"""A study's stored search space on resume: a range off its step grid, which the space check refuses since today,
only warns there (the study began with it and its trials keep drawing from it); a new space is still refused."""
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.tune.space import space_from_text

OFF_GRID = "params:\n  train.max_epochs: {type: int, low: 1, high: 4, step: 2}\n"


def test_a_new_space_off_its_grid_is_refused():
    with pytest.raises(ConfigError, match="not 'low'"):
        space_from_text(OFF_GRID, load_config(None), "new.yaml")


def test_a_studys_stored_space_off_its_grid_resumes_with_a_warning(caplog):
    space = space_from_text(OFF_GRID, load_config(None), "(study s)", stored=True)
    assert list(space.params) == ["train.max_epochs"]
    assert "the study began with this space" in caplog.text and "(study s)" in caplog.text
