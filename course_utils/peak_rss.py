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


def tree_rss_bytes(root, *, exclude_servers: bool = True) -> int:
    """RSS summed over ``root``'s descendants (a ``psutil.Process``), leaving out servers marked with
    :data:`SERVER_ENV` and everything under them."""
    return _rss_without_servers(_descendants(root), exclude_servers, {})


def _descendants(root) -> list:
    """``root``'s descendants, parents before their children (none if ``root`` is gone). Scans every process of the
    machine."""
    import psutil

    try:
        return root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _rss_without_servers(processes: list, exclude_servers: bool, seen: dict) -> int:
    """RSS summed over ``processes`` (parents before their children), servers and their children left out where
    ``exclude_servers``; ``seen`` remembers, between calls, the processes (pid and start time) found to be servers."""
    import psutil

    total = 0
    servers = set()
    for child in processes:
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


class TreeRss:
    """A reader for :class:`PeakSampler` (the main job's, every 50 ms): :func:`tree_rss_bytes` of ``root``
    (default: this process), listing the descendants anew only every ``relist_every`` calls.

    Listing them scans every process of the machine (some 2 ms of CPU on a quiet one, 20 times a second: a few
    per cent of a core taken from the chapter being measured); in between, the processes of the last list are
    read again, each one's environment included, so a server started since is left out from its exec on. A
    process started since the last list is counted from the next one.
    """

    def __init__(self, root=None, *, relist_every: int = 5):
        import psutil

        if not isinstance(relist_every, int) or isinstance(relist_every, bool) or relist_every < 1:
            raise ValueError(f"relist_every must be a positive integer, got {relist_every!r}")
        self.root = psutil.Process() if root is None else root
        self.relist_every = relist_every
        self.calls = self.listings = 0
        self._seen: dict = {}
        self._listed: list = []

    def __call__(self) -> int:
        if self.calls % self.relist_every == 0:
            self._listed = _descendants(self.root)
            self.listings += 1
        self.calls += 1
        return _rss_without_servers(self._listed, True, self._seen)
