"""`make test`'s lane (tests/conftest.py): a session that records the tests it ended, stops after the running test once
its stop file appears, and a next session that leaves out what the lane ran; pytest in subprocesses on made-up tests
under a copy of the project's conftest."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = "pytester"

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import os, pathlib

def test_one():
    pass

def test_two_makes_the_stop_file():
    stop = os.environ.get("MAKE_STOP")
    if stop:
        pathlib.Path(stop).touch()

def test_three_fails():
    assert os.environ.get("THREE_PASSES") == "1"

def test_four():
    pass
"""


@pytest.fixture()
def lane(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_made=TESTS)
    for key in ("LAKEHOUSE_LANE_RECORD", "LAKEHOUSE_LANE_STOP", "LAKEHOUSE_LANE_DONE", "MAKE_STOP", "THREE_PASSES"):
        monkeypatch.delenv(key, raising=False)
    return pytester, tmp_path / "ran.tsv", tmp_path / "stop"


def _record(path: Path):
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_the_lane_stops_after_the_running_test_and_the_next_session_runs_only_the_rest(lane, monkeypatch):
    pytester, record, stop = lane
    monkeypatch.setenv("LAKEHOUSE_LANE_RECORD", str(record))
    monkeypatch.setenv("LAKEHOUSE_LANE_STOP", str(stop))
    monkeypatch.setenv("MAKE_STOP", str(stop))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()  # stopped on purpose, nothing failed: not pytest's "interrupted"
    result.assert_outcomes(passed=2)
    assert _record(record) == [["ran", "test_made.py::test_one"], ["ran", "test_made.py::test_two_makes_the_stop_file"]]

    monkeypatch.delenv("LAKEHOUSE_LANE_RECORD")
    monkeypatch.delenv("LAKEHOUSE_LANE_STOP")
    monkeypatch.delenv("MAKE_STOP")
    monkeypatch.setenv("LAKEHOUSE_LANE_DONE", str(record))
    monkeypatch.setenv("THREE_PASSES", "1")
    rest = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    assert rest.ret == 0, rest.stdout.str()
    rest.assert_outcomes(passed=2, deselected=2)
    out = rest.stdout.str()
    assert "test_three_fails PASSED" in out and "test_four PASSED" in out and "test_one" not in out


def test_a_failure_in_the_lane_fails_its_session_and_is_not_run_again(lane, monkeypatch):
    pytester, record, stop = lane
    monkeypatch.setenv("LAKEHOUSE_LANE_RECORD", str(record))
    monkeypatch.setenv("LAKEHOUSE_LANE_STOP", str(stop))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3, failed=1)
    assert ["failed", "test_made.py::test_three_fails"] in _record(record) and len(_record(record)) == 4

    stop.touch()  # the stop file before the first test: that one test runs, then the session ends, still failing
    record.unlink()
    again = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "three or four")
    assert again.ret == pytest.ExitCode.TESTS_FAILED
    again.assert_outcomes(failed=1)
    assert _record(record) == [["failed", "test_made.py::test_three_fails"]]


def test_without_the_lanes_variables_nothing_changes(lane):
    pytester, record, _ = lane
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3, failed=1)
    assert not record.exists()
