"""Config text to values: YAML files, dotted `key=value` overrides, and each value checked against its dataclass field's
annotated type, every error naming the file or the dotted key."""
from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the key."""


# what a command line means by null for a key that may be null (YAML's null words, and `none` as the value checks
# have always taken it); anything else given to a text key is that text
NULL_TEXTS = ("", "~", "null", "none")


class Override:
    """One `key=value` override's value as YAML reads it (`parsed`) beside the text as typed (`raw`, outer blanks
    stripped): a key whose type is text (str, Optional[str], spark.conf's values) takes the text, every other key the
    YAML value, so `mlflow.experiment=1.10` stays '1.10' while `model.lr=1e-3` is a float."""

    __slots__ = ("parsed", "raw")

    def __init__(self, parsed: Any, raw: str):
        self.parsed = parsed
        self.raw = raw

    def is_null(self) -> bool:
        return self.raw.lower() in NULL_TEXTS

    def text(self) -> Any:
        """The text a text key takes: the raw text, or what YAML made of a quoted one ('1.10' -> 1.10)."""
        quoted = len(self.raw) >= 2 and self.raw[0] == self.raw[-1] and self.raw[0] in "'\""
        return self.parsed if quoted and isinstance(self.parsed, str) else self.raw

    def __repr__(self) -> str:
        return repr(self.raw)


class _YamlInt(int):
    """An int read from a YAML file, with the text it was read from (`raw`): a text key told apart 1:30:00 from
    5400."""

    raw = ""


class _YamlFloat(float):
    """A float read from a YAML file, with the text it was read from (`raw`): 1.10 is not 1.1 for a text key."""

    raw = ""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader whose ints and floats remember their text (`_YamlInt`, `_YamlFloat`)."""


def _remembering(base: Any, wrap: type) -> Any:
    def construct(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        value = wrap(base(loader, node))
        value.raw = str(node.value)
        return value
    return construct


_Loader.add_constructor("tag:yaml.org,2002:int", _remembering(yaml.SafeLoader.construct_yaml_int, _YamlInt))
_Loader.add_constructor("tag:yaml.org,2002:float", _remembering(yaml.SafeLoader.construct_yaml_float, _YamlFloat))


def _takes_text(tp: Any) -> bool:
    return tp is str or (typing.get_origin(tp) is typing.Union and str in typing.get_args(tp))


def _as_text(key: str, value: Any) -> str:
    """A text key's value as text: an override's text, a string, or a number whose text YAML kept (123); a number
    YAML changed (1.10 -> 1.1, 1:30:00 -> 5400, 0x10 -> 16) is refused, naming the key."""
    if isinstance(value, Override):
        if value.parsed is None and value.is_null():
            raise ConfigError(f"config key '{key}': value None is not a str (this key cannot be null)")
        return value.text()
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raw = getattr(value, "raw", None)
        if raw is not None and raw != str(value):
            raise ConfigError(f"config key '{key}': YAML reads {raw} as the {type_name(type(value).__mro__[1])} "
                              f"{value!r}, not the text {raw!r}; quote it ('{raw}') to keep the text")
        return str(value)
    hint = " (quote it to keep the text)" if value is not None else ""
    raise ConfigError(f"config key '{key}': value {value!r} is not a str{hint}")


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp`; return it as a plain value (ints widen to floats). `value` is
    what YAML read, or an `Override` (a command line's), of which a text key takes the text and any other the YAML."""
    if isinstance(value, Override) and not _takes_text(tp):
        value = value.parsed
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == len(typing.get_args(tp)):  # Union[int, str]: the first type that takes the value
            for arg in args[:-1]:
                try:
                    return coerce(key, value, arg)
                except ConfigError:
                    pass
            return coerce(key, value, args[-1])
        if isinstance(value, Override):  # Optional[str] on the command line: null only for the null words
            return None if value.is_null() else coerce(key, value, args[0])
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return coerce(key, value, args[0])
    if origin in (list, List):
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': value {value!r} is not a list")
        (item_tp,) = typing.get_args(tp)
        return [coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': value {value!r} is not a mapping")
        return {str(k): _as_text(f"{key}.{k}", v) if v is not None and not isinstance(v, bool) else str(v)
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': value {value!r} is not a bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        number = _float_or_none(value)  # 1e3 or 1000.0: a whole number in float form is still refused, said how
        hint = f": write the whole number {int(number)}" if number is not None and number.is_integer() else ""
        raise ConfigError(f"config key '{key}': value {value!r} is not an int{hint}")
    if tp is float:
        number = _float_or_none(value)
        if number is None:
            raise ConfigError(f"config key '{key}': value {value!r} is not a finite float (e.g. 0.01 or 1e-4)")
        return number
    if tp is str:
        return _as_text(key, value)
    return value


def _float_or_none(value: Any) -> Optional[float]:
    """`value` as a finite float (a number, or text Python's float() reads, such as '1e-4'), or None where it is not
    one. YAML 1.1 (PyYAML) reads `1e-4` (no dot) as a string, so a float key parses such text itself; nan, inf, an int
    too large for a float and words are not finite floats."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value) if isinstance(value, (str, int, float)) else None
    except (ValueError, OverflowError):
        return None
    return number if number is not None and math.isfinite(number) else None


def build(cls: type, data: Dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            where = f"section '{prefix}'" if prefix else "the top level"
            raise ConfigError(f"unknown config key '{dotted}'; valid keys of {where}: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            section = value.parsed if isinstance(value, Override) else value  # `train=null`: the defaults
            kwargs[key] = build(tp, section or {}, dotted)
        else:
            kwargs[key] = coerce(dotted, value, tp)
    return cls(**kwargs)


def merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in (over or {}).items():
        if isinstance(v, Override) and isinstance(v.parsed, dict) and isinstance(out.get(k), dict):
            v = v.parsed  # a section or spark.conf given as a mapping on the command line: merged as a file's is
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k == "conf":
            out[k] = {**out[k], **v}  # Spark's own dotted keys: one level, each override adds to the profile's
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> Dict[str, Any]:
    """`a.b=c` -> {'a': {'b': Override(c as YAML, 'c')}}: YAML's value (so 3, 0.1, true, null, [1, 2] work) beside
    the text, which a text key takes (`coerce`); spark.conf's own keys take the text alone."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.np=-2)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        parsed = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        parsed = raw
    value = Override(parsed, raw.strip())
    # spark.conf keys contain dots themselves: spark.conf.spark.jars=... -> conf['spark.jars'], the text as typed
    parts = key.split(".")
    if parts[:2] == ["spark", "conf"] and len(parts) > 2:
        return {"spark": {"conf": {".".join(parts[2:]): value.text()}}}
    node: Dict[str, Any] = {}
    cur = node
    for p in parts[:-1]:
        cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return node


def read_yaml(path: Path) -> Dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=_Loader) or {}  # a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return data
