"""Helpers shared by the benchmarks: `--quick` / `--json FILE` / `--clock` arguments, best-of-N timing,
result tables, flat JSON output, and running a peer script under a second interpreter (e.g. one with LMCache).

`--clock cpu` times by this process's CPU time instead of the wall clock: on a shared machine whose other
processes keep every core busy, the wall clock of a single-threaded copy mostly measures how often the OS ran
it; the CPU time does not count the time it waited (it still counts cache and memory contention). Use it with
`--threads 1` only: with more threads it adds up every thread's time (spin-waits included).

Conventions: throughputs are decimal (GB/s = 1e9 bytes/s, tokens/s); every ratio is a key ending in
`_ratio`, defined so that > 1 means lmcache-vllm is better.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # benchmarks run as scripts: make the package importable uninstalled
    sys.path.insert(0, REPO_ROOT)
PEERS_DIR = os.path.join(REPO_ROOT, "benchmarks", "peers")


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock: Callable[[], float] = time.perf_counter


def add_clock_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall (default) or cpu: this process's CPU time, for a busy shared machine with "
                             "--threads 1 (see benchmarks/_common.py)")


def set_clock(name: str) -> None:
    """Makes `clock()` (and every timing helper here) use `name` from CLOCKS."""
    global _clock
    _clock = CLOCKS[name]


def clock() -> float:
    return _clock()


def parse_args(description: str, add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
               ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 1 minute)")
    parser.add_argument("--json", metavar="FILE", help="write all results as one flat JSON object")
    add_clock_argument(parser)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    set_clock(args.clock)
    return args


def time_once(fn: Callable[[], object]) -> float:
    start = clock()
    fn()
    return clock() - start


def timings(fn: Callable[[], object], repeats: int, warmup: int = 1,
            setup: Optional[Callable[[], object]] = None) -> list[float]:
    """Seconds of `repeats` runs of `fn` after `warmup` untimed runs; `setup` runs untimed before each."""
    out = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        elapsed = time_once(fn)
        if i >= warmup:
            out.append(elapsed)
    return out


def best_of(fn: Callable[[], object], repeats: int, warmup: int = 1,
            setup: Optional[Callable[[], object]] = None) -> float:
    """The fastest of `repeats` runs: on a noisy shared machine the minimum is the least disturbed."""
    return min(timings(fn, repeats, warmup, setup))


def median_of(fn: Callable[[], object], repeats: int, warmup: int = 1,
              setup: Optional[Callable[[], object]] = None) -> float:
    return statistics.median(timings(fn, repeats, warmup, setup))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def print_table(title: str, rows: Iterable[tuple], headers: tuple) -> None:
    rows = [tuple(_fmt(v) for v in row) for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    print(f"\n== {title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-2):
            return f"{value:.3e}"
        return f"{value:.3f}"
    return str(value)


def report_gbps(title: str, results: dict, json_path: Optional[str]) -> None:
    """Prints every `*_gbps` result as a table and every `*_ratio` on its own line; writes the JSON."""
    rows = [(name[:-5], value) for name, value in results.items() if name.endswith("_gbps")]
    print_table(title, rows, ("path", "GB/s"))
    for name, value in results.items():
        if name.endswith("_ratio"):
            print(f"{name}: {value:.2f}")
    write_json(json_path, results)


def write_configurations(path: Optional[str], results: dict, rows: dict[str, dict], failed: dict[str, str]) -> None:
    """The results of a benchmark of whole configurations: `results` (ratios and what was run), each row's figures as
    `<configuration>.<key>` and each failed configuration's reason; prints the ratios, writes the JSON, and exits
    non-zero when a configuration failed."""
    results = {**results, **{f"{name}.failed": why for name, why in failed.items()}}
    for name, row in rows.items():
        results.update((f"{name}.{key}", value) for key, value in row.items() if key != "name")
    for key, value in results.items():
        if key.endswith("_ratio"):
            print(f"{key}: {value:.2f}")
    write_json(path, results)
    if failed:
        raise SystemExit(f"failed configurations: {', '.join(failed)}")


def write_json(path: Optional[str], results: dict) -> None:
    """Writes `results` (must be flat: str keys, scalar values) to `path` when given."""
    for key, value in results.items():
        if isinstance(value, (dict, list, tuple)):
            raise ValueError(f"benchmark results must be flat; {key!r} is a {type(value).__name__}")
    if path:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2, sort_keys=True)
        print(f"\nwrote {path}")


def run_peer(python: str, script: str, args: list[str], timeout: float = 600) -> dict:
    """Runs benchmarks/peers/<script> under `python`; its last stdout line must be a JSON object."""
    # The peer runs with its own directory as cwd: resolve a relative interpreter path here.
    python = os.path.abspath(python) if os.sep in python else (shutil.which(python) or python)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peer must not pick up lmcache_vllm by accident
    env.setdefault("PYTHONHASHSEED", "0")  # LMCache's builtin hash needs it to be reproducible
    proc = subprocess.run([python, os.path.join(PEERS_DIR, script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=PEERS_DIR)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"peer {script} under {python} failed (rc={proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def drop_page_cache(directory: str) -> None:
    """Flushes every file in `directory` and evicts it from the page cache, so the next read is cold."""
    for name in os.listdir(directory):
        if name.startswith("."):  # the tier's shared usage count, temp files: not chunks
            continue
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tier_chunks(args: argparse.Namespace) -> tuple[int, tuple, int]:
    """(chunks, chunk shape, repeats) of a tier benchmark from its --chunks, --chunk-mib (default 4 MiB, 2 with
    --quick) and --repeats (default 7, 3 with --quick): bf16 chunks of 32 layers x K/V x tokens x 1024."""
    chunk_mib = args.chunk_mib or (2.0 if args.quick else 4.0)
    hidden = 1024
    tokens = max(1, int(chunk_mib * (1 << 20) / (32 * 2 * hidden * 2)))
    return args.chunks, (32, 2, tokens, hidden), args.repeats or (3 if args.quick else 7)


def staged_chunks(num: int, shape: tuple):
    """What the tier benchmarks write from and read into: `num` random bf16 chunks of `shape`, their keys,
    copies of them in a source arena, and an empty destination arena whose pages are already faulted in
    (so the first timed read does not pay for that). Returns (chunks, keys, src_objs, dst_alloc)."""
    import torch

    from lmcache_vllm.memory import HostAllocator

    chunks = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
              for i in range(num)]
    total = sum(t.numel() * t.element_size() for t in chunks)
    keys = [f"bench@1@0@bfloat16@v1@{i:064x}" for i in range(num)]
    src_alloc = HostAllocator(total + 4096 * num)
    src_objs = []
    for t in chunks:
        obj = src_alloc.allocate(t.shape, t.dtype)
        obj.tensor.copy_(t)
        src_objs.append(obj)
    dst_alloc = HostAllocator(total + 4096 * num)
    dst_alloc.arena.fill_(0)
    return chunks, keys, src_objs, dst_alloc


def serve_raw(buffers: list) -> int:
    """A loopback listener on a thread of its own that sends every one of `buffers` (numpy arrays) to each
    connection, then closes it: the raw side `read_raw` reads from. Returns its port."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                for buffer in buffers:
                    conn.sendall(buffer)

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


def read_raw(port: int, buffer) -> float:
    """Seconds to receive len(`buffer`) bytes from a loopback server on `port` into `buffer` (a preallocated numpy
    array): the floor a transfer between instances is compared with (one kernel copy, nothing checked)."""
    nbytes = len(buffer)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        view, got = memoryview(buffer), 0
        while got < nbytes:
            got += sock.recv_into(view[got:], nbytes - got)
    return time.perf_counter() - t0


def pulls_against_raw(mgr, keys: list[str], prefetch: Callable[[int], object], raw_port: int, buffer,
                      repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each pull of `keys` into `mgr`'s emptied L1 (`prefetch(round)` returns the prefetch handle),
    alternating with reading the same bytes raw from `raw_port` (`read_raw`); the first round warms both up
    and is left out. RuntimeError when a pull brings fewer chunks."""
    ours, raw = [], []
    for rep in range(repeats + 1):
        raw_s = read_raw(raw_port, buffer)
        mgr.l1.clear_sync()
        t0 = time.perf_counter()
        handle = prefetch(rep)
        got = handle.wait(120)  # type: ignore[attr-defined]
        ours_s = time.perf_counter() - t0
        if got != len(keys):
            raise RuntimeError(f"pulled {got} of {len(keys)} chunks")
        for obj in mgr.get(keys, owner=handle.owner, lower_tiers=False):  # type: ignore[attr-defined]
            obj.ref_down()
        if rep:
            ours.append(ours_s)
            raw.append(raw_s)
    return ours, raw


def process_group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds the live processes of process group `pgid` have used (a server's work: unlike
    its wall time, barely stretched by other processes on a shared machine; an idle vLLM server uses ~1 %)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ... utime(11) stime(12)
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def server_process_group(log_text: str) -> int:
    """The process group of a vLLM OpenAI server (API server, engine core, workers) from its log."""
    match = re.search(r"Started server process \[(\d+)\]", log_text)
    if match is None:
        raise RuntimeError("no 'Started server process' line in the server's log")
    return os.getpgid(int(match.group(1)))


# The core vLLM's one compute rank binds itself to in every serving benchmark: `vllm_jobs.vllm_env`'s default
# VLLM_CPU_OMP_THREADS_BIND=0.
COMPUTE_CPUS = frozenset({0})


def cpus_beside_compute(compute: frozenset[int] = COMPUTE_CPUS) -> list[int]:
    """The CPUs of this process's affinity that the compute rank leaves free (for front ends, our threads)."""
    return sorted(os.sched_getaffinity(0) - compute)


def front_ends_beside_compute(compute: frozenset[int] = COMPUTE_CPUS) -> list[int]:
    """Moves this benchmark, and so every process it starts from now on (vLLM's API server and engine core, the
    load generator, a proxy, Redis, LMCache's server), onto the CPUs the compute rank (VLLM_CPU_OMP_THREADS_BIND=0)
    leaves free; vLLM's worker binds itself to its own. Left unbound, the Linux scheduler ran the API server and
    the engine core on the compute core too, taking the model's time: in 5-second samples of a serving pass
    (`/proc`) the API server's threads were last seen there in 43-58 %, the engine core's main thread in 23-28 %.
    Returns the CPUs; [] (nothing moved) on a host with none to spare."""
    free = cpus_beside_compute(compute)
    if free:
        os.sched_setaffinity(0, free)
    return free


def cpu_model() -> str:
    """The CPU's model name (the benchmarks' figures depend on it: AMD EPYC or Intel with AMX here)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def start_redis(workdir: str, *extra_args: str):
    """A redis-server (no persistence) on a free loopback port: (process, URL)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--proto-max-bulk-len", "1gb", *extra_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")
