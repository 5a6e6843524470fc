"""The job folder's layout: what ranks write, what the driver reads back, in one place."""
import os

import pytest

from pipeline.distributed.job_folder import OFFLINE_RUN, JobFolder


def test_markers_written_by_ranks_are_read_back_by_rank(tmp_path):
    folder = JobFolder.of_run(str(tmp_path / "ckpt"), "run1")
    assert folder.path == os.path.join(str(tmp_path / "ckpt"), ".job", "run1")
    folder.write(0, "started", "hostA 11")
    folder.write(1, "started", "hostB 12")
    folder.write(1, "error", "ValueError: bad\n\nTraceback ...")
    folder.write(1, "class", "builtins.ValueError\nbuiltins.Exception\n")
    folder.write(0, "done")
    assert sorted(folder.ranks_with("started")) == [0, 1] and list(folder.ranks_with("done")) == [0]
    assert folder.host(1) == "hostB" and folder.host(5) == ""
    assert folder.first_error_line(1) == "ValueError: bad"
    assert folder.error_classes() == {1: ["builtins.ValueError", "builtins.Exception"]}
    assert folder.offline_run == os.path.join(folder.path, OFFLINE_RUN)
    folder.reset()  # a new launch: the last attempt's markers must not speak for it
    assert folder.ranks_with("started") == {} and os.path.isdir(folder.path)


def test_an_unknown_event_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="unknown rank event 'finished'"):
        JobFolder(str(tmp_path)).write(0, "finished")
