"""The benchmarks' shared harness: clocks and profiles, machine facts, child processes, a quiet
machine, ports and bare HTTP servers, and the JSON result. Each ``bench_*.py`` script keeps only what
it measures; the simulated fleet is the simulator's own (``expansion_dag.sim.FleetProcess``).

Scripts run as ``.venv/bin/python bench/bench_X.py``, which puts ``bench/`` on ``sys.path``, so
they import this module as ``harness``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime
import importlib
import itertools
import json
import operator
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from expansion_dag.core import free_port_block

ROOT = Path(__file__).resolve().parent.parent
# The workloads the benchmarks share with the tests are kept with the tests (expansion_dag_tests/workloads/).
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
RESULTS_DIR = ROOT / "bench" / "results"
#: Where generated inputs are cached between runs.
DATA_DIR = Path(tempfile.gettempdir()) / "expansion_dag_bench"
HOST = "127.0.0.1"
#: A child process prints its result as one line starting with this mark; the rest is its log.
RESULT_MARK = "@@RESULT "
_TICK = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------------------------------------
# Machine facts


def _cpu_model_and_memory_gib() -> tuple[str, float | None]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    return model, mem_gib


#: The libraries whose versions move the data benchmarks' figures.
DATA_PACKAGES = ("polars", "pyarrow", "numpy", "transformers", "tokenizers", "datasets")


def machine(*packages: str) -> dict[str, Any]:
    """What a result records about the machine it ran on, with the versions of ``packages``."""
    model, mem_gib = _cpu_model_and_memory_gib()
    facts: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": mem_gib,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in packages:
        facts[name] = importlib.import_module(name).__version__
    if "polars" in packages:
        facts["polars_threads"] = importlib.import_module("polars").thread_pool_size()
    if "tokenizers" in packages:  # the Rust tokenizer uses every core unless this says otherwise
        facts["TOKENIZERS_PARALLELISM"] = os.environ.get("TOKENIZERS_PARALLELISM")
    return facts


# ---------------------------------------------------------------------------------------------
# Clocks and memory


def cpu_s() -> float:
    """User + system CPU seconds of this process, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's children that have been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _status_mib(field: str, pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def process_peak_mib(pid: int) -> float:
    """Peak RSS (``VmHWM``) of a live process."""
    return _status_mib("VmHWM", pid)


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine, every process and core, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(values)
    return (total - values[3] - values[4]) / _TICK, total / _TICK  # busy: all but idle and iowait


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mib() -> float:
    return _status_mib("VmRSS")


_window_start_rss_mib: float | None = None


def reset_peak() -> float:
    """Start a fresh peak-RSS window (Linux ``clear_refs`` 5) and return the process's peak so far.

    Setup (imports, the tokenizer, loading the inputs) can peak higher than the measured work; after
    the reset ``VmHWM`` is the peak of what follows, starting from the RSS now.
    """
    global _window_start_rss_mib
    peak = maxrss_mib()
    with contextlib.suppress(OSError):  # not allowed: the figure stays the process's peak
        Path("/proc/self/clear_refs").write_text("5")
    _window_start_rss_mib = round(rss_mib(), 1)
    return round(peak, 1)


def window_start_rss_mib() -> float | None:
    """The RSS when the last ``reset_peak`` opened the window: the baseline its peak includes."""
    return _window_start_rss_mib


def window_peak_mib() -> float:
    """Peak RSS since the last ``reset_peak`` (``ru_maxrss`` keeps the peaks of threads that exited)."""
    peak = _status_mib("VmHWM")
    return round(peak if peak == peak else maxrss_mib(), 1)


class Clock:
    """Wall and CPU seconds of named spans, summed when a name repeats."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        w, c = time.perf_counter(), cpu_s()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w
            self.cpu[name] = self.cpu.get(name, 0.0) + cpu_s() - c

    def report(self) -> dict[str, Any]:
        return {
            "wall_s": {k: round(v, 4) for k, v in self.wall.items()},
            "cpu_s": {k: round(v, 4) for k, v in self.cpu.items()},
        }


def stats(values: list[float]) -> dict[str, float]:
    """Median, best (lowest) and worst of repeated timings."""
    return {"median": round(statistics.median(values), 3), "best": round(min(values), 3),
            "worst": round(max(values), 3), "n": len(values)}  # fmt: skip


def profiled(call: Callable[[], Any], *, top: int = 15) -> tuple[Any, list[dict[str, Any]]]:
    """``call()`` under cProfile, in this thread and in every thread it starts; its result, and the
    ``top`` functions by their own time (calls within them apart). Measured from outside: nothing is
    patched, but profiled code runs slower than it does alone, so the figures are shares of a
    profiled run, not timings of an unprofiled one."""
    profiles = [cProfile.Profile()]

    def in_each_new_thread(*_: Any) -> None:
        sys.setprofile(None)
        profiles.append(cProfile.Profile())
        profiles[-1].enable()

    threading.setprofile(in_each_new_thread)
    profiles[0].enable()
    try:
        result = call()
    finally:
        profiles[0].disable()
        threading.setprofile(None)  # type: ignore[arg-type]
    merged = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        merged.add(profile)
    rows = sorted(merged.stats.items(), key=lambda item: -item[1][2])[:top]  # type: ignore[attr-defined]
    return result, [
        {"function": f"{Path(path).name}:{line}({name})", "calls": calls, "own_s": round(own, 4),
         "cumulative_s": round(cumulative, 4)}
        for (path, line, name), (_, calls, own, cumulative, _) in rows
    ]  # fmt: skip


def set_texts(files: Iterable[Path], tokenizer: Any, batch_rows: int) -> Iterator[list[str]]:
    """A built training set's own texts, ``batch_rows`` rows a batch: each row's ids decoded run by
    run of its loss mask, which gives back the pieces the build tokenized (what precedes a turn of
    the assistant, the turn, its trailer)."""
    import pyarrow.parquet as pq

    decode = tokenizer.backend_tokenizer.decode_batch
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=["input_ids", "loss_mask"]):
            pieces = [
                [token for token, _ in run]
                for ids, mask in zip(batch.column("input_ids").to_pylist(), batch.column("loss_mask").to_pylist())
                for _, run in itertools.groupby(zip(ids, mask), key=operator.itemgetter(1))
            ]
            yield decode(pieces, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# A shared machine: how busy the other processes keep it

QUIET_CORES = 0.3  # other processes using less than this are "quiet"


def others_cores(seconds: float = 1.0) -> float:
    """Cores other processes keep busy, sampled over ``seconds`` while nothing of ours runs."""
    busy, start = machine_cpu_s()[0], time.perf_counter()
    time.sleep(seconds)
    return max(0.0, (machine_cpu_s()[0] - busy) / (time.perf_counter() - start))


def wait_for_quiet(max_wait_s: float) -> tuple[float, float]:
    """Wait (at most ``max_wait_s``) until other processes use under QUIET_CORES; (waited s, their cores)."""
    start = time.perf_counter()
    load = others_cores()
    while load >= QUIET_CORES and time.perf_counter() - start < max_wait_s:
        load = others_cores(2.0)
    return round(time.perf_counter() - start, 1), round(load, 2)


# ---------------------------------------------------------------------------------------------
# Measured work in a child process of its own


def emit(result: dict[str, Any]) -> None:
    """The child's side: hand the result to the parent."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def run_child(command: list[str], name: str, *, log: Path | None = None,
              quiet_wait_s: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Run a child that ends by ``emit``; its result, and its wall, CPU and peak RSS as this process
    sees them, with the cores other processes used meanwhile. Its stderr goes to ``log`` if given.
    With ``quiet_wait_s`` (0 included) it first samples the others' load, waiting that long at most
    for them to calm down."""
    waited, before = (0.0, None) if quiet_wait_s is None else wait_for_quiet(quiet_wait_s)
    busy, ours, start = machine_cpu_s()[0], children_cpu_s(), time.perf_counter()
    with open(log, "a") if log else contextlib.nullcontext() as out:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=out or subprocess.PIPE, text=True, cwd=ROOT)
        if out:
            out.write(done.stdout)
    wall, cpu = time.perf_counter() - start, children_cpu_s() - ours
    if done.returncode != 0:
        if done.stderr:
            sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{name} failed with exit status {done.returncode}" + (f"; see {log}" if log else ""))
    [line, *_] = [x for x in reversed(done.stdout.splitlines()) if x.startswith(RESULT_MARK)]
    figures = {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        # ru_maxrss of the children is the largest of any child reaped so far.
        "peak_rss_mib_any_process": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "others_cores": round(max(0.0, machine_cpu_s()[0] - busy - cpu) / wall, 2),
        "others_cores_before": before,
        "quiet_wait_s": waited,
    }
    return json.loads(line[len(RESULT_MARK) :]), figures


def add_phase_options(parser: argparse.ArgumentParser, phases: Iterable[str], *, quiet_wait_s: float) -> None:
    """The options of a benchmark whose phases run in child processes of its own, on cached data."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="cache of the generated data")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON result")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=quiet_wait_s,
        help="before each phase, wait up to this many seconds for other processes to use under "
        f"{QUIET_CORES} cores (default {quiet_wait_s:g}; 0 never waits)",
    )
    parser.add_argument("--phase", choices=sorted(phases), help=argparse.SUPPRESS)  # the child's side
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)


def run_phase_here(phase: Callable[[Any], dict[str, Any]], args: Any, *, preload: Iterable[str]) -> None:
    """The child's side of ``run_phase``: import ``preload`` first (the same modules for every phase,
    so that no import is ever timed), run the phase, add its memory figures, hand the result over."""
    for module in preload:
        importlib.import_module(module)
    start_rss = rss_mib()
    result = phase(args)
    result["start_rss_mib"] = round(start_rss, 1)
    result["window_start_rss_mib"] = window_start_rss_mib()
    result.setdefault("maxrss_mib", window_peak_mib())  # since the phase's reset_peak: its measured work
    result["process_peak_rss_mib"] = round(maxrss_mib(), 1)  # the whole process, setup included
    result["rss_end_mib"] = round(rss_mib(), 1)
    emit(result)


def run_phase(command: list[str], phase: str, *, quiet_wait_s: float) -> dict[str, Any]:
    """``run_child`` for one phase of a benchmark, first waiting for the machine to be quiet; the
    result with the phase process's wall time and the cores other processes used meanwhile."""
    result, figures = run_child(command, f"phase {phase}", quiet_wait_s=quiet_wait_s)
    result["process_s"] = figures["wall_s"]
    for key in ("others_cores", "others_cores_before", "quiet_wait_s"):
        result[key] = figures[key]
    return result


# ---------------------------------------------------------------------------------------------
# Ports and bare HTTP servers


def free_ports(count: int, start: int) -> int:
    """The first port >= ``start`` beginning ``count`` consecutive free ports on 127.0.0.1."""
    return free_port_block(count, range(start, 65536), HOST)[0]


LISTENING = "listening on port "


async def serve_http(respond: Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]) -> None:
    """A bare HTTP/1.1 server on ``HOST``, on a port the system gives, said on stdout once it listens
    (``LISTENING``): each request on a kept-alive connection is read whole (head and
    ``content-length`` body) and ``respond`` writes the answer, given the request's head. The network
    benchmarks measure the client, so the server does as little as HTTP allows."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            await reader.readexactly(length)
            await respond(head, writer)

    server = await asyncio.start_server(handle, HOST, 0)
    async with server:
        print(LISTENING + str(server.sockets[0].getsockname()[1]), flush=True)
        await server.serve_forever()


@contextlib.contextmanager
def http_server_child(command: list[str]) -> Iterator[str]:
    """A child process that runs ``serve_http``, its URL once it listens; stopped on exit."""
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith(LISTENING):
            raise RuntimeError(f"the server child did not start (exit status {server.poll()}): {line!r}")
        yield f"http://{HOST}:{int(line[len(LISTENING):])}"
    finally:
        server.terminate()
        server.wait(10)


# ---------------------------------------------------------------------------------------------
# The JSON result


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it again (the interpreter relative to the repository)."""
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):
        python = python.relative_to(ROOT)
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return " ".join([str(python), str(script), *(sys.argv[1:] if argv is None else argv)])


def now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


SIMULATOR_LABEL = "SIMULATOR figures (expansion_dag.sim), not GPU figures"


def header(benchmark: str, *packages: str, simulator: bool, argv: list[str] | None = None) -> dict[str, Any]:
    """The fields every result starts with: what ran, when, how, where, and whether the servers were
    the simulator (every figure of such a run is a simulator figure, never a GPU one)."""
    document: dict[str, Any] = {
        "benchmark": benchmark,
        "started": now_utc().isoformat(timespec="seconds"),
        "command": command_line(argv),
        "machine": machine(*packages),
        "simulator": simulator,
    }
    if simulator:
        document["label"] = SIMULATOR_LABEL
    return document


def write_result(benchmark: str, document: dict[str, Any], *, out_dir: Path | None = None,
                 path: Path | None = None) -> Path:  # fmt: skip
    """Write ``document`` as ``<out_dir>/<benchmark>-<UTC time>.json`` (or at ``path``); its path.
    The machine's load average at the end goes in beside the one at the start."""
    if isinstance(document.get("machine"), dict):
        document["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if path is None:
        path = (out_dir or RESULTS_DIR) / f"{benchmark}-{now_utc().strftime('%Y%m%dT%H%M%SZ')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
