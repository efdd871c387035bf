"""Benchmark of the L3 Redis tier scaled out: aggregate chunk GET/SET throughput on a Redis Cluster of 1, 2
and 3 nodes against one plain redis-server, and the single-server path against today's client.

Every deployment is started here on free loopback ports (tests/redis_servers.py), no persistence. Measured
in the same run, on the same chunks:
- `single`: one redis-server through `redis://` (the baseline of the scaling ratios);
- `clusterN`: a Redis Cluster of N primaries through `redis-cluster://`: the tier splits each batch by node
  and runs one pipeline per node concurrently;
- `baseline_single`: the previous single-server implementation of the tier (storage/redis_backend.py as
  of `--baseline-rev`, loaded from git) on the same server, against our `single` (`*_vs_before_ratio`);
  also the process CPU time per put and per read of 2 KiB chunks, where the client's own work dominates
  (`small_*_cpu_before_vs_ours_ratio`, > 1: ours spends less).
A round = `--clients` backends (each its own connections, as separate vLLM instances would have) storing, then
reading, `--chunks` chunks each concurrently; throughput = all their bytes / the round's time, best of
`--repeats` rounds, taken in turn over the deployments in alternating order (a busy minute of a shared
machine falls on all).
The client is one Python process and every server runs on this machine: with few cores the servers, the
client's event loop and its decode threads share them, so the scaling measured here is the tier's overhead
and its parallel per-node pipelines, not what more machines would give (the table names the CPU and cores).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests"))
import redis_servers  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.storage.redis import RedisBackend  # noqa: E402

OLD_MODULE = "lmcache_vllm/storage/redis_backend.py"


def add_arguments(parser) -> None:
    parser.add_argument("--chunks", type=int, default=None, help="chunks per client (default 48, quick 24)")
    parser.add_argument("--chunk-mib", type=float, default=None, help="MiB per chunk (default 1, quick 0.5)")
    parser.add_argument("--clients", type=int, default=2, help="concurrent tier instances")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--nodes", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--baseline-rev", default=None,
                        help=f"git revision of the previous {OLD_MODULE} (default: the last one that had it)")


def load_previous_backend(rev: str | None):
    """The RedisBackend class of the tier before the cluster work, from git (None if git cannot give it)."""
    root = _common.REPO_ROOT
    try:
        if rev is None:
            # the newest commit (merges included) that still has it: the tier just before storage/redis/
            revs = subprocess.run(["git", "rev-list", "--full-history", "HEAD", "--", OLD_MODULE], cwd=root,
                                  check=True, capture_output=True, text=True).stdout.split()
            rev = next(r for r in revs if subprocess.run(["git", "cat-file", "-e", f"{r}:{OLD_MODULE}"], cwd=root,
                                                         capture_output=True).returncode == 0)
        source = subprocess.run(["git", "show", f"{rev}:{OLD_MODULE}"], cwd=root, check=True, capture_output=True,
                                text=True).stdout
    except (OSError, subprocess.CalledProcessError, StopIteration) as exc:
        print(f"no previous backend from git ({exc}); skipping the comparison with it")
        return None, None
    path = Path(tempfile.mkdtemp(prefix="lmcache-bench-old-")) / "previous_redis_backend.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("previous_redis_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RedisBackend, rev


class Deployment:
    """`clients` tier instances of `backend_cls` on one deployment, each with its own share of the chunks."""

    def __init__(self, label: str, backend_cls, url: str, args, data):
        chunks, keys, objs, self.dst_alloc = data
        config = LMCacheConfig(remote_url=url, extra_config={"remote_key_prefix": f"{label}:",
                                                             "remote_timeout_secs": 30.0})
        self.label = label
        self.backends = [backend_cls(config) for _ in range(args.clients)]
        self.keys = [keys[c::args.clients] for c in range(args.clients)]
        self.objs = [objs[c::args.clients] for c in range(args.clients)]
        self.total = sum(t.numel() * t.element_size() for t in chunks)
        self.put_s: list[float] = []
        self.get_s: list[float] = []

    async def round(self) -> None:
        """Empties the pool, stores every chunk (timed), reads every chunk back (timed)."""
        await self.backends[0].clear()
        start = time.perf_counter()
        ok = await asyncio.gather(*(b.put(k, o) for b, ks, os_ in zip(self.backends, self.keys, self.objs)
                                    for k, o in zip(ks, os_)))
        self.put_s.append(time.perf_counter() - start)
        if not all(ok):
            raise SystemExit(f"{self.label}: {ok.count(False)} puts failed")
        start = time.perf_counter()
        got = await asyncio.gather(*(b.get_many(ks, lambda s, d: self.dst_alloc.allocate(s, d))
                                     for b, ks in zip(self.backends, self.keys)))
        self.get_s.append(time.perf_counter() - start)
        objs_read = [o for group in got for o in group]
        if any(o is None for o in objs_read):
            raise SystemExit(f"{self.label}: {sum(o is None for o in objs_read)} misses")
        for o in objs_read:
            o.ref_down()

    def gbps(self) -> tuple[float, float]:
        """(SET, GET) GB/s of the best round after the first (which warms connections and pages)."""
        return _common.gbps(self.total, min(self.put_s[1:])), _common.gbps(self.total, min(self.get_s[1:]))

    async def close(self) -> None:
        await self.backends[0].clear()
        for b in self.backends:
            await b.close()


async def measure(deployments: list[Deployment], repeats: int) -> None:
    """Rounds taken in turn, deployment after deployment (order reversed every other time): a busy minute of
    a shared machine falls on all."""
    for repeat in range(repeats + 1):
        for deployment in deployments if repeat % 2 else deployments[::-1]:  # none always goes first
            await deployment.round()
    for deployment in deployments:
        await deployment.close()


async def cpu_per_op(backends: dict, count: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median process CPU seconds per put and per read chunk of small (2 KiB) chunks, where the client's own
    work dominates: CPU time, unlike wall time, hardly moves with other jobs on a shared machine."""
    chunks, keys, objs, dst_alloc = _common.staged_chunks(count, (2, 2, 4, 64))
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in backends}
    for repeat in range(rounds + 1):
        order = list(backends.items())
        for name, backend in order if repeat % 2 else order[::-1]:  # neither always goes first
            await backend.clear()
            start = time.process_time()
            if not all(await asyncio.gather(*(backend.put(k, o) for k, o in zip(keys, objs)))):
                raise SystemExit(f"{name}: puts failed")
            put_s = time.process_time() - start
            start = time.process_time()
            got = await backend.get_many(keys, lambda s, d: dst_alloc.allocate(s, d))
            get_s = time.process_time() - start
            for obj in got:
                obj.ref_down()
            if repeat:
                times[name][0].append(put_s / count)
                times[name][1].append(get_s / count)
    for backend in backends.values():
        await backend.clear()
        await backend.close()
    return {name: (statistics.median(p), statistics.median(g)) for name, (p, g) in times.items()}


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    args.chunks = args.chunks or (24 if args.quick else 48)
    args.repeats = args.repeats or (3 if args.quick else 5)
    chunk_mib = args.chunk_mib or (0.5 if args.quick else 1.0)
    hidden = 1024
    tokens = max(1, int(chunk_mib * (1 << 20) / (16 * 2 * hidden * 2)))
    num = args.chunks * args.clients
    data = _common.staged_chunks(num, (16, 2, tokens, hidden))
    previous, rev = load_previous_backend(args.baseline_rev)
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-bench-cluster-"))
    res: dict = {"chunks": num, "chunk_bytes": data[0][0].numel() * 2, "clients": args.clients,
                 "repeats": args.repeats, "cpu": _common.cpu_model(), "cores": os.cpu_count() or 0}
    proc, single_url = _common.start_redis(str(workdir))
    clusters = []
    try:
        for n in args.nodes:
            clusters.append((n, redis_servers.ClusterProcesses(workdir / f"cluster{n}", primaries=n).start()))
        specs = [("single", RedisBackend, single_url)]
        if previous is not None:
            specs.append(("baseline_single", previous, single_url))
            res["baseline_rev"] = rev
        specs += [(f"cluster{n}", RedisBackend, cluster.url) for n, cluster in clusters]

        async def run_all() -> list[Deployment]:
            deployments = [Deployment(label, cls, url, args, data) for label, cls, url in specs]
            await measure(deployments, args.repeats)
            return deployments
        for deployment in asyncio.run(run_all()):
            res[f"{deployment.label}_put_gbps"], res[f"{deployment.label}_get_gbps"] = deployment.gbps()
        if previous is not None:
            res["single_put_vs_before_ratio"] = res["single_put_gbps"] / res["baseline_single_put_gbps"]
            res["single_get_vs_before_ratio"] = res["single_get_gbps"] / res["baseline_single_get_gbps"]
            config = LMCacheConfig(remote_url=single_url, extra_config={"remote_key_prefix": "cpu:",
                                                                        "remote_timeout_secs": 30.0})
            cpu = asyncio.run(cpu_per_op({"ours": RedisBackend(config), "before": previous(config)},
                                         count=500 if args.quick else 1000, rounds=args.repeats))
            for name, (put_s, get_s) in cpu.items():
                res[f"{name}_small_put_cpu_us"], res[f"{name}_small_get_cpu_us"] = put_s * 1e6, get_s * 1e6
            # > 1: ours spends less CPU per chunk than before
            res["small_put_cpu_before_vs_ours_ratio"] = cpu["before"][0] / cpu["ours"][0]
            res["small_get_cpu_before_vs_ours_ratio"] = cpu["before"][1] / cpu["ours"][1]
        for n, _ in clusters:
            res[f"cluster{n}_put_vs_single_ratio"] = res[f"cluster{n}_put_gbps"] / res["single_put_gbps"]
            res[f"cluster{n}_get_vs_single_ratio"] = res[f"cluster{n}_get_gbps"] / res["single_get_gbps"]
            if n != args.nodes[0]:
                first = args.nodes[0]
                res[f"cluster{n}_get_vs_cluster{first}_ratio"] = res[f"cluster{n}_get_gbps"] / \
                    res[f"cluster{first}_get_gbps"]
    finally:
        for _, cluster in clusters:
            cluster.stop()
        proc.kill()
        proc.wait()
    for name in ("ours", "before"):
        if f"{name}_small_put_cpu_us" in res:
            print(f"{name}: CPU per small chunk: put {res[f'{name}_small_put_cpu_us']:.0f} us, "
                  f"read {res[f'{name}_small_get_cpu_us']:.0f} us")
    _common.report_gbps(f"redis tier scaled out: {args.clients} clients x {args.chunks} chunks x "
                        f"{res['chunk_bytes'] / 2**20:.2f} MiB, best of {res['repeats']} (GB/s); "
                        f"{res['cpu']}, {res['cores']} cores", res, args.json)


if __name__ == "__main__":
    main()
