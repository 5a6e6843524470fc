"""`make test`'s lanes (tests/conftest.py): sessions that share their tests file by file through a claims folder,
record the tests they ended, and a next session that leaves out what the lanes ran; pytest in subprocesses on made-up
tests under a copy of the project's conftest."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = "pytester"

ROOT = Path(__file__).resolve().parents[2]

# each file's module fixture writes when it is set up and torn down, so the order of a session's work can be read
FIXTURE = """
import os, pathlib, pytest

@pytest.fixture(scope="module", autouse=True)
def module_state(request):
    log = pathlib.Path(os.environ["ORDER_LOG"])
    name = pathlib.Path(str(request.fspath)).stem
    with log.open("a") as f:
        f.write(f"{os.getpid()} setup {name}\\n")
    yield
    claims = os.environ.get("LAKEHOUSE_LANE_CLAIMS")
    held = f" ({len(os.listdir(claims))} files claimed)" if claims else ""
    with log.open("a") as f:
        f.write(f"{os.getpid()} teardown {name}{held}\\n")
"""

FILES = {
    "test_a": FIXTURE + """
def test_a1():
    pass

def test_a2_fails():
    assert os.environ.get("A2_PASSES") == "1"
""",
    "test_b": FIXTURE + """
def test_b1():
    pass
""",
    "test_c": FIXTURE + """
def test_c1():
    pass

def test_c2_skips():
    if os.environ.get("C2_RUNS") != "1":
        pytest.skip("no network here")
""",
}


@pytest.fixture()
def lane(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(**FILES)
    for key in ("LAKEHOUSE_LANE_RECORD", "LAKEHOUSE_LANE_CLAIMS", "LAKEHOUSE_LANE_DONE", "A2_PASSES", "C2_RUNS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ORDER_LOG", str(tmp_path / "order.log"))
    return pytester, tmp_path / "ran.tsv", tmp_path / "claims", tmp_path / "order.log"


def _record(path: Path):
    return [line.split("\t") for line in path.read_text().splitlines()]


def _order(path: Path):
    return [line.split(" ", 1)[1] for line in path.read_text().splitlines()]


def test_lanes_share_the_files_each_runs_once_and_the_next_session_runs_only_the_rest(lane, monkeypatch):
    pytester, record, claims, order = lane
    monkeypatch.setenv("LAKEHOUSE_LANE_RECORD", str(record))
    monkeypatch.setenv("LAKEHOUSE_LANE_CLAIMS", str(claims))
    first = pytester.runpytest_subprocess("-p", "no:cacheprovider", "test_b.py")  # a lane that took test_b first
    assert first.ret == 0, first.stdout.str()
    first.assert_outcomes(passed=1)

    second = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")  # a lane over every file
    assert second.ret == pytest.ExitCode.TESTS_FAILED  # its own failure fails it
    second.assert_outcomes(passed=2, failed=1, skipped=1)
    assert "test_b1" not in second.stdout.str()  # the other lane's file is not run again
    # one module at a time, each torn down before the next file's is set up, and the next file claimed only then,
    # once this lane is free to run it (at test_a's teardown: test_b, the other lane's, and test_a itself)
    assert _order(order) == ["setup test_b", "teardown test_b (1 files claimed)", "setup test_a",
                             "teardown test_a (2 files claimed)", "setup test_c", "teardown test_c (3 files claimed)"]
    assert _record(record) == [["ran", "test_b.py::test_b1"], ["ran", "test_a.py::test_a1"],
                               ["failed", "test_a.py::test_a2_fails"], ["ran", "test_c.py::test_c1"],
                               ["skipped", "test_c.py::test_c2_skips"]]
    third = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # every file claimed: nothing left to run
    assert third.ret == 0, third.stdout.str()
    third.assert_outcomes()

    for key in ("LAKEHOUSE_LANE_RECORD", "LAKEHOUSE_LANE_CLAIMS"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("LAKEHOUSE_LANE_DONE", str(record))
    monkeypatch.setenv("C2_RUNS", "1")
    rest = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    assert rest.ret == 0, rest.stdout.str()
    rest.assert_outcomes(passed=1, deselected=4)  # the skipped test runs again; the failed one is not run twice
    assert "test_c2_skips PASSED" in rest.stdout.str()


def test_without_the_lanes_variables_nothing_changes(lane):
    pytester, record, claims, _ = lane
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3, failed=1, skipped=1)
    assert not record.exists() and not claims.exists()
