"""`LMCacheConfig`: lmcache-vllm's configuration, one validated dataclass with LMCache's key names, and
`load_config` to build it from every source.

Sources, later wins: the defaults declared here < the YAML file named by `LMCACHE_CONFIG_FILE` <
`LMCACHE_<KEY>` environment variables < `overrides` (vLLM's `kv_connector_extra_config`). `extra_config`
merges key by key across sources; its keys are declared in `config_extra.ExtraConfig`. Strings from any
source are parsed to the key's type the same way (`config_schema.parse_value`: booleans true/false,
1/0, yes/no, on/off; null/none/"" for optional keys; JSON for mappings); string values are never stripped.

Everything wrong with the configuration, from every source, is collected and raised as ONE `ConfigError`
that names each key, its value, where it came from (file and line, environment variable, or
kv_connector_extra_config) and what is accepted. An unknown key gets a "did you mean" only for a likely
typo of a known key of the same type. LMCache keys that lmcache-vllm does not take as they are (no-ops,
keys mapped to ours, features we lack) are listed with the reason for each in `config_lmcache.py`; a
feature we lack is accepted at LMCache's default (off), so LMCache YAML files keep working. Unknown
`LMCACHE_*` environment variables are warnings (errors with `extra_config.strict_env`); our own
non-configuration variables are declared in `config_sources.OWN_ENV_VARS`. `inspect_config` returns the
problems and warnings instead of raising and logging them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from lmcache_vllm.config_extra import ExtraConfig
from lmcache_vllm.config_lmcache import (LMCACHE_ENV_PREFIXES, LMCACHE_ENV_VARS, LMCACHE_EXTRA_KEYS,
                                         LMCACHE_EXTRA_PREFIXES, LMCACHE_KEYS, MAPPED, MOONCAKE_KEYS, NOOP,
                                         KeyRule)
from lmcache_vllm.config_schema import (MISSING, ConfigError, Origin, Problem, at_least, check_setting,
                                        did_you_mean, field_types, greater_than, normalize_fields, parse_setting,
                                        parse_value, raise_if_any, redacted_repr, setting, size_gib)
from lmcache_vllm.config_sources import (CONFIG_FILE_ENV, ENV_PREFIX, OVERRIDES_SOURCE, Entry, code_entries,
                                         env_entries, read_yaml, value_problem)
from lmcache_vllm.config_values import (normalize_local_disk, remote_url_problem, translate_lmcache_value,
                                        with_credentials)
from lmcache_vllm.redact import MASK, is_secret_key, redact_text, redact_value, remember_secret, url_password

__all__ = ["ConfigError", "ExtraConfig", "LMCacheConfig", "load_config", "inspect_config", "CONFIG_FILE_ENV",
           "ENV_PREFIX"]

logger = logging.getLogger(__name__)

SUPPORTED_HASH_ALGORITHMS = ("xxh3_128", "blake3", "sha256")  # tokens.py implements these
GiB = 1 << 30


@dataclass
class LMCacheConfig:
    """Configuration of lmcache-vllm; key names and units (sizes in GiB) are LMCache's."""

    chunk_size: int = setting(
        256, "tokens per stored chunk (any value; independent of vLLM's block size)",
        check=at_least(1, "an integer"))
    local_cpu: bool = setting(True, "L1 host-memory tier (false: the arena only stages transfers)")
    max_local_cpu_size: float = setting(
        5.0, "GiB of host memory for L1, reserved at start-up; pages are backed on first write "
             "(see extra_config.prefault_local_cpu)", check=size_gib)
    local_disk: Optional[str] = setting(
        None, "L2 directory: /path, file:///path or a path relative to the working directory; null or "
              "false: no disk tier", value_aliases={False: None})
    max_local_disk_size: float = setting(0.0, "GiB cap of L2 (> 0 when local_disk is set)", check=size_gib)
    remote_url: Optional[str] = setting(
        None, "L3 Redis: redis://[user:pw@]host:port[/db], rediss://..., unix:///path/to/redis.sock; "
              "null: no L3")
    remote_serde: str = setting("naive", "encoding of stored chunks: raw bytes behind our header",
                                choices=("naive",), value_aliases={None: "naive"})
    save_unfull_chunk: bool = setting(
        False, "also store the trailing partial chunk: an exact repeat then loads all but its last token "
               "(with whole chunks, up to chunk_size - 1 tokens are recomputed)")
    save_decode_cache: bool = setting(False, "also store KV produced while decoding")
    use_layerwise: bool = setting(False, "load and store one layer at a time, overlapping compute")
    enable_async_loading: bool = setting(
        True, "a hit that needs the disk or Redis tier loads while vLLM runs other requests (the request "
              "waits in WAITING_FOR_REMOTE_KVS); a hit all in L1 always loads inside the step. LMCache's "
              "default is false")
    cache_policy: str = setting("LRU", "L1 eviction order", choices=("LRU",))
    blocking_timeout_secs: float = setting(
        10.0, "upper bound of every synchronous wait on the cache; past it: a miss, never a hang",
        check=greater_than(0, "seconds"))
    lookup_timeout_ms: int = setting(3000, "upper bound of a scheduler lookup; past it: a miss",
                                     check=at_least(1, "milliseconds"))
    pre_caching_hash_algorithm: str = setting(
        "xxh3_128", "chunk digest: xxh3_128 (fastest measured), blake3 or sha256 (see tokens.py)",
        choices=SUPPORTED_HASH_ALGORITHMS)
    enable_kv_events: bool = setting(
        False, "KV cache events (BlockStored / BlockRemoved per chunk, medium cpu / disk / redis) through "
               "vLLM's KV event publisher (vLLM's --kv-events-config turns publishing on)")
    extra_config: ExtraConfig = setting(
        meaning="lmcache-vllm's own settings (next table; config_extra.py); merged key by key across sources",
        default_factory=ExtraConfig)

    def __post_init__(self):
        problems = normalize_fields(self, skip=("extra_config",))
        if not isinstance(self.extra_config, ExtraConfig):
            self.extra_config = build_extra(self.extra_config, Origin("code"), problems)
        problems += _check_together(self)
        if isinstance(self.remote_url, str):
            remember_secret(url_password(self.remote_url))  # from now on redacted from any text we show
        raise_if_any(problems)

    def __repr__(self) -> str:
        return redacted_repr(self)

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GiB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GiB)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line with every top-level key and the extra_config keys that differ from their default
        (for the start-up log; secrets redacted: see redact.py)."""
        parts = [f"{f.name}={redact_value(f.name, getattr(self, f.name))!r}" for f in dataclasses.fields(self)
                 if f.name != "extra_config"]
        defaults = ExtraConfig()
        changed = {f.name: redact_value(f.name, getattr(self.extra_config, f.name))
                   for f in dataclasses.fields(ExtraConfig)
                   if getattr(self.extra_config, f.name) != getattr(defaults, f.name)}
        return ", ".join(parts + [f"extra_config={changed!r}"])


TOP_FIELDS = {f.name: f for f in dataclasses.fields(LMCacheConfig)}
TOP_TYPES = field_types(LMCacheConfig)
EXTRA_FIELDS = {f.name: f for f in dataclasses.fields(ExtraConfig)}
EXTRA_TYPES = field_types(ExtraConfig)
_TOP_CANDIDATES = {**{k: r.lmcache_type for k, r in LMCACHE_KEYS.items()}, **TOP_TYPES}
_EXTRA_CANDIDATES = {**{k: r.lmcache_type for k, r in LMCACHE_EXTRA_KEYS.items()}, **EXTRA_TYPES}
_both = (set(TOP_FIELDS) & set(LMCACHE_KEYS)) | (set(EXTRA_FIELDS) & set(LMCACHE_EXTRA_KEYS))
if _both:  # a key we implement must have left config_lmcache's tables
    raise RuntimeError(f"keys both implemented and listed in config_lmcache.py: {sorted(_both)}")


def _check_together(cfg: LMCacheConfig) -> list[Problem]:
    problems: list[Problem] = []
    if cfg.local_cpu and cfg.max_local_cpu_bytes <= 0:
        problems.append(Problem("max_local_cpu_size", cfg.max_local_cpu_size,
                                "expected a size > 0 while local_cpu is true"))
    if cfg.local_disk is not None:
        cfg.local_disk, message = normalize_local_disk(cfg.local_disk)
        if message:
            problems.append(Problem("local_disk", cfg.local_disk, message))
        elif cfg.max_local_disk_bytes <= 0:
            problems.append(Problem("max_local_disk_size", cfg.max_local_disk_size,
                                    "expected a size > 0 when local_disk is set"))
    if cfg.remote_url is not None:
        message = remote_url_problem(cfg.remote_url)
        if message:
            problems.append(Problem("remote_url", cfg.remote_url, message))
    return problems


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

    def _unbounded(self, name: str, entry: Entry) -> bool:
        """A value too large or deep to handle (see config_sources) is one problem, shown without it."""
        message = value_problem(entry.value)
        if message is not None:
            self.problems.append(Problem(name, MISSING, f"its value is {message}", entry.origin))
        return message is not None

    def top(self, entry: Entry) -> None:
        key = entry.key
        if not isinstance(key, str):
            self.problems.append(Problem(repr(key)[:100], MISSING, "keys must be strings", entry.origin))
            return
        if self._unbounded(key, entry):
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
        if self._unbounded(f"extra_config.{key}"[:100], entry):
            return
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
        value = MASK if hint and is_secret_key(hint) else entry.value  # a misspelt secret is one still
        self.problems.append(Problem(name, value, message, entry.origin))

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
        logger.warning("lmcache-vllm config: %s", redact_text(warning))
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
    return ConfigReport(config, loader.problems, [redact_text(w) for w in loader.warnings])


def load_config(overrides: Optional[Mapping[str, Any]] = None, *,
                environ: Optional[Mapping[str, str]] = None) -> LMCacheConfig:
    """Builds the configuration: defaults < YAML file < LMCACHE_* environment < `overrides`. Logs one
    warning line per key ignored or translated; raises one ConfigError listing every problem."""
    report = inspect_config(overrides, environ=environ)
    for warning in report.warnings:
        logger.warning("lmcache-vllm config: %s", warning)
    raise_if_any(report.problems)
    return report.config
