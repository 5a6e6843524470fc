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


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp`; return it (ints widen to floats)."""
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
        return {str(k): str(v) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': value {value!r} is not a bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _float_or_none(value)  # 1e3 or 1000.0: a whole number in float form is still refused, said how
        hint = f": write the whole number {int(number)}" if number is not None and number.is_integer() else ""
        raise ConfigError(f"config key '{key}': value {value!r} is not an int{hint}")
    if tp is float:
        number = _float_or_none(value)
        if number is None:
            raise ConfigError(f"config key '{key}': value {value!r} is not a finite float (e.g. 0.01 or 1e-4)")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}': value {value!r} is not a str")
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
            kwargs[key] = build(tp, value or {}, dotted)
        else:
            kwargs[key] = coerce(dotted, value, tp)
    return cls(**kwargs)


def merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k == "conf":
            out[k] = {**out[k], **v}  # Spark's own dotted keys: one level, each override adds to the profile's
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> Dict[str, Any]:
    """`a.b=c` -> {'a': {'b': c}}, with c parsed as YAML (so 3, 0.1, true, null work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.np=-2)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    # spark.conf keys contain dots themselves: spark.conf.spark.jars=... -> conf['spark.jars']
    parts = key.split(".")
    if parts[:2] == ["spark", "conf"] and len(parts) > 2:
        return {"spark": {"conf": {".".join(parts[2:]): str(value)}}}
    node: Dict[str, Any] = {}
    cur = node
    for p in parts[:-1]:
        cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return node


def read_yaml(path: Path) -> Dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return data
