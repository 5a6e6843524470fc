"""Redaction: the one rule that decides which config keys, environment variables and URL parts are secrets, and the
functions that replace them before anything is written outward (MLflow params, tags and artifacts, the offline run
folder, tune's records, log lines, what ranks receive).

The rule, used everywhere:

- A key (a dotted config key such as `spark.conf.spark.hadoop.fs.s3a.secret.key`, a Spark conf key, an environment
  variable name such as `MLFLOW_TRACKING_PASSWORD`) is split into word parts on `.`, `_`, `-` and at camelCase
  boundaries (`secretKey` -> `secret`, `key`), compared without case. It is a secret when a part is one of
  SECRET_WORDS (secret, password, passwd, token, credential, their plurals, and the compounds apikey, accesskey,
  secretkey, privatekey), or is `key`/`keys` used as the key itself: not followed by a part that says it is a
  field's name or a setting about keys (`key_column`, `keySizeBits`, `keyStore`, see KEY_DESCRIBED_BY), and not
  preceded by a part that says it is a data key (`cache_key`, `partition_key`, see DATA_KEY_OWNERS). So
  `fs.s3a.access.key`, `fs.azure.account.key.<account>.dfs.core.windows.net` and `api_key` are secrets, while
  `data.key_column`, `cache_key`, `monkey` and `keyboard` are not (whole parts only).
- In any string, the user-info of a URL (`scheme://user:password@host`) loses its password (`user:***`); a user
  alone (`scheme://token@host`, often a token) is replaced whole (`***`), except in Azure storage URLs (abfs, abfss,
  wasb, wasbs), where it is the container (`abfss://container@account.dfs.core.windows.net/path`). Query parameters
  named like secrets (`?password=`, `&token=`, Azure's `sig=`) lose their values. Scheme, host, port and path stay.

A secret's value becomes REDACTED; None and empty values stay as they are (there is nothing to hide, and "unset"
remains visible).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, MutableMapping

REDACTED = "***redacted***"
URL_MASK = "***"

SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwords", "passwd", "token", "tokens", "credential",
                          "credentials", "apikey", "accesskey", "secretkey", "privatekey"})
# `key` followed by one of these names a field or a setting about keys, not a key: key_column, keySizeBits, keyStore
# (a path; its password is `keyStorePassword`, a secret by `password`), key_id is NOT here (an access key id is kept
# out of params too)
KEY_DESCRIBED_BY = frozenset({"column", "columns", "col", "cols", "field", "fields", "name", "names", "by", "type",
                              "prefix", "size", "bits", "length", "len", "store", "tab", "format", "func", "fn"})
# ... and preceded by one of these, a key of the data: cache_key, partition_key, sort_key, primary_key, join_key,
# split_key (data.split_key: what picks a row's train/val split)
DATA_KEY_OWNERS = frozenset({"cache", "partition", "sort", "primary", "foreign", "join", "group", "dict", "row",
                             "shuffle", "lookup", "hash", "dedup", "idempotency", "split"})
# URL schemes whose user-info, when a name alone, is a container (Azure: abfss://<container>@<account>...), not a token
_CONTAINER_SCHEMES = frozenset({"abfs", "abfss", "wasb", "wasbs"})
# query parameters that carry a signature (Azure SAS `sig`, S3 presigned `X-Amz-Signature`)
_SIGNATURE_PARAMS = frozenset({"sig", "signature", "x-amz-signature"})

# MLflow's credentials (basic auth, bearer token; a Databricks workspace's host and token, with which MLflow reaches the
# workspace's tracking server from a worker) and the tracking URI, which may hold them (`http://user:password@host`):
# rank 0 alone writes to MLflow, so only it needs them; the launcher forwards them to every rank only because the
# launch paths give all ranks one environment, and ranks but 0 drop them (no other rank uses MLflow)
WORKSPACE_CREDENTIALS = ("DATABRICKS_HOST", "DATABRICKS_TOKEN")
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                        "MLFLOW_TRACKING_URI", *WORKSPACE_CREDENTIALS)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SEPARATORS = re.compile(r"[._\-]+")
# scheme://userinfo@ : greedy up to the last '@' before the path, query, fragment or whitespace
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/?#@]*(?:@[^\s/?#@]*)*)@")
_QUERY_PARAM = re.compile(r"(?P<lead>[?&;])(?P<name>[^=&#\s;]+)=(?P<value>[^&#\s;]*)")


def word_parts(key: str) -> list:
    """`key` split on `.`, `_`, `-` and camelCase boundaries, lower case: 'fs.s3a.secretKey' -> fs s3a secret key."""
    parts = []
    for chunk in _SEPARATORS.split(str(key)):
        parts.extend(p.lower() for p in _CAMEL.split(chunk) if p)
    return parts


def is_secret_key(key: str) -> bool:
    """Whether the config key, Spark conf key or environment variable name `key` names a secret (the module's rule)."""
    parts = word_parts(key)
    for i, part in enumerate(parts):
        if part in SECRET_WORDS:
            return True
        if part in ("key", "keys"):
            after = parts[i + 1] if i + 1 < len(parts) else None
            before = parts[i - 1] if i > 0 else None
            if after not in KEY_DESCRIBED_BY and before not in DATA_KEY_OWNERS:
                return True
    return False


def _mask_userinfo(match: "re.Match") -> str:
    userinfo = match.group("userinfo")
    user, sep, _password = userinfo.partition(":")
    if sep and user:
        return f"{match.group('scheme')}{user}:{URL_MASK}@"
    if not sep and match.group("scheme")[:-3].lower() in _CONTAINER_SCHEMES:
        return match.group(0)  # abfss://<container>@<account>...: a container's name, not a secret
    return f"{match.group('scheme')}{URL_MASK}@"  # a user alone is often a token (https://<token>@host)


def _mask_query(match: "re.Match") -> str:
    name = match.group("name")
    if match.group("value") and (is_secret_key(name) or name.lower() in _SIGNATURE_PARAMS):
        return f"{match.group('lead')}{name}={URL_MASK}"
    return match.group(0)


def redact_url(text: Any) -> Any:
    """`text` with the password of every URL's user-info (or a user alone) and secret query values replaced by `***`;
    anything else (scheme, host, port, path, other text around the URL) unchanged. Non-strings are returned as they
    are. 'postgresql://optuna:pw@db:5432/optuna' -> 'postgresql://optuna:***@db:5432/optuna'."""
    if not isinstance(text, str) or "://" not in text and "=" not in text:
        return text
    out = _USERINFO.sub(_mask_userinfo, text) if "@" in text else text
    if "?" in out or "&" in out:
        out = _QUERY_PARAM.sub(_mask_query, out)
    return out


def error_line(exc: BaseException, limit: int = 500) -> str:
    """`Type: first line` of an exception (its first `limit` characters), URL passwords hidden: for text that goes
    into a tag, a study or a one-line message."""
    text, name = str(exc), type(exc).__name__
    # redacted whole, then cut: a cut inside `user:password@` would leave no `@` for the pattern to find
    return redact_url(f"{name}: {text.splitlines()[0] if text else ''}")[:len(name) + 2 + limit]


def is_secret(key: str, value: Any) -> bool:
    """Whether the setting `key`=`value` (a config or Spark key, an environment variable) holds a secret: its name is
    a secret's (`is_secret_key`), or its value holds a URL's credentials or a secret query parameter (`redact_url`
    changes it)."""
    return is_secret_key(key) or redact_url(str(value)) != str(value)


def redact_value(key: str, value: Any) -> Any:
    """The value to show for `key`: REDACTED when the key is a secret (None and '' stay), else `redacted`'s walk."""
    if is_secret_key(key):
        return value if value is None or value == "" else REDACTED
    return _walk(str(key), value)


def _walk(prefix: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: redact_value(f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(prefix, v) for v in value)
    return redact_url(value)


def redacted(mapping: Mapping[str, Any]) -> dict:
    """A copy of a flat (`{'spark.conf': {...}, 'train.np': -2}`) or nested (`{'spark': {'conf': {...}}}`) mapping of
    config values with every secret replaced: a key is judged by its full dotted path (`spark.conf.<spark key>`), a
    secret's value becomes REDACTED (a nested mapping under a secret key too), and every other string has
    `redact_url` applied. The input is not changed."""
    return _walk("", mapping)


def without(environ: MutableMapping[str, str], names: Iterable[str]) -> list:
    """Remove `names` from `environ` in place (e.g. os.environ); returns the names that were there."""
    removed = [name for name in names if name in environ]
    for name in removed:
        del environ[name]
    return removed


__all__ = ["REDACTED", "TRACKING_CREDENTIALS", "WORKSPACE_CREDENTIALS", "is_secret_key", "redact_url", "redact_value",
           "redacted", "without", "word_parts"]
