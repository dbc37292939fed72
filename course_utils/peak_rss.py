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
