"""The search space: a YAML file of config keys -> Optuna distributions, checked against the config before any trial.

Format (conf/search/demo.yaml)::

    params:                       # dotted config key -> distribution
      model.lr: {type: float, low: 1.0e-3, high: 0.1, log: true}
      train.warmup_epochs: {type: int, low: 0, high: 2}
      data.batch_size: {type: categorical, choices: [16, 32, 64]}
    fixed:                        # optional: set in every trial
      train.max_epochs: 4
    enqueue:                      # optional: trials to run first (Optuna's enqueue_trial), values from `params`
      - {model.lr: 0.01, data.batch_size: 32}

A stepped range must fit its grid: `high` is `low` plus a whole number of `step`s (Optuna would lower it silently),
and an enqueued value is on that grid. A number in exponent form needs a dot and the exponent's sign (`1.0e-5`):
PyYAML reads `1e-5` as a string, refused with that hint.

Which keys a trial may set: the data is converted once and shared by the trials, so keys that would change the
job around the trials (Spark, Delta, MLflow, the ranks, the checkpoint folder) are refused; `data.batch_size` and the
other read-time data keys re-plan the shards from the same files; other data keys (image size, channels, val
fraction, partitions) convert once per distinct value (the cache is content-keyed).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from pipeline.config import Config, ConfigError, apply_overrides
from pipeline.log import get_logger

log = get_logger(__name__)

KINDS = ("float", "int", "categorical")
TOP_KEYS = ("params", "fixed", "enqueue")
REFUSED_SECTIONS = {
    "spark": "the Spark session is the sweep's, started once",
    "delta": "every trial reads the same pinned table version",
    "ingest": "ingest is not part of a trial",
    "mlflow": "every trial logs to the sweep's experiment and registry",
    "tune": "the study's own settings cannot vary per trial",
}
REFUSED_KEYS = {
    "data.cache_dir": "the converted data is shared by every trial",
    "data.cache_max_gb": "the converted data is shared by every trial",
    "train.np": "the world size fixes the converted partitions; run one sweep per world size",
    "train.backend": "one backend per sweep, so trials compare like with like",
    "train.checkpoint_dir": "each trial gets its own folder under it",
    "train.ckpt_restore": "every trial starts from scratch",
    "train.ckpt_allow_other_data": "every trial starts from scratch",
    "train.early_stopping.monitor": "the trial's value is tune.metric at the monitor's best epoch: set both, equal, "
                                    "outside the space",
    "train.early_stopping.mode": "the trial's value is tune.metric at the monitor's best epoch: set it with "
                                 "tune.direction, outside the space",
}
# Data keys read by the ranks, not by the conversion: a trial may change them and still share the converted files
# (a new batch size re-plans the shards from the same row groups).
READ_TIME_DATA_KEYS = ("data.batch_size", "data.reader_workers", "data.shuffle_buffer", "data.memory_cache_mb",
                       "data.seed", "data.reader")


def refusal(key: str) -> Optional[str]:
    """Why a trial may not set `key`, or None."""
    if key in REFUSED_KEYS:
        return REFUSED_KEYS[key]
    section = key.split(".", 1)[0]
    return REFUSED_SECTIONS.get(section)


def is_conversion_key(key: str) -> bool:
    """A data key that changes the converted files (a trial setting it converts once per distinct value)."""
    return key.startswith("data.") and key not in READ_TIME_DATA_KEYS and refusal(key) is None


def conversion_settings(cfg: Config) -> tuple:
    """The config values that decide the converted data (equal settings share one conversion)."""
    return tuple(sorted((k, repr(v)) for k, v in cfg.flat().items() if is_conversion_key(k)))


@dataclass(frozen=True)
class Param:
    """One searched key and its distribution."""

    key: str
    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: tuple = ()

    def distribution(self):
        """The Optuna distribution (Optuna is imported here, on the driver only)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "float":
            return FloatDistribution(self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return CategoricalDistribution(list(self.choices))

    def suggest(self, trial) -> Any:
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return trial.suggest_categorical(self.key, list(self.choices))

    def contains(self, value: Any) -> bool:
        """Whether a trial can have `value` (an enqueued one): in range and, with `step`, on its grid from `low`."""
        if self.kind == "categorical":
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if not self.low <= value <= self.high:
            return False
        if self.kind == "int":
            return (value - int(self.low)) % int(self.step or 1) == 0
        if self.step:  # Optuna's own test of a stepped float (FloatDistribution)
            k = (value - self.low) / self.step
            return abs(k - round(k)) < 1.0e-8
        return True

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"categorical {list(self.choices)}"
        extra = (" log" if self.log else "") + (f" step {self.step:g}" if self.step else "")
        return f"{self.kind} [{self.low:g}, {self.high:g}]{extra}"


@dataclass
class SearchSpace:
    """The parsed space file: searched params, fixed values, trials to enqueue, and the file's text."""

    params: Dict[str, Param]
    fixed: Dict[str, Any] = field(default_factory=dict)
    enqueue: List[Dict[str, Any]] = field(default_factory=list)
    source: str = "<text>"
    text: str = ""

    def suggest(self, trial) -> Dict[str, Any]:
        """The trial's overrides: the fixed values, then one suggestion per param (define-by-run)."""
        values = dict(self.fixed)
        for key, param in self.params.items():
            values[key] = param.suggest(trial)
        return values

    def values_of(self, key: str, default: Any) -> List[Any]:
        """Every value a trial may give `key`: its choices where it is searched as a category, its fixed value, the
        trials enqueued with one, else `default` (the config's); a searched number is its config value here too."""
        param = self.params.get(key)
        values = list(param.choices) if param is not None and param.kind == "categorical" else []
        values += [self.fixed[key]] if key in self.fixed else []
        values += [trial[key] for trial in self.enqueue if key in trial]
        return values or [default]

    def needs_conversion(self) -> List[str]:
        """The keys of this space that make trials convert their own data."""
        return [k for k in list(self.params) + list(self.fixed) if is_conversion_key(k)]

    def describe(self) -> Dict[str, str]:
        return {k: p.describe() for k, p in self.params.items()}


def _err(source: str, where: str, what: str) -> ConfigError:
    return ConfigError(f"search space {source}: {where}: {what}")


_NUMBER_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def yaml_number_hint(value: Any) -> str:
    """For a string that reads as a number: how to write it so that PyYAML reads a number (YAML 1.1's float needs a
    dot and, with an exponent, its sign: `1e-5` and `1.0e5` are text, `1.0e-5` and `1.0e+5` numbers)."""
    text = value.strip() if isinstance(value, str) else ""
    if not _NUMBER_TEXT.fullmatch(text):
        return ""
    mantissa, e, exponent = text.partition("e" if "e" in text else "E")
    sign = "" if exponent[:1] in ("+", "-") else "+"
    written = f"{mantissa if '.' in mantissa else mantissa + '.0'}{e}{sign}{exponent}"
    if not e or written == text:
        return " (a string: write the number without quotes)"
    return f" (PyYAML reads {text} as text: write {written}, with a dot and the exponent's sign)"


def _number(source: str, where: str, spec: Dict[str, Any], name: str, kind: str) -> float:
    value = spec.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(source, where, f"'{name}' must be a number, got {value!r}{yaml_number_hint(value)}")
    if kind == "int" and not isinstance(value, int):
        raise _err(source, where, f"'{name}' must be an int for type int, got {value!r}")
    if not math.isfinite(value):
        raise _err(source, where, f"'{name}' must be finite, got {value!r}")
    return value


def parse_param(source: str, key: str, spec: Any, stored: bool = False) -> Param:
    """One `params` entry -> Param, or a ConfigError naming the file and key. `stored`: a study's own space (a
    resume), whose range off its step grid is a warning: the study was made before that was refused."""
    where = f"params.{key}"
    if not isinstance(spec, dict):
        raise _err(source, where, f"must be a mapping with 'type' ({', '.join(KINDS)}), got {spec!r}")
    kind = spec.get("type")
    if kind not in KINDS:
        raise _err(source, where, f"'type' must be one of {', '.join(KINDS)}, got {kind!r}")
    allowed = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
               "categorical": {"type", "choices"}}[kind]
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise _err(source, where, f"unknown field(s) {', '.join(map(str, unknown))} for type {kind}; "
                                  f"allowed: {', '.join(sorted(allowed))}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise _err(source, where, f"'choices' must be a non-empty list, got {choices!r}")
        for c in choices:
            if c is not None and not isinstance(c, (bool, int, float, str)):
                raise _err(source, where, f"choice {c!r} is not a number, string, bool or null")
        if len({repr(c) for c in choices}) != len(choices):
            raise _err(source, where, f"'choices' has duplicates: {choices!r}")
        return Param(key=key, kind=kind, choices=tuple(choices))
    low = _number(source, where, spec, "low", kind)
    high = _number(source, where, spec, "high", kind)
    if low >= high:
        raise _err(source, where, f"'low' ({low}) must be below 'high' ({high})")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise _err(source, where, f"'log' must be true or false, got {log!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(source, where, spec, "step", kind)
        if step <= 0:
            raise _err(source, where, f"'step' must be > 0, got {step}")
        if log:
            raise _err(source, where, "'step' and 'log: true' cannot be combined (Optuna samples one or the other)")
    if log and low <= 0:
        raise _err(source, where, f"'low' ({low}) must be > 0 with 'log: true'")
    if step is not None:
        _check_grid(source, where, low, high, step, stored)
    return Param(key=key, kind=kind, low=low, high=high, log=log, step=step)


def _check_grid(source: str, where: str, low: float, high: float, step: float, stored: bool = False) -> None:
    """A stepped range draws `low + k * step` only: a `step` wider than the range leaves `low` alone, and a `high`
    off that grid is lowered by Optuna, silently; both are refused (in Optuna's own decimal arithmetic). In a study's
    stored space (`stored`: a resume) a warning: the study began with it, before this was refused."""
    span, st = Decimal(str(high)) - Decimal(str(low)), Decimal(str(step))
    problem = None
    if st > span:
        problem = _err(source, where, f"'step' ({step}) is wider than the range from 'low' ({low}) to 'high' "
                                      f"({high}): every trial would draw {low}; lower 'step' or widen the range")
    elif span % st != 0:
        below = Decimal(str(low)) + (span // st) * st
        problem = _err(source, where, f"'high' ({high}) is not 'low' ({low}) plus a whole number of 'step' "
                                      f"({step}): Optuna would lower it to {below}; set 'high' to {below} or "
                                      f"{below + st}")
    if problem is not None and stored:
        log.warning("%s; the study began with this space, so its trials keep drawing from it", problem)
    elif problem is not None:
        raise problem


def _check_key(source: str, where: str, key: Any) -> None:
    if not isinstance(key, str) or "." not in key:
        raise _err(source, where, f"key {key!r} is not a dotted config key (e.g. model.lr)")
    why = refusal(key)
    if why:
        raise _err(source, where, f"config key '{key}' cannot be set per trial: {why}")


def _check_values(source: str, where: str, cfg: Config, values: Dict[str, Any]) -> None:
    try:
        apply_overrides(cfg, values)
    except ConfigError as exc:
        raise _err(source, where, str(exc)) from None


def samples(param: Param) -> Sequence[Any]:
    """The values checked against the config: both ends of a range, every choice."""
    if param.kind == "categorical":
        return param.choices
    if param.kind == "int":
        return (int(param.low), int(param.high))
    return (float(param.low), float(param.high))


def parse_space(data: Any, cfg: Config, source: str = "<text>", text: str = "", stored: bool = False) -> SearchSpace:
    """A loaded YAML document -> SearchSpace, every key and value checked against `cfg`.

    Raises:
        ConfigError: naming the file, the entry (params.KEY, fixed.KEY, enqueue[i]) and what is wrong.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"search space {source}: must be a mapping with 'params' (and optional 'fixed', "
                          f"'enqueue'), got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"search space {source}: unknown top-level key(s) {', '.join(unknown)}; "
                          f"valid: {', '.join(TOP_KEYS)}")
    raw_params = data.get("params")
    if not isinstance(raw_params, dict) or not raw_params:
        raise ConfigError(f"search space {source}: 'params' must be a non-empty mapping of config key -> "
                          f"distribution, got {raw_params!r}")
    params: Dict[str, Param] = {}
    for key, spec in raw_params.items():
        _check_key(source, f"params.{key}", key)
        param = parse_param(source, key, spec, stored)
        for value in samples(param):
            _check_values(source, f"params.{key}", cfg, {key: value})
        params[key] = param
    fixed = data.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise ConfigError(f"search space {source}: 'fixed' must be a mapping of config key -> value, got {fixed!r}")
    for key in fixed:
        _check_key(source, f"fixed.{key}", key)
        if key in params:
            raise _err(source, f"fixed.{key}", "is also searched in 'params'; keep it in one of them")
    _check_values(source, "fixed", cfg, dict(fixed))
    enqueue = data.get("enqueue") or []
    if not isinstance(enqueue, list):
        raise ConfigError(f"search space {source}: 'enqueue' must be a list of mappings, got {enqueue!r}")
    for i, entry in enumerate(enqueue):
        where = f"enqueue[{i}]"
        if not isinstance(entry, dict) or not entry:
            raise _err(source, where, f"must be a non-empty mapping of searched key -> value, got {entry!r}")
        for key, value in entry.items():
            if key not in params:
                raise _err(source, where, f"key {key!r} is not searched in 'params' ({', '.join(params)})")
            if not params[key].contains(value):
                grid = " (a stepped range draws only 'low' plus whole steps)" if params[key].step else ""
                raise _err(source, where, f"{key}={value!r} is outside its distribution {params[key].describe()}"
                                          f"{grid}{yaml_number_hint(value)}")
    return SearchSpace(params=params, fixed=dict(fixed), enqueue=[dict(e) for e in enqueue], source=source,
                       text=text or yaml.safe_dump(data, sort_keys=False))


def load_space(path: str, cfg: Config) -> SearchSpace:
    """Read and check a search space file (see the module docstring for the format).

    Raises:
        ConfigError: the file is missing, not YAML, or an entry is wrong (named).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"search space {path} does not exist") from None
    return space_from_text(text, cfg, str(path))


def space_from_text(text: str, cfg: Config, source: str = "<text>", stored: bool = False) -> SearchSpace:
    """A search space from its YAML text (`stored`: a study's own, on resume: see `parse_param`)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"search space {source} is not valid YAML: {exc}") from None
    return parse_space(data, cfg, source, text, stored)
