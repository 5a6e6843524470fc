"""The job folder's layout, in one place: where the ranks of one run tell the driver what became of them (a marker per
rank and event), and where rank 0 leaves a run the tracking server never took (`offline_run`).

`<train.checkpoint_dir>/.job/<run_id>/`:
    rank<r>.started   the rank began: "<host> <pid>" (the launcher names the host of a rank that went silent)
    rank<r>.error     its exception and traceback, secrets redacted
    rank<r>.class     its exception's classes, one a line, most specific first (restartability is decided from them)
    rank<r>.done      it returned
    rank<r>.sigterm   it stopped on SIGTERM, with the reason (a launcher may kill it before it returns)
    rank<r>.progress  the step it reached, rewritten as it trains ("end" once it left training), where the driver
                      watches for a stall (pipeline/distributed/progress.py)
    offline_run/      the run left offline (pipeline.tracking.offline), for `lakehouse sync-run`
On a cluster the folder is on cluster storage (spark.shared_paths): the ranks write it on their hosts, the driver
reads it on its own.
"""
from __future__ import annotations

import glob
import os
import shutil
from typing import Dict, List

OFFLINE_RUN = "offline_run"
EVENTS = ("started", "error", "class", "done", "sigterm", "progress")


class JobFolder:
    """One run's job folder (`path`): what ranks write there and what the driver reads back."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def of_run(cls, checkpoint_dir: str, run_id: str) -> "JobFolder":
        """The folder of run `run_id` under `train.checkpoint_dir`."""
        return cls(os.path.join(os.path.abspath(checkpoint_dir), ".job", run_id))

    @property
    def offline_run(self) -> str:
        return os.path.join(self.path, OFFLINE_RUN)

    def reset(self) -> None:
        """Empty it before a launch: an earlier attempt's markers must not speak for this one's ranks."""
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path, exist_ok=True)

    def marker(self, rank: int, event: str) -> str:
        if event not in EVENTS:
            raise ValueError(f"job folder: unknown rank event {event!r} (one of {', '.join(EVENTS)})")
        return os.path.join(self.path, f"rank{rank}.{event}")

    def write(self, rank: int, event: str, text: str = "") -> None:
        """Leave `rank`'s marker; best effort (a rank that cannot write it is reported as silent, never hidden)."""
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(self.marker(rank, event), "w") as fh:
                fh.write(text)
        except OSError:
            pass

    def ranks_with(self, event: str) -> Dict[int, str]:
        """rank -> the path of its `event` marker."""
        found = {}
        for path in glob.glob(os.path.join(self.path, f"rank*.{event}")):
            name = os.path.basename(path)[4:-len(event) - 1]
            if name.isdigit():
                found[int(name)] = path
        return found

    def read(self, rank: int, event: str) -> str:
        """The text of `rank`'s `event` marker ("" when it is absent or unreadable)."""
        try:
            with open(self.marker(rank, event)) as fh:
                return fh.read()
        except OSError:
            return ""

    def error_classes(self) -> Dict[int, List[str]]:
        """rank -> the classes of the exception it failed with, as it recorded them."""
        return {rank: [line.strip() for line in self.read(rank, "class").splitlines() if line.strip()]
                for rank in self.ranks_with("class")}

    def host(self, rank: int) -> str:
        """The host `rank`'s `started` marker names ("" for none or an older marker)."""
        return (self.read(rank, "started").split() or [""])[0]

    def first_error_line(self, rank: int) -> str:
        return (self.read(rank, "error").splitlines() or [""])[0].strip()
