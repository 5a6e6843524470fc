"""Resolve a `models:/<name>@<alias>` or `models:/<name>/<version>` URI to one registered model version, pinned."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.tracking.pyfunc import load_pyfunc

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


def name_filter(name: str) -> Optional[str]:
    """MLflow's search filter `name = <name>` for a registered model's name: its filter syntax has no escape inside a
    quoted value (`name='bob\\'s'` and `name='bob''s'` match nothing), so a name with a single quote is quoted with
    double quotes, any other with single quotes. None for a name with both: no filter string can name it."""
    if "'" not in name:
        return f"name='{name}'"
    if '"' not in name:
        return f'name="{name}"'
    return None


def model_versions(client: MlflowClient, name: str) -> List[Any]:
    """The versions of registered model `name`, whatever characters its name holds (`name_filter`; a name with both
    quote characters: every version in the registry, page by page, kept where the name is equal)."""
    filter_string = name_filter(name)
    if filter_string is not None:
        return list(client.search_model_versions(filter_string))
    found, token = [], None
    while True:
        page = client.search_model_versions(page_token=token)
        found.extend(v for v in page if v.name == name)
        token = getattr(page, "token", None)
        if not token:
            return found


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
