"""Import heavy libraries on a background thread while the main thread waits on something else (the JVM's start)."""
from __future__ import annotations

import importlib
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Sequence

from pipeline.log import get_logger

log = get_logger(__name__)

_threads: List[threading.Thread] = []


def start(modules: Sequence[str]) -> threading.Thread:
    """Import `modules`, in order, on a daemon thread; return it.

    The main thread's own later `import` of one of them waits for this one (Python locks each module while it is
    imported) and then finds it done, so nothing is imported twice and nothing changes but when the time is spent.
    A library that fails to import here is left alone: the main thread's import raises the error where it is needed.
    Only libraries that import none of the project belong here (no two threads then wait on each other's modules).
    """

    def run() -> None:
        for name in modules:
            t0 = time.perf_counter()
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - the main thread's import reports it where it matters
                log.debug("preloading %s failed: %s", name, exc)
                continue
            log.debug("preloaded %s in %.2f s", name, time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="lakehouse-preload", daemon=True)
    _threads.append(thread)
    thread.start()
    return thread


def wait() -> None:
    """Return once every background import has ended. Call it before this process forks or starts rank processes (the
    launcher does): a fork taken while another thread holds a module's import lock leaves the child's import of that
    module waiting forever."""
    while _threads:
        _threads.pop().join()


@contextmanager
def once(ready: Callable[[], bool], modules: Sequence[str], poll_s: float = 0.2) -> Iterator[None]:
    """While the block runs, `start(modules)` as soon as `ready()` (asked every `poll_s` seconds on a watcher thread)
    is true; if it never was, when the block ends. For an import the process needs after the block, timed to a moment
    the machine has a core to spare."""
    over = threading.Event()
    started: List[bool] = []

    def watch() -> None:
        while not over.wait(poll_s):
            if ready():
                started.append(True)
                start(modules)
                return

    watcher = threading.Thread(target=watch, name="lakehouse-preload-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        over.set()
        watcher.join()
        if not started:
            start(modules)
