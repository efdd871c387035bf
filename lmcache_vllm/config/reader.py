"""`EntryReader`: reads `extra_config` entries into our `ExtraConfig` fields, and every key into a problem
or a warning where it is not ours as it stands (LMCache's keys we map, ignore or lack; typos).

The loader (`loader._Loader`) extends it with the top-level keys and the environment; `build_extra` uses it
alone for a mapping given in code (`LMCacheConfig(extra_config={...})`), so both read a key the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from typing import Any, Mapping, Optional

from lmcache_vllm.config.extra import ExtraConfig
from lmcache_vllm.config.fields import (
    MISSING,
    Origin,
    Problem,
    check_setting,
    did_you_mean,
    field_types,
    parse_setting,
    parse_value,
)
from lmcache_vllm.config.lmcache import LMCACHE_EXTRA_KEYS, LMCACHE_EXTRA_PREFIXES, MAPPED, NOOP, KeyRule
from lmcache_vllm.config.redact import MASK, is_secret_key, redact_text
from lmcache_vllm.config.sources import Entry, value_problem

logger = logging.getLogger(__name__)

EXTRA_FIELDS = {f.name: f for f in dataclasses.fields(ExtraConfig)}
EXTRA_TYPES = field_types(ExtraConfig)
EXTRA_CANDIDATES = {**{k: r.lmcache_type for k, r in LMCACHE_EXTRA_KEYS.items()}, **EXTRA_TYPES}


class EntryReader:
    """Collects field values (`extra`), their origins, every problem and every warning. Later entries win."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.warnings: list[str] = []
        self.extra: dict[str, Any] = {}
        self.origins: dict[str, Origin] = {}
        self.switches: dict[str, tuple[KeyRule, Entry]] = {}  # features we lack, switched on
        self.members: dict[str, tuple[KeyRule, Entry]] = {}  # their settings, set to a non-default value
        self.credentials: dict[str, str] = {}  # user/password of LMCache's resp:// remote_url

    def warn(self, name: str, entry: Entry, text: str) -> None:
        self.warnings.append(f"{name} ({entry.origin}): {text}")

    def unbounded(self, name: str, entry: Entry) -> bool:
        """A value too large or deep to handle (see sources.py) is one problem, shown without it."""
        message = value_problem(entry.value)
        if message is not None:
            self.problems.append(Problem(name, MISSING, f"its value is {message}", entry.origin))
        return message is not None

    def top(self, entry: Entry) -> None:
        """An LMCache extra key that maps to a top-level key: only the loader, which reads the top-level
        keys, can take it."""
        self.problems.append(Problem(str(entry.key), entry.value, "a top-level key: set it beside "
                                     "extra_config, not inside it", entry.origin))

    def extra_mapping(self, entry: Entry) -> None:
        try:
            mapping = parse_value(entry.value, Optional[dict])
        except ValueError as exc:
            self.problems.append(Problem("extra_config", entry.value, str(exc), entry.origin))
            return
        children = entry.children or tuple(Entry(k, v, entry.origin) for k, v in (mapping or {}).items())
        for child in children:
            self.extra_key(child)

    def extra_key(self, entry: Entry) -> None:
        key = entry.key
        if self.unbounded(f"extra_config.{key}"[:100], entry):
            return
        if isinstance(key, str) and key in EXTRA_FIELDS:
            self.take(EXTRA_FIELDS[key], EXTRA_TYPES[key], f"extra_config.{key}", entry, self.extra)
        elif isinstance(key, str) and key in LMCACHE_EXTRA_KEYS:
            self.rule(key, LMCACHE_EXTRA_KEYS[key], entry, "extra_config.")
        elif isinstance(key, str) and key.startswith(tuple(LMCACHE_EXTRA_PREFIXES)):
            owner = next(v for p, v in LMCACHE_EXTRA_PREFIXES.items() if key.startswith(p))
            self.warn(f"extra_config.{key}", entry, f"ignored: a setting of {owner}, which lmcache-vllm "
                                                   f"does not have")
        else:
            self.unknown(key, entry, EXTRA_CANDIDATES, "extra_config.")

    def take(self, f: dataclasses.Field[Any], tp: Any, name: str, entry: Entry, into: dict[str, Any]) -> None:
        try:
            value = parse_setting(f, tp, entry.value)
        except ValueError as exc:
            self.problems.append(Problem(name, entry.value, str(exc), entry.origin))
            return
        message = check_setting(f, value)
        if message:
            self.problems.append(Problem(name, value, message, entry.origin))
            return
        into[f.name] = value
        self.origins[name] = entry.origin

    def rule(self, key: str, rule: KeyRule, entry: Entry, prefix: str) -> None:
        name = prefix + key
        if rule.status == NOOP:
            self.warn(name, entry, f"ignored: {rule.reason}")
        elif rule.status == MAPPED and rule.target == "remote_url":
            self.credentials[key] = str(entry.value)
        elif rule.status == MAPPED:
            self.warn(name, entry, f"taken as {rule.target} ({rule.reason})")
            target = rule.target
            if target.startswith("extra_config."):
                self.extra_key(replace(entry, key=target[len("extra_config."):]))
            else:
                self.top(replace(entry, key=target))
        else:
            try:
                value = parse_value(entry.value, rule.lmcache_type)
            except ValueError:
                value = entry.value
            if value == rule.off or (rule.off is None and value in ("", [], {})):
                return  # LMCache's default: the feature is off, as here
            (self.members if rule.part_of else self.switches)[name] = (rule, entry)

    def unknown(self, key: Any, entry: Entry, candidates: Mapping[str, Any], prefix: str) -> None:
        name = f"{prefix}{key}"
        if not isinstance(key, str):
            self.problems.append(Problem(name, entry.value, "keys must be strings", entry.origin))
            return
        hint = did_you_mean(key, entry.value, candidates)
        message = (f"unknown key; did you mean '{prefix}{hint}'?" if hint else
                   "unknown key: neither lmcache-vllm nor LMCache has it (docs/CONFIG.md lists every key)")
        value = MASK if hint and is_secret_key(hint) else entry.value  # a misspelt secret is one still
        self.problems.append(Problem(name, value, message, entry.origin))

    def features(self) -> None:
        """One problem per feature we lack that is switched on, listing its settings; the settings of a
        feature that is off are ignored (by LMCache too) with a warning."""
        listed: dict[str, list[str]] = {name: [] for name in self.switches}
        for name, (rule, entry) in self.members.items():
            on = [s for s in rule.part_of if s in self.switches]
            if on:
                listed[on[0]].append(name)
            else:
                self.warn(name, entry, f"ignored while {' / '.join(rule.part_of)} is off (by LMCache too)")
        for name, (rule, entry) in self.switches.items():
            also = f"; its settings here: {', '.join(listed[name])}" if listed[name] else ""
            self.problems.append(Problem(name, entry.value, f"not supported by lmcache-vllm (only LMCache's "
                                         f"default {rule.off!r} is accepted): {rule.reason}{also}",
                                         entry.origin))


def build_extra(mapping: Any, origin: Origin, problems: list[Problem]) -> ExtraConfig:
    """An ExtraConfig from a plain mapping (e.g. `LMCacheConfig(extra_config={...})` in code)."""
    reader = EntryReader()
    reader.extra_mapping(Entry("extra_config", mapping, origin))
    reader.features()
    problems += reader.problems
    if reader.credentials:
        reader.warnings.append("extra_config.username/password: ignored: only LMCache's resp:// remote_url "
                               "takes them; write redis://user:password@host:port")
    for warning in reader.warnings:
        logger.warning("lmcache-vllm config: %s", redact_text(warning))
    return ExtraConfig(**reader.extra)
