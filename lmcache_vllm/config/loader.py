"""`load_config` / `inspect_config`: builds the `LMCacheConfig` (schema.py) from every source.

Sources, later wins: the defaults declared in the schema < the YAML file named by `LMCACHE_CONFIG_FILE` <
`LMCACHE_<KEY>` environment variables < `overrides` (vLLM's `kv_connector_extra_config`). `extra_config`
merges key by key across sources; its keys are declared in `extra.ExtraConfig`. Strings from any
source are parsed to the key's type the same way (`fields.parse_value`: booleans true/false,
1/0, yes/no, on/off; null/none/"" for optional keys; JSON for mappings); string values are never stripped.

Everything wrong with the configuration, from every source, is collected and raised as ONE `ConfigError`
that names each key, its value, where it came from (file and line, environment variable, or
kv_connector_extra_config) and what is accepted. An unknown key gets a "did you mean" only for a likely
typo of a known key of the same type. LMCache keys that lmcache-vllm does not take as they are (no-ops,
keys mapped to ours, features we lack) are listed with the reason for each in `lmcache.py`; a
feature we lack is accepted at LMCache's default (off), so LMCache YAML files keep working. Unknown
`LMCACHE_*` environment variables are warnings (errors with `extra_config.strict_env`); our own
non-configuration variables are declared in `sources.OWN_ENV_VARS`. `inspect_config` returns the
problems and warnings instead of raising and logging them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from lmcache_vllm.config.extra import ExtraConfig
from lmcache_vllm.config.lmcache import (LMCACHE_ENV_PREFIXES, LMCACHE_ENV_VARS, LMCACHE_EXTRA_KEYS,
                                         LMCACHE_EXTRA_PREFIXES, LMCACHE_KEYS, SENTINEL_ENV_VARS, MAPPED,
                                         MOONCAKE_KEYS, NOOP, KeyRule)
from lmcache_vllm.config.fields import (ConfigError, Origin, Problem, check_setting, did_you_mean, field_types,
                                        parse_setting, parse_value, raise_if_any)
from lmcache_vllm.config.sources import (CONFIG_FILE_ENV, ENV_PREFIX, OVERRIDES_SOURCE, Entry, code_entries,
                                         env_entries, read_yaml)
from lmcache_vllm.config.remote_url import (DEFAULT_SENTINEL_SERVICE, Topology, parse_remote_url,
                                            sentinel_master_name)
from lmcache_vllm.config.schema import LMCacheConfig
from lmcache_vllm.config.values import translate_lmcache_value, with_credentials

logger = logging.getLogger(__name__)

TOP_FIELDS = {f.name: f for f in dataclasses.fields(LMCacheConfig)}
TOP_TYPES = field_types(LMCacheConfig)
EXTRA_FIELDS = {f.name: f for f in dataclasses.fields(ExtraConfig)}
EXTRA_TYPES = field_types(ExtraConfig)
_TOP_CANDIDATES = {**{k: r.lmcache_type for k, r in LMCACHE_KEYS.items()}, **TOP_TYPES}
_EXTRA_CANDIDATES = {**{k: r.lmcache_type for k, r in LMCACHE_EXTRA_KEYS.items()}, **EXTRA_TYPES}
_both = (set(TOP_FIELDS) & set(LMCACHE_KEYS)) | (set(EXTRA_FIELDS) & set(LMCACHE_EXTRA_KEYS))
if _both:  # a key we implement must have left lmcache.py's tables
    raise RuntimeError(f"keys both implemented and listed in config/lmcache.py: {sorted(_both)}")


@dataclass
class ConfigReport:
    """What `inspect_config` found: the configuration (None when there are problems), every problem,
    and every warning (keys ignored or translated, unknown environment variables)."""

    config: Optional[LMCacheConfig]
    problems: list[Problem]
    warnings: list[str]


class _Loader:
    """Turns every source's entries into field values, with the origin of each, every problem and every
    warning. Later entries win; extra_config merges key by key."""

    def __init__(self):
        self.problems: list[Problem] = []
        self.warnings: list[str] = []
        self.values: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.origins: dict[str, Origin] = {}
        self.switches: dict[str, tuple[KeyRule, Entry]] = {}  # features we lack, switched on
        self.members: dict[str, tuple[KeyRule, Entry]] = {}  # their settings, set to a non-default value
        self.credentials: dict[str, str] = {}  # user/password of LMCache's resp:// remote_url
        self.resp_url: Optional[Entry] = None
        self.local_disk_true: Optional[Entry] = None
        self.remote_url_given = False
        self.refused_serde: Optional[Problem] = None

    def warn(self, name: str, entry: Entry, text: str) -> None:
        self.warnings.append(f"{name} ({entry.origin}): {text}")

    def top(self, entry: Entry) -> None:
        key = entry.key
        if not isinstance(key, str):
            self.problems.append(Problem(repr(key), entry.value, "keys must be strings", entry.origin))
            return
        if entry.origin.source == OVERRIDES_SOURCE and key.startswith("lmcache."):
            key, entry = key[len("lmcache."):], replace(entry, key=key[len("lmcache."):])  # LMCache's prefix
        if key == "extra_config":
            self.extra_mapping(entry)
        elif key in TOP_FIELDS:
            self._top_field(key, entry)
        elif key in LMCACHE_KEYS:
            self._rule(key, LMCACHE_KEYS[key], entry, "")
        else:
            self._unknown(key, entry, _TOP_CANDIDATES, "")

    def _top_field(self, key: str, entry: Entry) -> None:
        if key == "local_disk" and (entry.value is True or str(entry.value).lower() == "true"):
            self.local_disk_true = entry  # guides write local_disk: true + local_disk_path: DIR
            return
        if key == "remote_url":
            self.remote_url_given = entry.value not in (None, "", "none", "null")
        try:
            value, note = translate_lmcache_value(key, entry.value)
        except ValueError as exc:
            problem = Problem(key, entry.value, str(exc), entry.origin)
            if key == "remote_serde":
                self.refused_serde = problem  # matters only with a remote_url: decided in finish()
            else:
                self.problems.append(problem)
            return
        if note:
            self.warn(key, entry, note)
            if key == "remote_url":
                self.resp_url = entry
        self._take(TOP_FIELDS[key], TOP_TYPES[key], key, replace(entry, value=value), self.values)

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
        if isinstance(key, str) and key in EXTRA_FIELDS:
            self._take(EXTRA_FIELDS[key], EXTRA_TYPES[key], f"extra_config.{key}", entry, self.extra)
        elif isinstance(key, str) and key in LMCACHE_EXTRA_KEYS:
            self._rule(key, LMCACHE_EXTRA_KEYS[key], entry, "extra_config.")
        elif isinstance(key, str) and (key in MOONCAKE_KEYS or key.startswith(tuple(LMCACHE_EXTRA_PREFIXES))):
            owner = next((v for p, v in LMCACHE_EXTRA_PREFIXES.items() if key.startswith(p)),
                         "LMCache's Mooncake store")
            self.warn(f"extra_config.{key}", entry, f"ignored: a setting of {owner}, which lmcache-vllm "
                                                   f"does not have")
        else:
            self._unknown(key, entry, _EXTRA_CANDIDATES, "extra_config.")

    def _take(self, f: dataclasses.Field, tp: Any, name: str, entry: Entry, into: dict) -> None:
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

    def _rule(self, key: str, rule: KeyRule, entry: Entry, prefix: str) -> None:
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

    def _unknown(self, key: Any, entry: Entry, candidates: Mapping[str, Any], prefix: str) -> None:
        name = f"{prefix}{key}"
        if not isinstance(key, str):
            self.problems.append(Problem(name, entry.value, "keys must be strings", entry.origin))
            return
        hint = did_you_mean(key, entry.value, candidates)
        message = (f"unknown key; did you mean '{prefix}{hint}'?" if hint else
                   f"unknown key: neither lmcache-vllm nor LMCache has it (README.md lists every key)")
        self.problems.append(Problem(name, entry.value, message, entry.origin))

    def environment(self, others: list[Entry]) -> None:
        """LMCACHE_* variables that name no key: LMCache's own are ignored with a warning, the rest are
        warned about, or refused under extra_config.strict_env."""
        strict = self.extra.get("strict_env", False)
        for entry in others:
            name = entry.origin.where
            known = LMCACHE_ENV_VARS.get(name) or next(
                (v for p, v in LMCACHE_ENV_PREFIXES.items() if name.startswith(p)), None)
            if known:
                self.warnings.append(f"{name} (environment): ignored: {known}")
                continue
            hint = did_you_mean(entry.key, entry.value, _TOP_CANDIDATES)
            if entry.key in EXTRA_FIELDS:
                hint_text = f"; extra_config.{entry.key} is set with {ENV_PREFIX}EXTRA_CONFIG='{{...}}'"
            else:
                hint_text = f"; did you mean {ENV_PREFIX}{hint.upper()}?" if hint else ""
            text = f"not a configuration key of lmcache-vllm or LMCache{hint_text}"
            if strict:
                self.problems.append(Problem(name, entry.value, text + " (extra_config.strict_env)",
                                             entry.origin))
            else:
                self.warnings.append(f"{name} (environment): ignored: {text}")

    def finish(self) -> Optional[LMCacheConfig]:
        self._features()
        if self.refused_serde is not None and self.remote_url_given:
            self.problems.append(self.refused_serde)
        elif self.refused_serde is not None:
            self.warnings.append(f"remote_serde ({self.refused_serde.origin}): ignored: it encodes what "
                                 f"remote_url stores, and no remote_url is set (LMCache ignores it too)")
        if self.local_disk_true is not None and "local_disk" not in self.values:
            self.problems.append(Problem(
                "local_disk", True, "true names no directory: give it as local_disk: /path (or "
                "local_disk_path: /path); false or null: no disk tier", self.local_disk_true.origin))
        if self.credentials:
            url = self.values.get("remote_url")
            if self.resp_url is not None and url is not None and self.origins.get("remote_url") == \
                    self.resp_url.origin:
                self.values["remote_url"] = with_credentials(url, self.credentials.get("username", ""),
                                                             self.credentials.get("password", ""))
            else:
                self.warnings.append("extra_config.username/password: ignored: only LMCache's resp:// "
                                     "remote_url takes them; write redis://user:password@host:port")
        try:
            config = LMCacheConfig(**self.values, extra_config=ExtraConfig(**self.extra))
        except ConfigError as exc:
            self.problems += [replace(p, origin=p.origin or self.origins.get(p.key)) for p in exc.problems]
            config = None
        self.problems = list({str(p): p for p in self.problems}.values())
        return None if self.problems else config

    def _features(self) -> None:
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
    loader = _Loader()
    loader.extra_mapping(Entry("extra_config", mapping, origin))
    loader._features()
    problems += loader.problems
    for warning in loader.warnings:
        logger.warning("lmcache-vllm config: %s", warning)
    return ExtraConfig(**loader.extra)


def inspect_config(overrides: Optional[Mapping[str, Any]] = None, *,
                   environ: Optional[Mapping[str, str]] = None) -> ConfigReport:
    """Reads every source (see the module docstring) and reports the configuration, every problem and
    every warning, without raising or logging."""
    environ = os.environ if environ is None else environ
    loader = _Loader()
    path = environ.get(CONFIG_FILE_ENV)
    entries = read_yaml(path, loader.problems) if path else []
    env, others = env_entries(environ, set(TOP_FIELDS) | set(LMCACHE_KEYS))
    for entry in entries + env + code_entries(overrides):
        loader.top(entry)
    loader.environment(others)
    config = loader.finish()
    if config is not None:
        loader.warnings += _sentinel_notes(config, environ)
    return ConfigReport(config, loader.problems, loader.warnings)


def _sentinel_notes(config: LMCacheConfig, environ: Mapping[str, str]) -> list[str]:
    """Warnings about LMCache's Sentinel environment variables (`lmcache.SENTINEL_ENV_VARS`)."""
    if config.remote_url is None:
        return []
    target = parse_remote_url(config.remote_url)
    if target.topology is not Topology.SENTINEL:
        return []
    notes = []
    name, note = sentinel_master_name(target, environ)
    if note and name == DEFAULT_SENTINEL_SERVICE:
        notes.append(f"remote_url: {note}")
    if "REDIS_TIMEOUT" in environ:
        notes.append(f"REDIS_TIMEOUT (environment): {SENTINEL_ENV_VARS['REDIS_TIMEOUT']}")
    return notes


def load_config(overrides: Optional[Mapping[str, Any]] = None, *,
                environ: Optional[Mapping[str, str]] = None) -> LMCacheConfig:
    """Builds the configuration: defaults < YAML file < LMCACHE_* environment < `overrides`. Logs one
    warning line per key ignored or translated; raises one ConfigError listing every problem."""
    report = inspect_config(overrides, environ=environ)
    for warning in report.warnings:
        logger.warning("lmcache-vllm config: %s", warning)
    raise_if_any(report.problems)
    return report.config
