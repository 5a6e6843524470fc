"""Local ranks do not outlive a driver killed with SIGKILL (which no handler of its sees): a torchrun rank watches the
driver's process and ends (`rank_process.end_with_the_driver`), and torchrun's agent gets a parent-death signal
(`torchrun.dies_with_this_thread`). Real processes: a small driver starts the child, then is SIGKILLed."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")

WATCHING_CHILD = textwrap.dedent("""
    import os, sys, time
    from pipeline.data.leases import process_start
    from pipeline.distributed.rank_process import end_with_the_driver
    end_with_the_driver(os.getppid(), process_start(os.getppid()), poll_s=0.1)
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(120)
""")

PLAIN_CHILD = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"

DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from pipeline.distributed.backends.torchrun import dies_with_this_thread
    preexec = dies_with_this_thread() if sys.argv[1] == "pdeathsig" else None
    subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]], preexec_fn=preexec,
                     stderr=open(sys.argv[4], "w"), start_new_session=True)  # as torchrun starts its ranks
    time.sleep(120)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _driver_killed_under(tmp_path: Path, how: str, child: str) -> int:
    """Start a driver whose child runs `child`, SIGKILL the driver once the child runs; the child's pid."""
    pid_file, log = tmp_path / "child.pid", tmp_path / "child.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, how, child, str(pid_file), str(log)], env=env,
                              start_new_session=True)
    try:
        assert _wait(lambda: (pid_file.exists() and pid_file.read_text()) or driver.poll() is not None, 60)
        assert driver.poll() is None, f"the driver ended ({driver.returncode}) before its child started"
        child_pid = int(pid_file.read_text())
        driver.kill()
        driver.wait()
        return child_pid
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def _kill(pid: int) -> None:
    """SIGKILL what a test left: psutil's kill refuses a process that took the pid since."""
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass


def test_a_rank_watching_its_driver_ends_when_the_driver_is_sigkilled(tmp_path):
    child = _driver_killed_under(tmp_path, "watch", WATCHING_CHILD)
    try:
        assert _wait(lambda: _gone(child), 10), "the rank outlived its driver"
    finally:
        _kill(child)
    assert "is gone: this rank process" in (tmp_path / "child.log").read_text()


def test_torchrun_s_agent_gets_a_signal_when_the_driver_is_sigkilled(tmp_path):
    child = _driver_killed_under(tmp_path, "pdeathsig", PLAIN_CHILD)
    try:
        assert _wait(lambda: _gone(child), 10), "the agent outlived its driver"
    finally:
        _kill(child)


def test_a_rank_does_not_take_a_process_that_reused_the_driver_s_pid_for_the_driver():
    from pipeline.data.leases import pid_alive, process_start

    me = os.getpid()
    assert pid_alive(me, process_start(me)) and not pid_alive(me, process_start(me) + 1)


SLEEPY_ENTRY = textwrap.dedent("""
    import os, time
    def entry(handoff):  # a rank entry that never ends on its own
        open(os.path.join(os.environ["RANKS_ALIVE"], f"{os.environ['RANK']}.{os.getpid()}"), "w").close()
        time.sleep(120)
""")

TORCHRUN_DRIVER = textwrap.dedent("""
    import sleepy_entry
    from pipeline.distributed.backends.torchrun import run_local
    from pipeline.distributed.early_start import Handoff
    run_local(sleepy_entry.entry, Handoff.new(), 2)
""")


def test_torchrun_s_agent_and_ranks_end_when_the_driver_is_sigkilled(tmp_path):
    """The whole tree as `train.backend=ddp train.np=-2` starts it (torchrun's agent, its 2 ranks in sessions of their
    own): none of it is left a few seconds after the driver's SIGKILL."""
    pytest.importorskip("torch.distributed.run")
    (tmp_path / "sleepy_entry.py").write_text(SLEEPY_ENTRY)
    alive = tmp_path / "alive"
    alive.mkdir()
    env = {**os.environ, "RANKS_ALIVE": str(alive),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, "-c", TORCHRUN_DRIVER], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "driver.log", "w"))
    tree = []
    try:
        assert _wait(lambda: len(os.listdir(alive)) == 2 or driver.poll() is not None, 120)
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        tree = [int(name.split(".")[1]) for name in os.listdir(alive)] + [
            p.pid for p in psutil.Process(driver.pid).children()]  # the ranks and torchrun's agent
        assert len(tree) == 3, tree
        driver.kill()
        driver.wait()
        assert _wait(lambda: all(_gone(pid) for pid in tree), 15), \
            f"left behind: {[pid for pid in tree if not _gone(pid)]}"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in tree:
            _kill(pid)
