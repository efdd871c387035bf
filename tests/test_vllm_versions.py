"""The vLLM version guard (integration/vllm/versions.py), and lmcache-vllm read against the next vLLM release's
sources (0.33.0, which cannot be installed here: its wheel needs torch 2.14): every `from vllm... import` of
ours resolves there, the abstract methods of its connector base class are ours, every method its MultiConnector
calls on a child exists on ours, and the hooks its base class added since the installed release are listed
(the ones we do not define would run vLLM's default). The sources come from vLLM's sdist on PyPI, as the toy
proxy does (skipped without network outside CI)."""
from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from ci import skip_or_fail

from lmcache_vllm.integration.vllm.versions import (
    TESTED_VLLM_VERSIONS,
    UntestedVllmError,
    check_vllm_version,
    is_tested,
)

ROOT = Path(__file__).resolve().parents[1]
NEXT_VLLM = "0.33.0"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
MULTI = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"
# Hooks vLLM 0.33's base class added since the installed release that we implement (docs/COMPOSING.md); a hook
# added there that is not ours shows up in the assertion below.
IMPLEMENTED_033_HOOKS = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}


# ---------------------------------------------------------------- the guard
def test_a_tested_release_passes_silently_whatever_its_local_suffix(caplog):
    with caplog.at_level(logging.WARNING):
        for version in TESTED_VLLM_VERSIONS:
            check_vllm_version(version, allow_untested=False)
            check_vllm_version(version + "+cpu", allow_untested=False)
    assert caplog.records == []
    assert not is_tested("0.32.1.dev3+g1234") and not is_tested("0.33.0")


def test_an_untested_release_warns_once_naming_the_tested_ones_or_refuses(caplog):
    with caplog.at_level(logging.WARNING):
        check_vllm_version("0.99.0", allow_untested=True, warn=False)  # a worker: its scheduler says it
        check_vllm_version("0.99.0", allow_untested=True)
        check_vllm_version("0.99.0", allow_untested=True)
    (record,) = [r for r in caplog.records if "0.99.0" in r.getMessage()]
    assert all(v in record.getMessage() for v in TESTED_VLLM_VERSIONS)
    with pytest.raises(UntestedVllmError, match="allow_untested_vllm: true") as refused:
        check_vllm_version("0.99.1", allow_untested=False)
    assert all(v in str(refused.value) for v in TESTED_VLLM_VERSIONS)


def test_the_connector_refuses_an_untested_vllm_when_told_to(monkeypatch):
    pytest.importorskip("vllm")
    from test_integration_connector import SPECS, allocate, vllm_setup
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_vllm.integration.vllm import connector as connector_module

    vllm_config = vllm_setup("LBHNC", {"extra_config": {"allow_untested_vllm": False}})
    kv_cache_config, _ = allocate(vllm_config, SPECS["flash"](), "LBHNC")
    monkeypatch.setattr(connector_module, "vllm_version", "0.99.2")
    with pytest.raises(UntestedVllmError, match="0.99.2"):
        connector_module.LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


# ---------------------------------------------------------------- the next release's sources
@pytest.fixture(scope="module")
def next_vllm() -> Path:
    from lmcache_vllm.integration.vllm.testing.vllm_sources import SourceUnavailable, vllm_python_tree

    try:
        return vllm_python_tree(NEXT_VLLM)
    except SourceUnavailable as exc:
        skip_or_fail(f"vLLM {NEXT_VLLM}'s sources unavailable here: {exc}")


def _module_file(tree: Path, module: str) -> Path | None:
    path = tree.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _top_level_names(source: str) -> set[str]:
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)

    visit(ast.parse(source).body)
    return names


def _resolves(tree: Path, module: str, name: str) -> bool:
    path = _module_file(tree, module)
    if path is None:
        return False
    if _module_file(tree, f"{module}.{name}") is not None:  # a submodule
        return True
    source = path.read_text()
    names = _top_level_names(source)
    # A lazy module (`__getattr__`) names what it serves in a table of strings.
    return name in names or ("__getattr__" in names and f'"{name}"' in source)


def _vllm_imports(path: Path) -> list[list[tuple[str, str, int]]]:
    """Our `from vllm... import name`s of one file, as groups of alternatives (the branches of a try whose
    handler catches ImportError); each (module, name, line)."""
    groups: list[list[tuple[str, str, int]]] = []
    alternatives: set[int] = set()
    parsed = ast.parse(path.read_text())
    for node in ast.walk(parsed):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            branches = [node.body, *[h.body for h in node.handlers]]
            found = [[(s.module, a.name, s.lineno) for s in branch for a in s.names]
                     for branch in branches
                     if all(isinstance(s, ast.ImportFrom) and (s.module or "").startswith("vllm") for s in branch)]
            if len(found) == len(branches):
                groups.append([imp for branch in found for imp in branch])
                alternatives.update(id(s) for branch in branches for s in branch)
    for node in ast.walk(parsed):
        if isinstance(node, ast.ImportFrom) and id(node) not in alternatives and node.level == 0 \
                and (node.module == "vllm" or (node.module or "").startswith("vllm.")):
            groups.extend([[(node.module, a.name, node.lineno)] for a in node.names])
    return groups


def test_every_vllm_import_of_ours_resolves_in_the_next_release(next_vllm):
    missing = []
    for path in sorted((ROOT / "lmcache_vllm").rglob("*.py")):
        for group in _vllm_imports(path):
            if not any(_resolves(next_vllm, module, name) for module, name, _ in group):
                missing.append(" or ".join(f"{path.relative_to(ROOT)}:{line}: from {module} import {name}"
                                           for module, name, line in group))
    assert not missing, f"not in vLLM {NEXT_VLLM}:\n" + "\n".join(missing)


def _class_methods(source: str, class_name: str) -> dict[str, bool]:
    """{method name: abstract} of `class_name` in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            out = {}
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")
                                  for d in item.decorator_list}
                    out[item.name] = "abstractmethod" in decorators
            return out
    raise AssertionError(f"no class {class_name}")


def _child_calls(source: str) -> set[str]:
    """Methods MultiConnector calls on a child: `c.x(...)`, `connector.x(...)`, `connector_cls.x(...)`,
    `self._connectors[i].x(...)`, `KVConnectorFactory.get_connector_class(...).x(...)`."""
    calls = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            factory_lookup = (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Attribute)
                              and owner.func.attr.startswith("get_connector_class"))
            if factory_lookup or (isinstance(owner, ast.Name) and owner.id in ("c", "connector", "connector_cls")) or (
                    isinstance(owner, ast.Subscript) and isinstance(owner.value, ast.Attribute)
                    and owner.value.attr == "_connectors"):
                calls.add(node.func.attr)
    return calls


def test_the_next_releases_connector_hooks_against_ours(next_vllm):
    pytest.importorskip("vllm")
    import vllm.distributed.kv_transfer.kv_connector.v1.base as installed_base

    from lmcache_vllm.integration.vllm.connector import LMCacheConnector

    base_source = (next_vllm / BASE).read_text()
    next_base = _class_methods(base_source, "KVConnectorBase_V1")
    hma = _class_methods(base_source, "SupportsHMA")
    ours = {name for klass in LMCacheConnector.__mro__ if klass.__module__.startswith("lmcache_vllm")
            for name in vars(klass)}
    abstract = {name for name, is_abstract in {**next_base, **hma}.items() if is_abstract}
    assert abstract <= ours, f"vLLM {NEXT_VLLM} requires {sorted(abstract - ours)}"

    available = ours | set(next_base) | set(hma)  # what a child has on that release: ours, or its base's default
    called = _child_calls((next_vllm / MULTI).read_text())
    assert called <= available, f"vLLM {NEXT_VLLM}'s MultiConnector calls {sorted(called - available)} on a child"

    installed = set(vars(installed_base.KVConnectorBase_V1))
    added = {name for name in next_base if name not in installed and not name.startswith("_")}
    lacking = sorted(added - ours)
    print(f"vLLM {NEXT_VLLM} hooks new since the installed vLLM: {sorted(added)}; not ours: {lacking}")
    assert added & ours == added & IMPLEMENTED_033_HOOKS
    assert not lacking, f"vLLM {NEXT_VLLM}'s connector base added hooks we do not define: {lacking}"
