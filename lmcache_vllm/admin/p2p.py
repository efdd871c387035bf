"""`inspect --p2p URL`: what a P2P directory lists (storage/p2p/directory.py): every registered server (a TP
rank of an instance), where it serves, how many chunks it lists and what Redis spends on them (`MEMORY USAGE`
of its chunk set), grouped by instance. Read with the directory's own code, in one short asyncio run."""
from __future__ import annotations

import asyncio
from typing import Any

from lmcache_vllm.admin.report import human_bytes, table
from lmcache_vllm.config.remote_url import parse_remote_url
from lmcache_vllm.storage.p2p.directory import Directory
from lmcache_vllm.storage.redis.client import ClientSettings, async_client


async def _read(url: str, prefix: str, settings: ClientSettings) -> dict[str, Any]:
    directory = Directory(async_client(parse_remote_url(url), settings), f"{prefix}p2p:", lease_s=1.0)
    try:
        servers = await asyncio.wait_for(directory.servers(fresh=True), settings.timeout * 4)
        counts = await asyncio.wait_for(directory.counts([s.sid for s in servers]), settings.timeout * 4)
    finally:
        await directory.close()
    instances: dict[str, dict[str, Any]] = {}
    for server, (entries, used) in zip(servers, counts):
        inst = instances.setdefault(server.instance, {"instance": server.instance, "entries": 0, "bytes": 0,
                                                      "servers": []})
        inst["servers"].append({"server": server.sid, "rank": server.rank, "tp": server.tp, "host": server.host,
                                "port": server.port, "entries": entries, "bytes": used,
                                "key_spaces": sorted(server.spaces)})
        inst["entries"] += entries
        inst["bytes"] += used
    total = sum(c[0] for c in counts)
    used = sum(c[1] for c in counts)
    return {"url": parse_remote_url(url).display(), "prefix": prefix, "instances": list(instances.values()),
            "entries": total, "bytes": used, "bytes_per_entry": round(used / total, 1) if total else None}


def inspect_p2p(url: str, prefix: str, settings: ClientSettings) -> dict[str, Any]:
    return asyncio.run(_read(url, prefix, settings))


def format_p2p(report: dict[str, Any]) -> str:
    rows = [(inst["instance"], f"{s['rank']}/{s['tp']}", f"{s['host']}:{s['port']}", s["entries"],
             human_bytes(s["bytes"])) for inst in report["instances"] for s in inst["servers"]]
    per = report["bytes_per_entry"]
    lines = [f"P2P directory {report['url']} (prefix {report['prefix']!r}): {len(report['instances'])} instance(s), "
             f"{report['entries']} entries, {human_bytes(report['bytes'])}"
             + (f" ({per} bytes per entry)" if per is not None else "")]
    if rows:
        lines += ["", table(("instance", "rank/tp", "serves on", "entries", "directory memory"), rows)]
    return "\n".join(lines)
