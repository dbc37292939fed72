"""The peak of a process's resident memory (RSS), sampled by a background thread (chapter 01 onwards).

Used by :func:`course_utils.measure.peak_memory` (one call, in the kernel) and by the main
job (:mod:`course_utils.run_all`, the kernel process watched from outside). Kept free of
torch so the main job's own process stays light.
"""
from __future__ import annotations

import threading
from typing import Callable


class PeakSampler(threading.Thread):
    """Calls ``read()`` (e.g. a process's RSS in bytes) every ``interval_s`` seconds until
    :meth:`stop`; ``peak`` is the largest value read.

    The value at construction and a final reading at :meth:`stop` are included.
    """

    def __init__(self, read: Callable[[], int], interval_s: float):
        super().__init__(daemon=True)
        self.read, self.interval_s = read, interval_s
        self.peak = read()
        self._stop_event = threading.Event()

    def run(self):
        while not self._stop_event.is_set():
            self.peak = max(self.peak, self.read())
            self._stop_event.wait(self.interval_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, self.read())
        return self.peak


#: Set in the environment of a server a chapter starts (chapter 11): the main job leaves such processes, and
#: their children, out of the kernel's RSS (the chapter reports their memory itself).
SERVER_ENV = "COURSE_UTILS_SERVER"


def tree_rss_bytes(root, *, exclude_servers: bool = True, _seen: dict | None = None) -> int:
    """RSS summed over ``root``'s descendants (a ``psutil.Process``), leaving out servers marked with
    :data:`SERVER_ENV` and everything under them. ``_seen`` remembers, between calls, the processes
    (pid and start time) found to be servers."""
    import psutil

    seen = {} if _seen is None else _seen
    total = 0
    try:
        children = root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0
    servers = set()
    for child in children:
        try:
            if exclude_servers:
                key = (child.pid, child.create_time())
                # only a server is remembered: between fork and exec a new server still has its parent's
                # environment, so "not a server" may change once
                if key in seen or SERVER_ENV in child.environ() or child.ppid() in servers:
                    seen[key] = True
                    servers.add(child.pid)
                    continue
            total += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total
