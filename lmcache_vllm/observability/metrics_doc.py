"""The metric table of docs/METRICS.md, generated from `metrics.METRICS` so that it cannot drift from the code
(tests/test_metrics_names.py compares the document with `markdown()`).

    python -m lmcache_vllm.observability.metrics_doc              # print the table
    python -m lmcache_vllm.observability.metrics_doc --update-docs  # write it into docs/METRICS.md
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from lmcache_vllm.config import doc as config_doc
from lmcache_vllm.observability.metrics import METRIC_LIST, PREFIX, MetricDef

BEGIN = "<!-- BEGIN generated metrics -->"
END = "<!-- END generated metrics -->"
METRICS_DOC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "METRICS.md")


def exposed_name(d: MetricDef) -> str:
    """The name(s) Prometheus shows."""
    name = PREFIX + d.name
    if d.kind == "counter":
        return f"`{name}_total`"
    if d.kind == "histogram":
        return f"`{name}_bucket` / `_sum` / `_count`"
    return f"`{name}`"


def _counted(d: MetricDef) -> str:
    if d.kind == "gauge":
        return f"latest per process, {d.gauge_agg} over processes"
    return "once per engine" if d.scope == "engine" else "every TP rank, summed"


def markdown() -> str:
    lines = [BEGIN, "", "| metric | type | unit | labels | counted | meaning |", "|---|---|---|---|---|---|"]
    for d in METRIC_LIST:
        labels = ", ".join(f"`{label}`" for label in d.labels) or "-"
        lines.append(f"| {exposed_name(d)} | {d.kind} | {d.unit} | {labels} | {_counted(d)} | "
                     f"{d.help.replace('|', '/')} |")
    lines += ["", END]
    return "\n".join(lines)


def generated_section(text: str) -> Optional[str]:
    return config_doc.generated_section(text, BEGIN, END)


def update_doc(path: str = METRICS_DOC) -> None:
    config_doc.update_doc(path, BEGIN, END, markdown())


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--update-docs"]:
        update_doc()
    elif not args:
        print(markdown())
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
