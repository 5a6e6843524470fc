"""Errors several layers raise or catch: defined on the ground floor so none of them imports a higher layer for one."""
from __future__ import annotations


class Terminated(Exception):
    """The job was asked to stop (SIGTERM): raised in the driver's main thread by the handler `tracked_run` installs,
    and by the launcher when the ranks stopped on that signal. Never restarted."""
