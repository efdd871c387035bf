"""The documentation names only what exists, and the README stays short.

README.md and docs/*.md are read as text (nothing is imported, so vLLM is not needed). They fail this test
when they name
- a module path that does not exist: `lmcache_vllm/...py` (or a folder `lmcache_vllm/.../`), a path inside
  the package written from one of its packages (`storage/local_disk.py`), or a repository file under tests/,
  benchmarks/, examples/, scripts/ or configs/;
- a bare file name `name.py` that no Python file of the repository has (a module that was removed or moved
  into a package under another name, e.g. `tiers.py`);
- a dotted name `lmcache_vllm.x.y` that is neither a package, a module, a compiled extension, nor a name
  defined at the top of that module (and, for a class, a member defined in it);
- `Class.member` for a class of the package whose body, `self.member = ...` assignments and base classes in
  the package have no such member, e.g. a method that was removed or renamed;
and README.md fails when it grows past `README_MAX_LINES` lines (the rest belongs in docs/).
Links to docs/ files are not checked: some are written by other branches.
"""
from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lmcache_vllm"
README_MAX_LINES = 250
REPO_DIRS = ("tests/", "benchmarks/", "examples/", "scripts/", "configs/")
# Bases that add no members a document would name: a class with only these (or package) bases is closed.
CLOSED_BASES = {"object", "ABC", "abc.ABC", "Generic", "NamedTuple", "StrEnum", "enum.StrEnum", "Enum",
                "enum.Enum", "Exception", "ValueError", "RuntimeError", "TypeError", "KeyError"}

TOKEN = re.compile(r"[\w./*-]+")
CLASS_MEMBER = re.compile(r"(?<![\w.])([A-Z]\w*)\.(\w+(?:/\w+)*)")  # also `CacheEngine.lookup/store/...`


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _tokens(text: str) -> Iterator[str]:
    for match in TOKEN.finditer(text):
        token = match.group(0).rstrip(".,:;-")
        if "*" not in token and "..." not in token:
            yield token


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _assigned(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def _top_level_names(module: Path) -> set[str]:
    names: set[str] = set()
    for node in _tree(module).body:
        names |= _assigned(node)
        if isinstance(node, ast.If):  # e.g. `if TYPE_CHECKING:` imports
            for inner in node.body + node.orelse:
                names |= _assigned(inner)
    return names


@functools.cache
def _python_file_names() -> frozenset[str]:
    """File names of the repository's Python files (virtual environments and build output left out)."""
    names: set[str] = set()
    for _folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("build", "bench_out")]
        names.update(f for f in files if f.endswith(".py"))
    return frozenset(names)


@functools.cache
def _extensions() -> frozenset[str]:
    """Compiled modules the build may produce (they exist only after a build)."""
    source = (ROOT / "cuda_ops" / "build_ext.py").read_text(encoding="utf-8")
    return frozenset(re.findall(r'Extension\(\s*"(lmcache_vllm\.[\w.]+)"', source))


def dotted_name_exists(name: str) -> bool:
    """`lmcache_vllm.a.b[.Attr[.member]]`: packages and modules by their files, then one top-level name of
    the module (a class's member after it, when the class is the package's)."""
    if name in _extensions():
        return True
    parts = name.split(".")[1:]
    where = PACKAGE
    for i, part in enumerate(parts):
        if (where / part / "__init__.py").is_file():
            where = where / part
            continue
        module = where / f"{part}.py"
        if module.is_file():
            return _attributes_exist(module, parts[i + 1:])
        return _attributes_exist(where / "__init__.py", parts[i:])
    return True


def _attributes_exist(module: Path, attributes: list[str]) -> bool:
    if not attributes:
        return True
    if attributes[0] not in _top_level_names(module):
        return False
    if len(attributes) == 1:
        return True
    cls = classes().get(attributes[0])
    return cls is None or cls.has(attributes[1])


@dataclass
class ClassInfo:
    members: set[str] = field(default_factory=set)
    bases: set[str] = field(default_factory=set)

    def has(self, member: str, seen: frozenset[str] = frozenset()) -> bool:
        if member in self.members:
            return True
        known = classes()
        for base in self.bases - seen:
            if base in known:
                if known[base].has(member, seen | {base}):
                    return True
            elif base not in CLOSED_BASES:
                return True  # a base from outside the package: its members cannot be checked here
        return False


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    """`self.x = ...` (or `self.x: T = ...`) in the class's methods."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


@functools.cache
def classes() -> dict[str, ClassInfo]:
    """Every class defined in the package, by name: the names its body defines and its bases."""
    found: dict[str, ClassInfo] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            info = found.setdefault(node.name, ClassInfo())
            for statement in node.body:
                info.members |= _assigned(statement)
            info.members |= _instance_attributes(node)
            for base in node.bases:
                base_node = base.value if isinstance(base, ast.Subscript) else base
                info.bases.add(ast.unparse(base_node))
    return found


def missing_names(text: str) -> list[str]:
    """What `text` names that does not exist (see the module docstring)."""
    subpackages = tuple(f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    missing = []
    for token in _tokens(text):
        if token.startswith("lmcache_vllm/"):
            if token.endswith((".py", "/")) and not (ROOT / token).exists():
                missing.append(token)
        elif token.startswith("lmcache_vllm."):
            if not dotted_name_exists(token):
                missing.append(token)
        elif token.startswith(subpackages):
            if token.endswith((".py", "/")) and not (PACKAGE / token).exists():
                missing.append(token)
        elif token.startswith(REPO_DIRS) and "/" in token.rstrip("/"):
            if not (ROOT / token).exists():
                missing.append(token)
        elif token.endswith(".py") and "/" not in token and "." not in token[:-3]:
            if token not in _python_file_names():
                missing.append(token)
    known = classes()
    for cls, members in CLASS_MEMBER.findall(text):
        for member in members.split("/"):
            if cls in known and not known[cls].has(member):
                missing.append(f"{cls}.{member}")
    return missing


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_only_modules_that_exist(doc: Path) -> None:
    assert missing_names(doc.read_text(encoding="utf-8")) == []


def test_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_the_check_finds_what_is_stale() -> None:
    # Names that existed before the restructure (issue #25) or never did, as a document might still write them.
    stale = ("`lmcache_vllm/config_schema.py`, `lmcache_vllm/memory.py`, `lmcache_vllm/testing/`, "
             "`lmcache_vllm.metrics`, `lmcache_vllm.storage.tiers.chunk_mac`, `lmcache_vllm.engine.Prefetcher`, "
             "`storage/tiers.py`, `tests/test_nothing_here.py`, `tiers.py`, `config_doc.py`, "
             "`CacheEngine.prefetch`, `CacheEngine.lookup/store/prefetch`")
    assert missing_names(stale) == [
        "lmcache_vllm/config_schema.py", "lmcache_vllm/memory.py", "lmcache_vllm/testing/",
        "lmcache_vllm.metrics", "lmcache_vllm.storage.tiers.chunk_mac", "lmcache_vllm.engine.Prefetcher",
        "storage/tiers.py", "tests/test_nothing_here.py", "tiers.py", "config_doc.py",
        "CacheEngine.prefetch", "CacheEngine.prefetch"]
    current = ("`lmcache_vllm/storage/tier.py`, `lmcache_vllm/integration/vllm/testing/`, "
               "`lmcache_vllm.observability.metrics`, `lmcache_vllm.storage.registry.chunk_mac`, "
               "`lmcache_vllm.config.LMCacheConfig`, `lmcache_vllm.engine.CacheEngine.lookup_and_hold`, "
               "`lmcache_vllm._cuda_ops`, `storage/registry.py`, `CacheEngine.retrieve_layer`, "
               "`LookupQuery.extra`, `Tier.medium`, `StorageManager._prefetch`, `tests/e2e/`, `pinned.py`, "
               "`CacheEngine.lookup/store/retrieve`, `PagedKVLayout.geometry`")
    assert missing_names(current) == []


@pytest.mark.parametrize("generator, doc", [("config", "CONFIG.md"), ("metrics", "METRICS.md")])
def test_update_docs_rewrites_the_generated_part_only(tmp_path: Path, generator: str, doc: str) -> None:
    from lmcache_vllm.config import doc as config_doc
    from lmcache_vllm.observability import metrics_doc

    module = config_doc if generator == "config" else metrics_doc
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    section = module.generated_section(text)
    assert section is not None
    stale = text.replace(section, section.replace("| key |", "| old key |").replace("| metric |", "| old |"))
    assert stale != text
    copy = tmp_path / doc
    copy.write_text(stale, encoding="utf-8")
    module.update_doc(str(copy))  # what `python -m ... --update-docs` does to docs/
    assert copy.read_text(encoding="utf-8") == text
