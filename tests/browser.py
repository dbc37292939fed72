"""Helpers for the browser tests: Chromium, a JupyterLab server on loopback, chart data."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "build" / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
INSTALL_HINT = ("Chromium was not found. Install it to run the browser tests "
                "(Debian/Ubuntu: sudo apt install chromium; macOS: brew install --cask chromium) "
                "or set CHROMIUM_PATH to its executable.")


def chromium_available() -> bool:
    return bool(os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or shutil.which("chromium-browser"))


def chromium_path() -> str:
    """The Chromium executable; a test fails without it under CI and is skipped elsewhere."""
    found = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(INSTALL_HINT)
    pytest.skip(INSTALL_HINT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """``jupyter lab`` serving ``root`` on 127.0.0.1 with a random token; stopped by :meth:`stop`."""

    def __init__(self, root: Path, settings_dir: Path):
        self.root, self.port, self.token = root, free_port(), os.urandom(12).hex()
        settings = settings_dir / "@jupyterlab" / "notebook-extension"
        settings.mkdir(parents=True, exist_ok=True)
        # render every cell (no virtual scrolling), so the test sees all prompts and outputs
        (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
        notification = settings_dir / "@jupyterlab" / "apputils-extension"
        notification.mkdir(parents=True, exist_ok=True)
        (notification / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings_dir), HF_HUB_OFFLINE="1")
        self.log = open(root / "jupyterlab.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
             f"--LabApp.workspaces_dir={settings_dir / 'workspaces'}",
             "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
            + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {(self.root / 'jupyterlab.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/status?token={self.token}", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("jupyter lab did not start in time")

    def url(self, notebook: str) -> str:
        # ?reset: start from an empty workspace, so notebooks opened by earlier tests do not reopen
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?reset&token={self.token}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


PLOT_DATA_JS = """gd => JSON.stringify((gd.data || []).map(t => [t.type, t.x, t.y, t.z, t.base, t.text]))"""


def plot_data(locator) -> str:
    """The data of a rendered plotly chart (traces' x, y, z, base, text), as JSON text."""
    return locator.evaluate(PLOT_DATA_JS)


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path
