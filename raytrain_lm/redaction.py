"""The one rule for what counts as a secret: MLflow params and tags, and every config YAML a
run writes (its run directory, its checkpoints, its MLflow artifact), go through it.

A value is a secret when its key looks like it names a credential, at any depth, whatever its
type (a number or a list can be a credential too): `scaling.label_selector.hf_token: abc` and
`fault.price_per_hour.api_key: 12345` are hidden; so is the count of a Ray resource named
`license_key`, the price of that rule. Empty values, None and booleans are not secrets. Configs
read back from what a run wrote (`config.read_written_config`) leave hidden values out.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
# Whole words only: `data.shard_tokens` and `data.tokenizer.kind` are settings, `hf_token`
# and `aws_secret_access_key` are secrets.
_SECRET_WORDS = {
    "token",
    "secret",
    "password",
    "passwd",
    "key",
    "apikey",
    "credential",
    "credentials",
    "auth",
}


def looks_secret(key: str) -> bool:
    """True for keys such as `hf_token`, `db.password`, `aws_secret_access_key`, `apiKey`."""
    last = re.split(r"[./]", key)[-1]
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", last).lower()
    return any(word in _SECRET_WORDS for word in re.split(r"[_\-\s]+", words))


def _hidden(key: str, value: Any) -> Any:
    if value is None or isinstance(value, bool) or value in ("", []):
        return value
    return REDACTED if looks_secret(key) else value


def redact(values: dict[str, Any]) -> dict[str, Any]:
    """The same flat mapping with the values of secret-looking keys replaced."""
    return {key: _hidden(key, value) for key, value in values.items()}


def redact_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """The same nested mapping (a config dump) with every secret value replaced."""
    return {
        key: redact_tree(value) if isinstance(value, dict) else _hidden(key, value)
        for key, value in tree.items()
    }
