"""What `inspect` finds in a tier (`TierReport`), built chunk by chunk, and how the CLI prints results:
`--json` for scripts, aligned tables for people. A chunk's namespace is `model@fingerprint` from its
key (`CacheKey.from_str`); `--model` filters match the whole namespace or the model name alone. A model
with several KV cache groups (hybrid: sliding window, Mamba states) is also counted per group (the key's
group tag, e.g. `swa4096.l1.3`; "-" for a model with one group)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from lmcache_vllm.tokens import CacheKey

MAX_LISTED_PROBLEMS = 50


def namespace_of(key: str) -> str | None:
    """`model@fingerprint` of a key string ("-" when it has no fingerprint), None if it is not a key."""
    try:
        parsed = CacheKey.from_str(key)
    except ValueError:
        return None
    return f"{parsed.model}@{parsed.fingerprint or '-'}"


def namespace_matches(namespace: str | None, wanted: str | None) -> bool:
    if wanted is None:
        return True
    if namespace is None:
        return False
    return namespace == wanted or namespace.split("@", 1)[0] == wanted


@dataclass
class GroupReport:
    chunks: int = 0
    bytes: int = 0


@dataclass
class NamespaceReport:
    chunks: int = 0
    bytes: int = 0
    oldest: float | None = None  # unix time (disk: file mtime; redis: now - idle time)
    newest: float | None = None
    groups: dict[str, GroupReport] = field(default_factory=dict)  # by KV cache group tag ("-": one group)

    def add(self, size: int, when: float | None, group: str = "") -> None:
        counts = self.groups.setdefault(group or "-", GroupReport())
        counts.chunks += 1
        counts.bytes += size
        self.chunks += 1
        self.bytes += size
        if when is not None:
            self.oldest = when if self.oldest is None else min(self.oldest, when)
            self.newest = when if self.newest is None else max(self.newest, when)


@dataclass
class TierReport:
    tier: str  # "disk" | "redis"
    location: str
    chunks: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None
    namespaces: dict[str, NamespaceReport] = field(default_factory=dict)
    corrupt: list[dict[str, str]] = field(default_factory=list)  # {"entry", "reason"}, first ones
    num_corrupt: int = 0
    other_format: int = 0  # entries of another stored-format version (another lmcache-vllm build)
    ignored: int = 0  # entries that are not ours at all
    verified: bool = False  # payload checksums were checked too
    time_note: str = ""
    nodes: dict[str, int] = field(default_factory=dict)  # Redis: chunks per node (cluster primaries)

    def add_chunk(self, key: str, size: int, when: float | None) -> None:
        namespace = namespace_of(key) or "?"
        try:
            group = CacheKey.from_str(key).group
        except ValueError:
            group = ""
        self.namespaces.setdefault(namespace, NamespaceReport()).add(size, when, group)
        self.chunks += 1
        self.bytes += size
        if when is not None:
            self.oldest = when if self.oldest is None else min(self.oldest, when)
            self.newest = when if self.newest is None else max(self.newest, when)

    def add_corrupt(self, entry: str, reason: str) -> None:
        self.num_corrupt += 1
        if len(self.corrupt) < MAX_LISTED_PROBLEMS:
            self.corrupt.append({"entry": entry, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_report(report: TierReport) -> str:
    lines = [f"{report.tier} {report.location}: {report.chunks} chunks, {human_bytes(report.bytes)}",
             f"  oldest {_when(report.oldest)}, newest {_when(report.newest)}{report.time_note}"]
    if report.namespaces:
        rows = [(ns, r.chunks, human_bytes(r.bytes), _when(r.oldest), _when(r.newest))
                for ns, r in sorted(report.namespaces.items())]
        lines += ["", table(("namespace (model@fingerprint)", "chunks", "bytes", "oldest", "newest"), rows)]
        grouped = [(ns, group, g.chunks, human_bytes(g.bytes)) for ns, r in sorted(report.namespaces.items())
                   for group, g in sorted(r.groups.items()) if group != "-" or len(r.groups) > 1]
        if grouped:
            lines += ["", table(("namespace", "KV cache group", "chunks", "bytes"), grouped)]
    if len(report.nodes) > 1:
        lines += ["", table(("node", "chunks"), sorted(report.nodes.items()))]
    checked = "headers, sizes and payload checksums" if report.verified else "headers and sizes"
    lines += ["", f"corrupt entries: {report.num_corrupt} (checked {checked})"]
    for problem in report.corrupt:
        lines.append(f"  {problem['entry']}: {problem['reason']}")
    if report.num_corrupt > len(report.corrupt):
        lines.append(f"  ... and {report.num_corrupt - len(report.corrupt)} more")
    if report.other_format:
        lines.append(f"entries of another stored-format version (left alone): {report.other_format}")
    if report.ignored:
        lines.append(f"entries that are not lmcache-vllm chunks (left alone): {report.ignored}")
    return "\n".join(lines)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True)
