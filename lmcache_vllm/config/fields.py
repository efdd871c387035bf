"""Building blocks of the configuration schema: a key declared once (`setting`), one parser for values
from every source (`parse_value`), and problems collected into one `ConfigError`.

A key is a dataclass field declared with `setting(default, meaning, check=..., choices=...)`: its type
annotation, default, one-line meaning and validation live on that one line. `normalize_fields(obj)`
parses every field of such a dataclass to its declared type and runs its check; `ConfigError` carries
every `Problem` found (key, value, where it came from, what is accepted) so that one start-up shows all
of them. Nothing here knows any particular key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from lmcache_vllm.config.redact import redact_text, redact_value

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NONE_WORDS = ("", "none", "null", "~")
MAX_SIZE_GIB = float(1 << 20)  # 1 PiB: larger sizes are typos (and overflow byte counts)
MAX_INT = (1 << 63) - 1  # integers go to C and numpy as int64
MISSING: Any = dataclasses.MISSING

Check = Callable[[Any], Optional[str]]  # returns what is accepted when the value is wrong, else None


@dataclass(frozen=True)
class Origin:
    """Where a value came from: the source ("file", "environment", "kv_connector_extra_config", "code")
    and, where known, the exact place (file path and line, environment variable name)."""

    source: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.source} {self.where}" if self.where else self.source


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration: `key` (`extra_config.x` for extra keys), the value as
    given (MISSING where there is none), its origin, and what is accepted or what to use instead."""

    key: str
    value: Any
    message: str
    origin: Optional[Origin] = None

    def __str__(self) -> str:
        head = self.key if self.value is MISSING else f"{self.key}={redact_value(self.key, self.value)!r}"
        where = f" ({self.origin})" if self.origin is not None else ""
        return f"{head}{where}: {redact_text(self.message)}"


class ConfigError(ValueError):
    """The configuration cannot be used; `problems` lists everything wrong with it, from every source."""

    def __init__(self, problems: Union[str, Iterable[Problem]]):
        if isinstance(problems, str):
            problems = [Problem("", MISSING, problems)]
        self.problems: tuple[Problem, ...] = tuple(problems)
        if len(self.problems) == 1:
            text = f"invalid lmcache-vllm configuration: {self.problems[0]}"
        else:
            text = (f"{len(self.problems)} problems in the lmcache-vllm configuration:\n"
                    + "\n".join(f"  - {p}" for p in self.problems))
        super().__init__(text)

    @property
    def keys(self) -> set[str]:
        return {p.key for p in self.problems}


def redacted_repr(obj: Any) -> str:
    """`Name(field=value, ...)` of a settings dataclass, secrets redacted (see `redact.py`)."""
    fields = ", ".join(f"{f.name}={redact_value(f.name, getattr(obj, f.name))!r}"
                       for f in dataclasses.fields(obj))
    return f"{type(obj).__name__}({fields})"


def raise_if_any(problems: Sequence[Problem]) -> None:
    unique = list({str(p): p for p in problems}.values())  # the same problem found twice: reported once
    if unique:
        raise ConfigError(unique)


# ---------------------------------------------------------------------------------- declaring keys
def setting(default: Any = MISSING, meaning: str = "", *, check: Optional[Check] = None,
            choices: Optional[Sequence[str]] = None, value_aliases: Optional[Mapping[Any, Any]] = None,
            default_factory: Any = MISSING) -> Any:
    """A dataclass field that is a configuration key. `choices` are matched case-insensitively and
    return their canonical spelling; `value_aliases` maps other accepted values onto them."""
    metadata = {"meaning": meaning, "check": check, "choices": tuple(choices) if choices else None,
                "value_aliases": dict(value_aliases or {})}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_default(f: dataclasses.Field[Any]) -> Any:
    factory = f.default_factory
    return f.default if factory is dataclasses.MISSING else factory()


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of every field of a dataclass (annotations may be strings; resolving them
    compiles each one, so it is done once per class). Do not change the dict returned."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------------------------- parsing values
def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        return f"{type_name(inner[0])} or null" if len(inner) == 1 else "any"
    if origin is list:
        return f"a list of {type_name(args[0])}" if args else "a list"
    return {bool: "a bool", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping (a JSON object in the environment)"}.get(tp, getattr(tp, "__name__", str(tp)))


def parse_value(value: Any, tp: Any) -> Any:
    """`value` as type `tp`; strings (environment variables, quoted YAML) are parsed the same way for
    every source. Raises ValueError saying what is accepted. Strings are never stripped."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS):
            return None
        return parse_value(value, inner[0]) if len(inner) == 1 else value
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
            return value.strip().lower() in TRUE_WORDS
        raise ValueError("expected true or false (also 1/0, yes/no, on/off)")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer, not a bool")
        number = value if isinstance(value, int) else _number(value)
        if isinstance(number, float) and math.isfinite(number) and number.is_integer():
            number = int(number)
        if isinstance(number, int) and abs(number) <= MAX_INT:
            return number
        raise ValueError(f"expected an integer (at most {MAX_INT})" if isinstance(number, (int, float))
                         else "expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError("expected a number, not a bool")
        number = _number(value)
        if number is None:
            raise ValueError("expected a number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {type(value).__name__}")
    if tp is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except (json.JSONDecodeError, RecursionError) as exc:  # (nested beyond the stack)
                raise ValueError(f"expected a JSON object: {exc}") from None
        if isinstance(value, Mapping):
            return dict(value)
        raise ValueError("expected a mapping (a JSON object in the environment)")
    if origin is list or tp is list:
        item = args[0] if args else Any
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except (json.JSONDecodeError, RecursionError) as exc:
                    raise ValueError(f"expected a JSON list: {exc}") from None
            else:
                value = [part.strip() for part in text.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [parse_value(v, item) for v in value]
    return value  # nested dataclasses are built by their owner


def _number(value: Any) -> Optional[float]:
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range
            return math.inf
    return None


def parse_setting(f: dataclasses.Field[Any], tp: Any, value: Any) -> Any:
    """`value` for field `f`: its value aliases, its type, its choices; ValueError if none fits."""
    aliases = f.metadata.get("value_aliases") or {}
    for alias, target in aliases.items():
        if type(value) is type(alias) and value == alias:
            return target
    choices = f.metadata.get("choices")
    if choices and isinstance(value, str):
        for choice in choices:
            if value.lower() == str(choice).lower():
                return choice
    parsed = parse_value(value, tp)
    if choices and parsed not in choices:
        accepted = ", ".join(repr(c) for c in choices)
        extra = "".join(f", {a!r} (= {t!r})" for a, t in aliases.items())
        raise ValueError(f"expected one of {accepted}{extra}")
    return parsed


def check_setting(f: dataclasses.Field[Any], value: Any) -> Optional[str]:
    check = f.metadata.get("check")
    return check(value) if check is not None and value is not None else None


def normalize_fields(obj: Any, prefix: str = "", skip: Sequence[str] = ()) -> list[Problem]:
    """Parses every `setting` field of dataclass `obj` in place and runs its check. A value that does
    not parse keeps the field's default so that the remaining checks still run; every failure is a
    Problem (without origin: the loader, which knows the sources, adds it)."""
    problems: list[Problem] = []
    cls: type = type(obj)  # (mypy: type(Any) is not Hashable for functools.cache)
    types = field_types(cls)
    for f in dataclasses.fields(obj):
        if f.name in skip or "meaning" not in f.metadata:
            continue
        value = getattr(obj, f.name)
        try:
            parsed = parse_setting(f, types[f.name], value)
        except ValueError as exc:
            problems.append(Problem(prefix + f.name, value, str(exc)))
            setattr(obj, f.name, field_default(f))
            continue
        setattr(obj, f.name, parsed)
        message = check_setting(f, parsed)
        if message:
            problems.append(Problem(prefix + f.name, parsed, message))
    return problems


# ---------------------------------------------------------------------------------- checks
def at_least(low: float, what: str = "") -> Check:
    def check(value: Any) -> Optional[str]:
        if not math.isfinite(value) or value < low:
            return f"expected {what or 'a number'} >= {low:g}"
        return None
    return check


def greater_than(low: float, what: str = "") -> Check:
    def check(value: Any) -> Optional[str]:
        if not math.isfinite(value) or value <= low:
            return f"expected {what or 'a finite number'} > {low:g}"
        return None
    return check


def size_gib(value: float) -> Optional[str]:
    if not math.isfinite(value) or not 0 <= value <= MAX_SIZE_GIB:
        return f"expected a size in GiB from 0 to {MAX_SIZE_GIB:.0f} (1 PiB)"
    return None


# ---------------------------------------------------------------------------------- did you mean
def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def did_you_mean(name: str, value: Any, candidates: Mapping[str, Any]) -> Optional[str]:
    """The candidate `name` is most likely a typo of: at most 1 edit for names of up to 5 characters,
    at most 2 for longer ones, and `value` must parse as the candidate's type. Keys that merely share
    words (`local_device` / `local_disk`) are far apart and never suggested for each other."""
    limit = 1 if len(name) <= 5 else 2
    best: Optional[tuple[int, str]] = None
    for candidate, tp in candidates.items():
        if abs(len(name) - len(candidate)) > limit:
            continue  # at least that many edits apart (and a long key would cost len x len steps)
        distance = edit_distance(name.lower(), candidate)
        if distance > limit or (best is not None and distance >= best[0]):
            continue
        if value is not MISSING:
            try:
                parse_value(value, tp)
            except ValueError:
                continue
        best = (distance, candidate)
    return best[1] if best else None
