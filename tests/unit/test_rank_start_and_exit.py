"""A rank's start and end: the reader's library is imported at set-up, and a failed rank process exits at once."""
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, available_readers
from pipeline.data.shards import ConversionError
from pipeline.distributed import rank_process as loop
from pipeline.distributed.backends import horovod


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

    monkeypatch.setattr(horovod, "horovod_worker", fail)
    monkeypatch.setattr(horovod, "exit_now", exit_now)
    with pytest.raises(SystemExit):
        horovod.horovod_rank_process(object())
    assert exits == [1]
    assert "RuntimeError: rank 1 broke" in capsys.readouterr().err


def test_a_rank_process_that_succeeds_returns_its_result_and_ends_fast_only_after(monkeypatch):
    fast = []
    monkeypatch.setattr(horovod, "horovod_worker", lambda job: ("result", job))
    monkeypatch.setattr(horovod, "exit_now", lambda code: pytest.fail("a rank that succeeded must not exit early"))
    monkeypatch.setattr(horovod, "exit_fast_after_delivery", lambda: fast.append(True))  # not in pytest's own process
    assert horovod.horovod_rank_process("job") == ("result", "job")
    assert fast == [True]


@pytest.mark.parametrize("tail, code", [("", 0), ("raise RuntimeError('delivery failed')", 1),
                                        ("import sys; sys.stdout.write('delivered'); sys.stdout.flush()", 0)])
def test_fast_exit_keeps_a_failed_delivery_s_status_and_the_output(tail, code):
    """A real process: the launcher's code after the rank function runs; a failure there keeps its exit status."""
    import subprocess
    import sys

    script = "from pipeline.distributed import rank_process as loop\nloop.exit_fast_after_delivery()\n" + tail + "\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    if "delivered" in tail:
        assert done.stdout == "delivered"
    if code:
        assert "delivery failed" in done.stderr


def test_exit_now_flushes_and_ends_the_process_with_its_code():
    code = ("import logging, sys\nfrom pipeline.distributed.rank_process import exit_now\n"
            "sys.stdout.write('unflushed line')\nexit_now(3)\nprint('never')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 3 and out.stdout == "unflushed line"


def _job(tmp_path):
    from types import SimpleNamespace

    from pipeline.distributed.job_folder import JobFolder

    return SimpleNamespace(job_dir=str(tmp_path / "job"), folder=JobFolder(str(tmp_path / "job")),
                           cfg=SimpleNamespace(train=SimpleNamespace(stall_timeout_s=60)))


def test_rank_record_leaves_started_then_done_or_the_error(tmp_path):
    job = _job(tmp_path)
    with loop.rank_record(job, 0):
        pass
    with pytest.raises(ValueError):
        with loop.rank_record(job, 1):
            raise ValueError("bad shard")
    files = sorted(p.name for p in (tmp_path / "job").iterdir())
    assert files == ["rank0.done", "rank0.started", "rank1.class", "rank1.error", "rank1.started"]
    assert (tmp_path / "job" / "rank1.error").read_text().startswith("ValueError: bad shard\n")
    # the class and its bases, most specific first: what the launcher decides restartability from
    assert (tmp_path / "job" / "rank1.class").read_text().splitlines() == [
        "builtins.ValueError", "builtins.Exception", "builtins.BaseException", "builtins.object"]


def test_a_rank_that_ended_without_a_word_is_named_beside_the_ranks_errors(tmp_path):
    """Rank 1 SIGKILLed: it started and left nothing; rank 0 reported the collective's failure; rank 2 finished."""
    from pipeline.distributed.rank_failures import SILENT_RANK, failures as _failures

    job = _job(tmp_path)
    folder = tmp_path / "job"
    folder.mkdir()
    for name, text in {"rank0.started": "", "rank0.error": "HorovodInternalError: Horovod has been shut down\n\ntb",
                       "rank1.started": "", "rank2.started": "", "rank2.done": "", "rank10.started": "",
                       "rank10.error": "RuntimeError: Timed out waiting 60000ms\n"}.items():
        (folder / name).write_text(text)
    assert _failures(job) == ("rank 0: HorovodInternalError: Horovod has been shut down; "
                              f"rank 1: {SILENT_RANK}; "
                              "rank 10: RuntimeError: Timed out waiting 60000ms (a collective did not finish within "
                              "train.stall_timeout_s=60 s: another rank is stuck or far slower)")
    for name in ("rank0.started", "rank0.error", "rank1.started", "rank10.started", "rank10.error"):
        (folder / name).unlink()
    assert _failures(job) == ""  # every rank that started also finished


def test_the_command_s_fast_end_keeps_its_status_threads_and_exit_handlers(tmp_path):
    """`lakehouse` ends with `cli.end_process`: a thread that is not a daemon finishes its work and the exit handlers
    run (Spark's, Petastorm's clean-ups) before the process ends, with the command's status."""
    import subprocess
    import sys

    script = (
        "import atexit, threading, time\n"
        "from pipeline import cli\n"
        f"atexit.register(lambda: open({str(tmp_path / 'handler')!r}, 'w').write('ran'))\n"
        f"threading.Thread(target=lambda: (time.sleep(0.3), open({str(tmp_path / 'thread')!r}, 'w').write('done')))"
        ".start()\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "pool = ThreadPoolExecutor(2); pool.submit(lambda: 1).result()  # idle workers, as MLflow's uploaders leave\n"
        "print('summary', flush=False)\n"
        "cli.end_process(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "summary\n"
    assert (tmp_path / "handler").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"
