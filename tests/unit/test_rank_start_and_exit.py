"""A rank's start and end: the reader's library is imported at set-up, and a failed rank process exits at once."""
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, available_readers
from pipeline.data.shards import ConversionError
from pipeline.distributed import loop


def _modules_after(code: str) -> set:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + "\nimport sys\n"
                          "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.skipif("petastorm" not in available_readers(), reason="the modern profile has no Petastorm")
def test_the_petastorm_reader_is_imported_when_the_rank_sets_up():
    assert "petastorm" not in _modules_after("from pipeline.data import datamodule")
    assert "petastorm" in _modules_after("from pipeline.data.readers import load_reader\nload_reader('petastorm')")


def test_the_arrow_reader_imports_no_petastorm():
    assert "petastorm" not in _modules_after("from pipeline.data.readers import load_reader\nload_reader('arrow')")


def test_an_unknown_reader_is_refused_at_set_up():
    from pipeline.data.readers import load_reader

    with pytest.raises(ConversionError, match="data.reader"):
        load_reader("parquet-magic")


def test_a_failed_rank_process_prints_its_traceback_and_exits_at_once(monkeypatch, capsys):
    exits = []

    def fail(job):
        raise RuntimeError("rank 1 broke")

    def exit_now(code):
        exits.append(code)
        raise SystemExit(code)  # the real one ends the process without the interpreter's teardown

    monkeypatch.setattr(loop, "horovod_worker", fail)
    monkeypatch.setattr(loop, "exit_now", exit_now)
    with pytest.raises(SystemExit):
        loop.horovod_rank_process(object())
    assert exits == [1]
    assert "RuntimeError: rank 1 broke" in capsys.readouterr().err


def test_a_rank_process_that_succeeds_returns_its_result(monkeypatch):
    monkeypatch.setattr(loop, "horovod_worker", lambda job: ("result", job))
    monkeypatch.setattr(loop, "exit_now", lambda code: pytest.fail("a rank that succeeded must not exit early"))
    assert loop.horovod_rank_process("job") == ("result", "job")


def test_exit_now_flushes_and_ends_the_process_with_its_code():
    code = ("import logging, sys\nfrom pipeline.distributed.loop import exit_now\n"
            "sys.stdout.write('unflushed line')\nexit_now(3)\nprint('never')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 3 and out.stdout == "unflushed line"
