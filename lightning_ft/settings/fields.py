"""Settings as frozen dataclasses whose fields say everything about themselves.

A setting is declared once, as a field made with :func:`setting`: its default, its
documentation, the rule a value must satisfy, and the environment variable that may set it.
Settings come in two tiers: *public* ones a user tunes (the main tables of the docs), and
*advanced* ones (``advanced=True``; their own page). A bound or interval that is not a setting
at all is an :func:`internal` field: a named constant with its reason, which code and tests may
pass to the constructor but no keyword argument, variable or ``--rdzv-conf`` key reaches.
:func:`load` builds a settings object from explicit values (a constructor's keyword
arguments, torchrun's ``--rdzv-conf``) and the environment; :func:`describe` lists every
setting of a class for documentation and tests. Nested groups (:func:`group`) share the
flat namespace of keyword arguments, optionally behind a prefix.

Nothing here reads the environment itself: :func:`load` is handed the mapping to read
(``lightning_ft.settings.environment.environ()`` by default).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from lightning_ft._validation import check_number, number_rule, parse_bool

T = TypeVar("T")

#: a rule: returns what a valid value must be (for the error message), or None when it is valid
Rule = Callable[[Any], "str | None"]


class SettingsError(ValueError):
    """A setting is missing, invalid or contradicts another; the message names it."""


class RendezvousConfigError(SettingsError):
    """A rendezvous setting (the endpoint among them) is missing or invalid; the message names the setting."""


@dataclass(frozen=True)
class SettingInfo:
    """What :func:`describe` tells about one setting."""

    name: str
    default: Any
    doc: str
    env: str | None
    #: ``public`` (the main tables) or ``advanced`` (docs/advanced-settings.md)
    tier: str = "public"


def number(*, integer: bool = False, minimum: float = 0, inclusive: bool = False, allow_none: bool = False,
           below: float | None = None) -> Rule:
    """A number rule (``True`` is not a number, ``nan`` neither); ``below``: an exclusive upper bound."""
    wording = number_rule(integer=integer, minimum=minimum, inclusive=inclusive, allow_none=allow_none)
    if below is not None:
        wording += f" and < {below:g}"

    def rule(value: Any) -> str | None:
        ok = check_number(value, integer=integer, minimum=minimum, inclusive=inclusive, allow_none=allow_none)
        if ok and below is not None and value is not None and not value < below:
            ok = False
        return None if ok else wording

    return rule


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "True or False"


def optional_text(value: Any) -> str | None:
    return None if value is None or (isinstance(value, str) and value.strip()) else "a non-empty string or None"


def optional_path(value: Any) -> str | None:
    import os

    if value is None or (isinstance(value, (str, os.PathLike)) and str(value).strip()):
        return None
    return "a path or None"


def mapping(value: Any) -> str | None:
    return None if isinstance(value, Mapping) else "a mapping (dict)"


def any_value(value: Any) -> str | None:
    return None


def _reads(expects: str) -> Callable[[Callable[[str], Any]], Callable[[str], Any]]:
    """Name what a parse function accepts (the error message says it when the text is not that)."""
    def mark(parse: Callable[[str], Any]) -> Callable[[str], Any]:
        vars(parse)["expects"] = expects  # a function attribute, read with getattr
        return parse
    return mark


@_reads("a number")
def parse_float(raw: str) -> float:
    return float(raw)


@_reads("an integer")
def parse_int(raw: str) -> int | float:
    """An integer; a fraction stays a float, which the setting's rule then refuses, saying why."""
    value = float(raw)
    return int(value) if value.is_integer() else value


@_reads("a number, or off")
def parse_number_or_off(raw: str) -> float | None:
    """A number; ``off`` or ``none`` (any case) turn the feature off (None)."""
    return None if raw.strip().lower() in ("off", "none") else float(raw)


@_reads("JSON")
def parse_json(raw: str) -> Any:
    return json.loads(raw)


@_reads("text")
def parse_text(raw: str) -> str:
    return raw


@_reads("true or false")
def parse_flag(raw: str) -> bool:
    return parse_bool("value", raw)


def setting(default: Any, doc: str, *, rule: Rule = any_value, env: str | None = None,
            parse: Callable[[str], Any] | None = None, advanced: bool = False) -> Any:
    """A settings field: ``default``, one ``doc`` string, the ``rule`` a value satisfies, and the
    environment variable ``env`` that sets it when no explicit value is given (parsed with ``parse``;
    by default as the default's type: a flag, an integer, text, else a number). ``advanced``: not
    among the settings a user normally tunes (documented on the advanced page).
    """
    if parse is None:
        parse = (parse_flag if isinstance(default, bool) else parse_int if isinstance(default, int)
                 else parse_text if isinstance(default, str) else parse_float)
    factory = None
    if isinstance(default, (dict, list)):
        factory, frozen_default = (lambda d=default: type(d)(d)), default
    metadata = {"doc": doc, "rule": rule, "env": env, "parse": parse, "tier": "advanced" if advanced else "public"}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={**metadata, "shown_default": frozen_default})
    return dataclasses.field(default=default, metadata=metadata)


def internal(default: Any, doc: str) -> Any:
    """A field that is not a setting: a named constant (``doc`` says what it bounds and why this
    value). Code and tests may construct the class with another value; :func:`load` never sets it."""
    return dataclasses.field(default=default, metadata={"internal": True, "doc": doc})


def internal_constants(kind: type) -> list[SettingInfo]:
    """The :func:`internal` fields of ``kind``, for the docs."""
    return [SettingInfo(item.name, item.default, item.metadata["doc"], None, "internal")
            for item in dataclasses.fields(kind) if item.metadata.get("internal")]


def group(kind: type, *, prefix: str = "", exclude: tuple[str, ...] = (), only: tuple[str, ...] = (),
          doc: str = "") -> Any:
    """A nested settings object whose settings are given in the same flat namespace, as
    ``prefix + name``. ``exclude`` (or all but ``only``): settings of ``kind`` not offered here;
    they keep their default."""
    if only:
        exclude = tuple(f.name for f in dataclasses.fields(kind) if f.name not in only)
    return dataclasses.field(default_factory=kind, metadata={"group": kind, "prefix": prefix, "exclude": exclude,
                                                              "doc": doc})


def _fields(kind: type) -> Iterator[tuple[str, dataclasses.Field]]:
    for item in dataclasses.fields(kind):
        if item.init and not item.metadata.get("internal"):
            yield item.name, item


def describe(kind: type, prefix: str = "", exclude: tuple[str, ...] = ()) -> list[SettingInfo]:
    """Every setting of ``kind`` (groups flattened), as keyword arguments name them."""
    found: list[SettingInfo] = []
    for name, item in _fields(kind):
        if name in exclude:
            continue
        meta = item.metadata
        if "group" in meta:
            found += describe(meta["group"], prefix + meta["prefix"], meta["exclude"])
        elif "doc" in meta:
            default = meta.get("shown_default", item.default)
            found.append(SettingInfo(prefix + name, default, meta["doc"], meta["env"], meta["tier"]))
    return found


def setting_values(settings: Any, prefix: str = "", exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """A settings object as the keyword arguments that :func:`load` would build it from."""
    values: dict[str, Any] = {}
    for name, item in _fields(type(settings)):
        if name in exclude:
            continue
        meta = item.metadata
        if "group" in meta:
            values.update(setting_values(getattr(settings, name), prefix + meta["prefix"], meta["exclude"]))
        elif "doc" in meta:
            values[prefix + name] = getattr(settings, name)
    return values


def setting_names(kind: type, prefix: str = "", exclude: tuple[str, ...] = ()) -> set[str]:
    """The keyword names :func:`load` accepts for ``kind``: its settings and its plain (required) fields."""
    names = set()
    for name, item in _fields(kind):
        if name in exclude:
            continue
        meta = item.metadata
        if "group" in meta:
            names |= setting_names(meta["group"], prefix + meta["prefix"], meta["exclude"])
        else:
            names.add(prefix + name)
    return names


def load(kind: type[T], given: Mapping[str, Any], *, env: Mapping[str, str] | None = None,
         error: type[Exception] = SettingsError, prefix: str = "", defaults: Mapping[str, Any] | None = None,
         strings: bool = False, sources: dict[str, str] | None = None) -> T:
    """Build ``kind`` from ``given`` (keyword name -> value), else its environment variable, else its default.
    A given None counts as not given, unless the setting accepts None and its default is not None.

    Unknown names are an error that suggests the closest known one. ``strings``: the given
    values are text (``--rdzv-conf``) and are parsed like environment values. ``defaults``
    override the declared defaults (by keyword name). Every value is checked against its
    field's rule; the message starts with ``prefix`` and names the setting (and the variable
    when the value came from the environment). After construction a ``validate()`` method,
    if ``kind`` has one, checks rules between settings. ``sources``, if given, receives where
    each set value came from (its keyword name, or its environment variable).
    """
    known = setting_names(kind)
    unknown = sorted(set(given) - known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise error(f"{prefix}unknown setting(s) {', '.join(hints)}; known: {', '.join(sorted(known))}")
    from lightning_ft.settings.environment import environ

    return _build(kind, given, environ() if env is None else env, error, prefix, "", (), dict(defaults or {}),
                  strings, {} if sources is None else sources)


def _build(kind: type[T], given: Mapping[str, Any], env: Mapping[str, str], error: type[Exception], prefix: str,
           name_prefix: str, exclude: tuple[str, ...], defaults: dict[str, Any], strings: bool,
           sources: dict[str, str]) -> T:
    values: dict[str, Any] = {}
    for name, item in _fields(kind):
        meta = item.metadata
        if name in exclude:
            continue
        if "group" in meta:
            values[name] = _build(meta["group"], given, env, error, prefix, name_prefix + meta["prefix"],
                                  meta["exclude"], defaults, strings, sources)
            continue
        key = name_prefix + name
        if "doc" not in meta:  # a plain field: required, given as it is
            if key in given:
                values[name] = given[key]
            continue
        # None means "not given" (the environment or the default decide) unless None is a value of
        # the setting of its own, other than its default (e.g. "no budget" where the default is one)
        default = defaults.get(key, item.default)
        if key in given and not (given[key] is None and (default is None or meta["rule"](None) is not None)):
            value, source = given[key], key
            if strings and isinstance(value, str):
                value = _parse(meta, value, key, error, prefix)
        elif meta["env"] and env.get(meta["env"], "").strip():
            source = meta["env"]
            value = _parse(meta, env[source].strip(), source, error, prefix)
        elif key in defaults:
            value, source = defaults[key], key
        else:
            continue
        problem = meta["rule"](value)
        if problem is not None:
            where = key if source == key else f"{key} (from {source}={env[source]!r})"
            raise error(f"{prefix}{where} must be {problem}, got {value!r}")
        values[name] = value
        sources[key] = source
    try:
        built = kind(**values)
    except SettingsError as exc:
        raise error(f"{prefix}{exc}") from None
    validate = getattr(built, "validate", None)
    if callable(validate):
        try:
            validate()
        except SettingsError as exc:
            raise error(f"{prefix}{exc}") from None
    return built


def _parse(meta: Mapping[str, Any], raw: str, source: str, error: type[Exception], prefix: str) -> Any:
    parse = meta["parse"]
    try:
        return parse(raw)
    except (TypeError, ValueError) as exc:
        expects = getattr(parse, "expects", None)
        what = f"must be {expects}" if expects else f"cannot be read ({exc})"
        raise error(f"{prefix}{source} {what}, got {raw!r}") from None


def markdown_table(kind: type, prefix: str = "", exclude: tuple[str, ...] = (), tier: str | None = None) -> str:
    """The settings of ``kind`` (of one ``tier``, or all) as a Markdown table (setting, default,
    environment variable, meaning), for the docs pages (``python -m lightning_ft.settings`` prints them)."""
    rows = ["| setting | default | environment | meaning |", "|---|---|---|---|"]
    for info in describe(kind, prefix, exclude):
        if tier is not None and info.tier != tier:
            continue
        default = "`None`" if info.default is None else f"`{info.default!r}`"
        env = f"`{info.env}`" if info.env else ""
        rows.append(f"| `{info.name}` | {default} | {env} | {info.doc.replace('|', '/')} |")
    return "\n".join(rows)
