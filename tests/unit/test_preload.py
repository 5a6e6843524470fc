"""pipeline.preload: modules imported on a background thread, a failed import left to the main thread, wait() joins."""
import sys
import threading

from pipeline import preload


def test_modules_load_on_the_background_thread_and_wait_joins_it(tmp_path, monkeypatch):
    release = tmp_path / "release"
    (tmp_path / "preload_probe_a.py").write_text(  # its import lasts until the test lets it end
        f"import os, threading, time\nend = time.monotonic() + 30\nwhile not os.path.exists({str(release)!r}) and "
        "time.monotonic() < end:\n    time.sleep(0.01)\nLOADED_ON = threading.current_thread().name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    thread = preload.start(["no_such_module_for_preload", "preload_probe_a"])
    assert thread.is_alive()  # still inside the probe's import: start() did not wait for it
    release.touch()
    preload.wait()
    assert not thread.is_alive()
    assert sys.modules["preload_probe_a"].LOADED_ON == "lakehouse-preload" != threading.current_thread().name
    assert "no_such_module_for_preload" not in sys.modules  # its failure was swallowed, the next module still loaded


def test_the_main_threads_own_import_waits_for_the_background_one(tmp_path, monkeypatch):
    (tmp_path / "preload_probe_b.py").write_text(
        "import time\nCOUNT = globals().get('COUNT', 0) + 1\ntime.sleep(0.3)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    preload.start(["preload_probe_b"])
    import preload_probe_b  # noqa: E402 - blocks on the module's lock until the thread's import is done

    assert preload_probe_b.DONE and preload_probe_b.COUNT == 1
    preload.wait()


def test_once_starts_the_import_when_ready_or_when_the_block_ends(tmp_path, monkeypatch):
    """The driver's torch for the promotion gate: loaded once the first rank is done (rank 0 then logs the model and a
    core is idle), never while every rank trains; at the latest when the launch returns."""
    import time

    from pipeline.distributed.job_folder import JobFolder

    started = []
    monkeypatch.setattr(preload, "start", lambda modules: started.append(tuple(modules)))
    folder = JobFolder(str(tmp_path / "job"))
    folder.reset()
    with preload.once(lambda: bool(folder.ranks_with("done")), ("torch",), poll_s=0.01):
        time.sleep(0.1)
        assert started == []  # ranks still training: nothing competes with them for the cores
        folder.write(1, "done")
        deadline = time.monotonic() + 5
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started == [("torch",)]
    assert started == [("torch",)]  # not a second time at the end
    started.clear()
    with preload.once(lambda: False, ("torch",), poll_s=0.01):
        pass  # ranks whose markers this host never sees (a cluster job folder on a host-private disk)
    assert started == [("torch",)]
