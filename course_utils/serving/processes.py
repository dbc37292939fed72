"""Chapter 11 -- server processes: started on loopback as their own process group, stopped with everything they started."""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

from ..peak_rss import SERVER_ENV, PeakSampler


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child, before exec (Linux): receive SIGTERM when the process that started it dies."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


@atexit.register
def stop_all_servers() -> None:
    """Stop every server this process started and has not stopped yet."""
    for server in list(_LIVE):
        server.stop()


def process_label(proc) -> str:
    """A process's name (``psutil.Process``); for a Python interpreter, what it runs: ``python -m MODULE`` gives
    ``python: MODULE``, a script its file name, ``python -c`` the code's first import (a
    ``multiprocessing`` helper, a compile worker), so that a server's helper processes can be told apart."""
    name = proc.name()
    if not name.lower().startswith("python"):
        return name
    try:
        args = proc.cmdline()[1:]
    except Exception:   # noqa: BLE001 -- gone, or not ours to read
        return name
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        args = args[1:]                                  # interpreter options (-u, -E, -B, ...)
    if len(args) >= 2 and args[0] == "-m":
        return f"{name}: {args[1]}"
    if len(args) >= 2 and args[0] == "-c":
        code = args[1]
        for word in ("from ", "import "):
            if word in code:
                return f"{name}: {code.split(word, 1)[1].split()[0].rstrip(';,')}"
        return f"{name}: -c"
    if args:
        return f"{name}: {Path(args[0]).name if Path(args[0]).name != '__main__.py' else Path(args[0]).parent.name}"
    return name


class ServerProcess:
    """A server started as a child process (its own process group) on loopback.

    ``start()`` launches ``command`` and waits until ``GET base_url + ready_path`` answers 200;
    ``stop()`` ends the whole process group (SIGTERM, then SIGKILL after ``grace_s``) and any
    descendant left over. Also stopped at the end of a ``with`` block, at interpreter exit, and
    -- on Linux -- when the process that started it dies. ``peak_rss`` holds the peak resident
    memory of each of its processes (bytes), sampled while it runs; ``startup_s`` the start-up time.
    """

    def __init__(self, command: list[str], *, base_url: str, name: str, env: dict | None = None,
                 log_path: str | Path | None = None, ready_path: str = "/health", timeout_s: float = 600.0,
                 grace_s: float = 15.0, cwd: str | Path | None = None):
        self.command, self.base_url, self.name = list(command), base_url.rstrip("/"), name
        self.env, self.cwd = env, cwd
        self.log_path = Path(log_path) if log_path else None
        self.ready_path, self.timeout_s, self.grace_s = ready_path, timeout_s, grace_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._process_peaks: dict[int, tuple[str, int]] = {}
        self.peak_total_rss = 0
        self._tree: list = []
        self._samples = 0
        self._sampler: PeakSampler | None = None
        self._log = None

    # memory ----------------------------------------------------------------------------------------------------
    def _processes(self, *, refresh: bool = True):
        """The server's processes, root first. Listing children scans every process of the machine, so the
        sampler refreshes the list only every few samples (``refresh=False`` reuses the last list)."""
        import psutil
        if not refresh and self._tree:
            return self._tree
        try:
            root = psutil.Process(self.proc.pid)
            self._tree = [root] + root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            self._tree = []
        return self._tree

    def _read_rss(self) -> int:
        total, self._samples = 0, self._samples + 1
        for i, p in enumerate(self._processes(refresh=self._samples % 5 == 1)):
            try:
                rss, name = p.memory_info().rss, (self.name if i == 0 else process_label(p))
            except Exception:   # noqa: BLE001 -- gone between listing and reading
                continue
            _, peak = self._process_peaks.get(p.pid, (name, 0))
            self._process_peaks[p.pid] = (name, max(peak, rss))      # its latest name (vLLM renames its workers)
            total += rss
        self.peak_total_rss = max(self.peak_total_rss, total)
        return total

    @property
    def peak_rss(self) -> dict[str, int]:
        """Peak RSS (bytes) of each process the server ran, by process name (the largest where several share one).

        A process forked from a large one counts the pages it shares with it, so these do not add up.
        """
        out: dict[str, int] = {}
        for name, peak in self._process_peaks.values():
            out[name] = max(out.get(name, 0), peak)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def cpu_s(self) -> float:
        """CPU time (user + system, s) used so far by the server's processes that are running now (the list is
        refreshed): read it before and after a stretch of time to see how busy the server was meanwhile."""
        total = 0.0
        for p in self._processes():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except Exception:   # noqa: BLE001 -- gone between listing and reading
                continue
        return total

    def leftover_processes(self) -> list[int]:
        """Process ids of the server's processes (every one seen while it ran) that still exist, zombies aside."""
        import psutil
        left = []
        for pid in self._process_peaks:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.Error:
                pass
        return left

    # life cycle ------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_lines: int = 25) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n_lines:])

    def start(self, *, progress: bool = True) -> "ServerProcess":
        if self.proc is not None:
            raise RuntimeError(f"{self.name} was already started")
        env = dict(os.environ if self.env is None else self.env, **{SERVER_ENV: self.name})
        kw: dict = dict(env=env, cwd=self.cwd, stdin=subprocess.DEVNULL)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")
            kw.update(stdout=self._log, stderr=subprocess.STDOUT)
        else:
            kw.update(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.name == "nt":
            kw["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
        else:
            kw["start_new_session"] = True
            if sys.platform.startswith("linux"):
                kw["preexec_fn"] = die_with_parent
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command, **kw)
        _LIVE.add(self)
        self._sampler = PeakSampler(self._read_rss, interval_s=0.4)
        self._sampler.start()
        try:
            self._wait_ready(t0, progress)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float, progress: bool) -> None:
        import urllib.error
        import urllib.request

        from ..progress import progress_bar

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))      # loopback: never a proxy
        with progress_bar(None, f"starting {self.name}", enabled=progress, total=None, unit="s") as bar:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting. "
                                       f"Last lines of its log ({self.log_path}):\n{self.log_tail()}")
                try:
                    with opener.open(self.base_url + self.ready_path, timeout=2) as resp:
                        if resp.status == 200:
                            return
                except (urllib.error.URLError, OSError, ValueError):
                    pass
                if time.perf_counter() - t0 > self.timeout_s:
                    raise TimeoutError(f"{self.name} did not become ready within {self.timeout_s:.0f} s. "
                                       f"Last lines of its log ({self.log_path}):\n{self.log_tail()}")
                time.sleep(0.5)
                bar.update(0.5)

    def stop(self) -> int | None:
        """End the server and everything it started; returns its exit code (None if it was never started)."""
        if self.proc is None:
            return None
        import psutil

        survivors = self._processes()
        if self.proc.poll() is None:
            try:
                if os.name == "nt":
                    self.proc.send_signal(signal.CTRL_BREAK_EVENT)
                else:
                    os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs([p for p in survivors if p.is_running()], timeout=1)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        if os.name != "nt":
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)      # anything still in the group
            except (ProcessLookupError, PermissionError, OSError):
                pass
        code = self.proc.wait()
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._log is not None:
            self._log.close()
            self._log = None
        _LIVE.discard(self)
        return code

    def __enter__(self) -> "ServerProcess":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self.proc else "not started")
        return f"ServerProcess({self.name!r}, {self.base_url}, {state})"
