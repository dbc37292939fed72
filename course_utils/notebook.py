"""Small helpers that let a chapter write its prose from the numbers of this run (chapter 01 onwards)."""
from __future__ import annotations

import inspect
import platform
from typing import Iterable, Sequence

import torch


def md(text: str) -> None:
    """Display Markdown (in a notebook); print it elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def show_source(*objects) -> None:
    """Display the source code of functions (or properties) from ``course_utils`` so the chapter shows the idea itself."""
    functions = [obj.fget if isinstance(obj, property) else obj for obj in objects]
    md("\n\n".join(f"```python\n{inspect.getsource(fn).rstrip()}\n```" for fn in functions))


def md_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table; cells are converted with ``str`` (format numbers before)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: float, *, binary: bool = True) -> str:
    """Bytes with an exact unit name: KiB/MiB/GiB (powers of 1024) or kB/MB/GB (powers of 1000)."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000, ["B", "kB", "MB", "GB", "TB"])
    value, unit = float(n), units[0]
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            break
        value /= base
    return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds with sensible precision."""
    ms = seconds * 1e3
    return f"{ms:,.1f} ms" if ms >= 10 else f"{ms:,.2f} ms"


def machine_summary(device=None) -> str:
    """What this run is measured on: CPU (with the vector instructions PyTorch uses: AVX2, AVX512, ...) or GPU,
    threads and how idle ones wait, torch version. Kernel speeds depend on those instructions: compare ratios from one run."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        where = torch.cuda.get_device_name(dev)
    elif dev.type == "mps":
        where = f"Apple GPU (MPS) on {platform.machine()}"
    else:
        from .measure import openmp_wait_policy
        where = (f"{platform.processor() or platform.machine()} CPU ({torch.backends.cpu.get_cpu_capability()}), "
                 f"{torch.get_num_threads()} threads, {openmp_wait_policy()}")
    return f"{where}; PyTorch {torch.__version__}; {platform.system()}"


#: Where :func:`summary_note` leaves its text in a cell's output metadata (read by :mod:`course_utils.run_all`).
SUMMARY_NOTE_KEY = "course_utils/summary_note"


def summary_note(text: str) -> None:
    """Show ``text`` (Markdown) in the notebook and hand it to the main job's summary, below the chapter table
    (chapter 11: what did not run here, and how to run it elsewhere)."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(text), metadata={SUMMARY_NOTE_KEY: text})
            return
    except ImportError:
        pass
    print(text)
