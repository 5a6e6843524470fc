"""Resolve a `models:/<name>@<alias>` or `models:/<name>/<version>` URI to one registered model version, pinned."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.tracking.pyfunc import load_pyfunc
from pipeline.tracking.registry import model_versions

_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[^/@]+))$")


class ModelNotFound(ValueError):
    """The model URI names no registered version; the message names the URI and what exists."""


@dataclass(frozen=True)
class PinnedModel:
    """One registered version: what every output records, whatever alias was asked for."""

    name: str
    version: str
    run_id: str
    requested: str

    @property
    def uri(self) -> str:
        """The version's own URI: loading it cannot change if the alias moves during a job."""
        return f"models:/{self.name}/{self.version}"


def parse_model_uri(uri: str) -> Tuple[str, str, str]:
    """`models:/name@alias` -> (name, "alias", alias); `models:/name/3` -> (name, "version", "3")."""
    m = _URI.match(uri or "")
    if not m:
        raise ModelNotFound(f"--model {uri!r}: expected models:/<name>@<alias> or models:/<name>/<version>")
    if m.group("alias"):
        return m.group("name"), "alias", m.group("alias")
    version = m.group("version")
    if version.lower() == "latest":
        return m.group("name"), "latest", version
    if not version.isdigit():
        raise ModelNotFound(f"--model {uri!r}: version {version!r} is not a number (use @<alias> for an alias)")
    return m.group("name"), "version", version


def resolve(client: MlflowClient, uri: str) -> PinnedModel:
    """Pin `uri` to one version; raise ModelNotFound naming the model, alias or version that is missing."""
    name, kind, ref = parse_model_uri(uri)
    try:
        if kind == "alias":
            mv = client.get_model_version_by_alias(name, ref)
        elif kind == "latest":
            versions = model_versions(client, name)
            if not versions:
                raise ModelNotFound(f"--model {uri!r}: registered model {name!r} has no versions")
            mv = max(versions, key=lambda v: int(v.version))
        else:
            mv = client.get_model_version(name, ref)
    except MlflowException as exc:
        raise ModelNotFound(f"--model {uri!r}: {_short(exc)}{_known(client, name)}") from None
    return PinnedModel(name=name, version=str(mv.version), run_id=str(mv.run_id or ""), requested=uri)


def _short(exc: MlflowException) -> str:
    return str(getattr(exc, "message", exc)).splitlines()[0][:300]


def _known(client: MlflowClient, name: str) -> str:
    try:
        versions = model_versions(client, name)
        model = client.get_registered_model(name)
    except MlflowException:
        return f" (no registered model {name!r} in this tracking store)"
    aliases = dict(getattr(model, "aliases", {}) or {})
    return (f" (model {name!r} has versions {sorted(int(v.version) for v in versions)}, "
            f"aliases {aliases or 'none'})")


def load_network(pinned: PinnedModel) -> Tuple[Any, Dict[str, Any]]:
    """The version's eval-mode torch network and its meta, loaded through the logged pyfunc."""
    model = load_pyfunc(pinned.uri).unwrap_python_model()
    if not hasattr(model, "network") or not hasattr(model, "meta"):
        raise ModelNotFound(f"model {pinned.name!r} version {pinned.version} is not an image classifier logged by "
                            f"pipeline.tracking.pyfunc.log_model (its python model is {type(model).__name__})")
    return model.network.eval(), dict(model.meta)
