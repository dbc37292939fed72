"""A background thread that keeps the peak of a reading, e.g. a process's RSS (chapter 01 onwards).

Kept free of torch so the main job's own process (which only watches the kernels) stays light.
"""
from __future__ import annotations

import threading
from typing import Callable


class PeakSampler(threading.Thread):
    """Calls ``read()`` every ``interval_s`` seconds until :meth:`stop`; ``peak`` is the largest value.

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
