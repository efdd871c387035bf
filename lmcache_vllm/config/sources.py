"""Where configuration values come from: the YAML file (each value with its file and line), the
`LMCACHE_*` environment, and the mapping given in code; each value becomes an `Entry` with its `Origin`.

Reading never raises: a file that cannot be read, is not UTF-8, is not YAML or is not a mapping is a
`Problem` naming `LMCACHE_CONFIG_FILE` and the place, and loading goes on with the other sources so
that one error lists everything.

Reading is bounded, so that a configuration cannot exhaust memory, time or the stack: the file is at
most `MAX_FILE_BYTES`; its YAML is scanned as events first (no recursion) and refused when nested
deeper than `MAX_DEPTH` or using more than `MAX_ALIASES` aliases; the composed document is refused
when, with every alias expanded, it has more than `MAX_NODES` nodes ("billion laughs": a few aliases
can name 10**9 strings). Values from the environment and from code get the same bounds
(`value_problem`), strings at most `MAX_VALUE_CHARS` characters. A real configuration is far inside all
of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import yaml

from lmcache_vllm.config.fields import MISSING, Origin, Problem

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 20
MAX_ALIASES = 100
MAX_NODES = 10_000
MAX_VALUE_CHARS = 64 << 10
# libyaml's parser where PyYAML was built with it (several times faster), else PyYAML's own.
_EVENT_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
ENV_PREFIX = "LMCACHE_"
OVERRIDES_SOURCE = "kv_connector_extra_config"

# lmcache-vllm's own LMCACHE_* variables that are not configuration keys: never warned about. Every
# LMCACHE_ name in the repository is one of these or a key (tests/test_config_lmcache.py checks).
OWN_ENV_VARS = {
    CONFIG_FILE_ENV: "the YAML configuration file",
    "LMCACHE_VLLM_OPS": "auto (default) or torch: the compiled gather/scatter ops or the torch fallback",
    "LMCACHE_VLLM_CPU_ISA": "forces the compiled CPU op's kernels (avx512, avx2, sse2, scalar)",
    "LMCACHE_VLLM_CPU_TASKS": "how the AVX-512 `vec` and `amx` kernels split a call (auto, strip, plane; auto: "
                              "both timed at start-up, the faster kept)",
    "LMCACHE_VLLM_SDIST_INDEX": "package index the tests take vLLM's source distribution from (toy proxy)",
    "LMCACHE_VLLM_MODEL_CACHE": "where the tests' local models are built",
    "LMCACHE_VLLM_CHUNK_MAC_KEY": "secret of the keyed MAC of stored chunks (as extra_config.chunk_mac_key)",
    "LMCACHE_VLLM_NO_EXT": "1: build no compiled extension (setup.py)",
    "LMCACHE_VLLM_NO_CUDA_EXT": "1: build no CUDA extension (setup.py)",
    "LMCACHE_VLLM_CUDA_ARCHS": "CUDA architectures make check-cuda compiles for",
    "LMCACHE_VERSION": "the LMCache release scripts/make_lmcache_venv.sh installs for comparisons",
}


@dataclass(frozen=True)
class Entry:
    """One key as one source gives it. `children` holds the entries of a nested mapping (extra_config)
    with their own lines, where the source knows them."""

    key: Any
    value: Any
    origin: Origin
    children: Optional[tuple["Entry", ...]] = None


def file_origin(path: str, line: Optional[int] = None) -> Origin:
    return Origin("file", f"{path}, line {line}" if line else path)


def read_yaml(path: str, problems: list[Problem]) -> list[Entry]:
    """The top-level keys of the YAML file at `path` (and of mappings one level down) with lines."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        problems.append(Problem(CONFIG_FILE_ENV, path, f"cannot read the file: {exc.strerror or exc}",
                                Origin("environment", CONFIG_FILE_ENV)))
        return []
    if len(raw) > MAX_FILE_BYTES:
        problems.append(Problem(CONFIG_FILE_ENV, path, f"the file is larger than {MAX_FILE_BYTES} bytes: "
                                "not a configuration", Origin("environment", CONFIG_FILE_ENV)))
        return []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        problems.append(Problem(CONFIG_FILE_ENV, path, f"the file is not UTF-8 text (byte "
                                f"0x{raw[exc.start]:02x} at offset {exc.start})", file_origin(path, line)))
        return []
    refused = _yaml_shape_problem(text)
    if refused is not None:
        problems.append(Problem(CONFIG_FILE_ENV, path, refused, file_origin(path)))
        return []
    try:
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters at once
        problems.append(_not_yaml(path, exc))
        return []
    try:
        root = loader.get_single_node()
        expanded = _expanded_nodes(root)
        if expanded > MAX_NODES:
            problems.append(Problem(CONFIG_FILE_ENV, path, f"with its aliases expanded the document has "
                                    f"{expanded} nodes, more than {MAX_NODES}: refused (aliases that "
                                    f"multiply, a \"billion laughs\")", file_origin(path)))
            return []
        if root is None or (isinstance(root, yaml.ScalarNode) and loader.construct_object(root) is None):
            return []  # no document, or only null: no keys (as LMCache reads it)
        if not isinstance(root, yaml.MappingNode) or root.tag != "tag:yaml.org,2002:map":
            problems.append(Problem(CONFIG_FILE_ENV, path, "the file must hold a mapping of keys to values",
                                    file_origin(path, root.start_mark.line + 1)))
            return []
        return _entries(loader, root, path, problems, depth=0)
    except yaml.YAMLError as exc:
        problems.append(_not_yaml(path, exc))
        return []
    except RecursionError:  # (the event scan refuses deep nesting first; this is in case it could not)
        problems.append(Problem(CONFIG_FILE_ENV, path, f"nested deeper than {MAX_DEPTH} levels: refused",
                                file_origin(path)))
        return []
    finally:
        loader.dispose()


def _not_yaml(path: str, exc: yaml.YAMLError) -> Problem:
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    return Problem(CONFIG_FILE_ENV, path, f"not valid YAML: {exc}".replace("\n", " "), file_origin(path, line))


def _yaml_shape_problem(text: str) -> Optional[str]:
    """What is wrong with the YAML's nesting or number of aliases, from its events (the parser is a state
    machine: no recursion, unlike composing), or None."""
    depth = aliases = 0
    try:
        for event in yaml.parse(text, Loader=_EVENT_LOADER):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    return f"nested deeper than {MAX_DEPTH} levels: refused"
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_ALIASES:
                    return f"more than {MAX_ALIASES} aliases (*name): refused"
    except yaml.YAMLError as exc:
        if "nesting depth" in str(exc):  # libyaml's own limit, lower than the stack's
            return f"nested deeper than {MAX_DEPTH} levels: refused"
        return None  # composing reports it, with its line
    return None


def _expanded_nodes(root: Optional[yaml.Node]) -> int:
    """Nodes of the document with every alias expanded, counted without expanding (an alias is the same
    node object again: its count is computed once). Stops early past MAX_NODES."""
    counts: dict[int, int] = {}
    order: list[yaml.Node] = []
    stack = [root] if root is not None else []
    while stack:  # post-order without recursion (depth is bounded already, this is for safety)
        node = stack.pop()
        if id(node) in counts:
            continue
        if node is None or isinstance(node, yaml.ScalarNode):
            counts[id(node)] = 1
            continue
        counts[id(node)] = 0  # visiting
        order.append(node)
        stack.extend(_children(node))
    for node in reversed(order):
        counts[id(node)] = min(MAX_NODES + 1, 1 + sum(counts.get(id(c), 1) for c in _children(node)))
    return counts.get(id(root), 0) if root is not None else 0


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def value_problem(value: Any) -> Optional[str]:
    """Why a value from any source is refused (a string longer than MAX_VALUE_CHARS, nesting deeper than
    MAX_DEPTH, more than MAX_NODES items), or None. Counts shared objects once per reference without
    recursion."""
    nodes = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            return f"more than {MAX_NODES} items: refused"
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels: refused"
        if isinstance(item, (str, bytes)) and len(item) > MAX_VALUE_CHARS:
            return f"{len(item)} characters, more than {MAX_VALUE_CHARS}: refused"
        if isinstance(item, Mapping):
            stack.extend((x, depth + 1) for pair in item.items() for x in pair)
        elif isinstance(item, (list, tuple, set)):
            stack.extend((x, depth + 1) for x in item)
    return None


def _entries(loader: yaml.SafeLoader, node: yaml.MappingNode, path: str, problems: list[Problem],
             depth: int) -> list[Entry]:
    loader.flatten_mapping(node)  # YAML merge keys (<<)
    entries: list[Entry] = []
    first_line: dict[Any, int] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        origin = file_origin(path, line)
        if isinstance(key, str) and key in first_line:
            problems.append(Problem(key, MISSING, f"given twice (first on line {first_line[key]})", origin))
            continue
        if isinstance(key, str):
            first_line[key] = line
        value = loader.construct_object(value_node, deep=True)
        children = None
        if depth == 0 and isinstance(value_node, yaml.MappingNode):
            children = tuple(_entries(loader, value_node, path, problems, depth + 1))
        entries.append(Entry(key, value, origin, children))
    return entries


def env_entries(environ: Mapping[str, str], known: Any) -> tuple[list[Entry], list[Entry]]:
    """(`LMCACHE_<KEY>` variables of every key in `known`, the other LMCACHE_* variables except ours)."""
    entries: list[Entry] = []
    others: list[Entry] = []
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in OWN_ENV_VARS:
            continue
        key = name[len(ENV_PREFIX):].lower()
        entry = Entry(key, _env_text(value), Origin("environment", name))
        (entries if key in known else others).append(entry)
    return entries, others


def _env_text(value: str) -> str:
    """As LMCache reads an environment value: surrounding blanks dropped, one pair of quotes removed."""
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def code_entries(values: Optional[Mapping[Any, Any]], source: str = OVERRIDES_SOURCE) -> list[Entry]:
    return [Entry(key, value, Origin(source)) for key, value in dict(values or {}).items()]
