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

from lmcache_vllm.config.extra import MAC_KEY_ENV, ExtraConfig, check_mac_keys, env_mac_keys
from lmcache_vllm.config.fields import (
    MISSING,
    ConfigError,
    Origin,
    Problem,
    did_you_mean,
    field_types,
    raise_if_any,
)
from lmcache_vllm.config.lmcache import (
    LMCACHE_ENV_PREFIXES,
    LMCACHE_ENV_VARS,
    LMCACHE_EXTRA_KEYS,
    LMCACHE_KEYS,
    SENTINEL_ENV_VARS,
)
from lmcache_vllm.config.reader import EXTRA_FIELDS, EntryReader
from lmcache_vllm.config.redact import redact_text
from lmcache_vllm.config.remote_url import (
    DEFAULT_SENTINEL_SERVICE,
    Topology,
    is_mooncake_url,
    parse_remote_url,
    sentinel_master_name,
)
from lmcache_vllm.config.schema import LMCacheConfig
from lmcache_vllm.config.sources import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    OVERRIDES_SOURCE,
    Entry,
    code_entries,
    env_entries,
    read_yaml,
)
from lmcache_vllm.config.values import translate_lmcache_value, with_credentials

logger = logging.getLogger(__name__)

TOP_FIELDS = {f.name: f for f in dataclasses.fields(LMCacheConfig)}
TOP_TYPES = field_types(LMCacheConfig)
_TOP_CANDIDATES = {**{k: r.lmcache_type for k, r in LMCACHE_KEYS.items()}, **TOP_TYPES}
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


class _Loader(EntryReader):
    """Turns every source's entries into field values, with the origin of each, every problem and every
    warning. Later entries win; extra_config merges key by key."""

    def __init__(self, overrides_source: str = OVERRIDES_SOURCE) -> None:
        self.overrides_source = overrides_source
        super().__init__()
        self.values: dict[str, Any] = {}
        self.resp_url: Optional[Entry] = None
        self.local_disk_true: Optional[Entry] = None
        self.remote_url_given = False
        self.refused_serde: Optional[Problem] = None

    def top(self, entry: Entry) -> None:
        key = entry.key
        if not isinstance(key, str):
            self.problems.append(Problem(repr(key)[:100], MISSING, "keys must be strings", entry.origin))
            return
        if self.unbounded(key, entry):
            return
        if entry.origin.source == self.overrides_source and key.startswith("lmcache."):
            key, entry = key[len("lmcache."):], replace(entry, key=key[len("lmcache."):])  # LMCache's prefix
        if key == "extra_config":
            self.extra_mapping(entry)
        elif key in TOP_FIELDS:
            self._top_field(key, entry)
        elif key in LMCACHE_KEYS:
            self.rule(key, LMCACHE_KEYS[key], entry, "")
        else:
            self.unknown(key, entry, _TOP_CANDIDATES, "")

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
        self.take(TOP_FIELDS[key], TOP_TYPES[key], key, replace(entry, value=value), self.values)

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
        self.features()
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



def inspect_config(overrides: Optional[Mapping[str, Any]] = None, *,
                   environ: Optional[Mapping[str, str]] = None, source: str = OVERRIDES_SOURCE) -> ConfigReport:
    """Reads every source (see the module docstring) and reports the configuration, every problem and
    every warning, without raising or logging. `source` names where `overrides` came from in messages
    (vLLM's kv_connector_extra_config; SGLang's hicache-storage-backend-extra-config)."""
    environ = os.environ if environ is None else environ
    loader = _Loader(source)
    path = environ.get(CONFIG_FILE_ENV)
    entries = read_yaml(path, loader.problems) if path else []
    env, others = env_entries(environ, set(TOP_FIELDS) | set(LMCACHE_KEYS))
    for entry in entries + env + code_entries(overrides, source):
        loader.top(entry)
    loader.environment(others)
    config = loader.finish()
    mac_notes = _mac_key_notes(loader, environ)
    if mac_notes:
        loader.problems += mac_notes
        config = None
    if config is not None:
        loader.warnings += _sentinel_notes(config, environ)
    return ConfigReport(config, loader.problems, [redact_text(w) for w in loader.warnings])


def _mac_key_notes(loader: _Loader, environ: Mapping[str, str]) -> list[Problem]:
    """The chunk MAC key of the environment checked like extra_config.chunk_mac_key (a problem when short),
    and a warning for a key in kv_connector_extra_config (vLLM logs it at start-up) or one that hides the
    environment's."""
    problems = []
    env_keys = env_mac_keys(environ)
    if env_keys and (problem := check_mac_keys(env_keys)) is not None:
        problems.append(Problem(MAC_KEY_ENV, MISSING, problem, Origin("environment", MAC_KEY_ENV)))
    origin = loader.origins.get("extra_config.chunk_mac_key")
    if origin is not None and loader.extra.get("chunk_mac_key"):
        if origin.source == OVERRIDES_SOURCE:
            loader.warnings.append(f"extra_config.chunk_mac_key ({origin}): vLLM logs kv_connector_extra_config "
                                   f"at start-up, this key with it; set {MAC_KEY_ENV} in the environment instead")
        if env_keys:
            loader.warnings.append(f"{MAC_KEY_ENV} (environment): ignored: extra_config.chunk_mac_key ({origin}) "
                                   f"is set, and it is the key used")
    return problems


def _sentinel_notes(config: LMCacheConfig, environ: Mapping[str, str]) -> list[str]:
    """Warnings about LMCache's Sentinel environment variables (`lmcache.SENTINEL_ENV_VARS`)."""
    if config.remote_url is None or is_mooncake_url(config.remote_url):
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
                environ: Optional[Mapping[str, str]] = None, source: str = OVERRIDES_SOURCE) -> LMCacheConfig:
    """Builds the configuration: defaults < YAML file < LMCACHE_* environment < `overrides`. Logs one
    warning line per key ignored or translated; raises one ConfigError listing every problem."""
    report = inspect_config(overrides, environ=environ, source=source)
    for warning in report.warnings:
        logger.warning("lmcache-vllm config: %s", warning)
    raise_if_any(report.problems)
    if report.config is None:  # inspect_config has a configuration whenever it found no problem
        raise RuntimeError("lmcache-vllm config: no configuration and no problem reported")
    return report.config
