"""What every section shares: strict parsing, so a misspelt key is an error rather than a
silently ignored setting, and the check that a storage location is one a run can write to.
It sits apart so that each section module can use them without importing another section.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Where run state and prepared data may live besides a local folder (pyarrow.fs schemes).
STORAGE_SCHEMES = ("s3", "gs", "gcs", "file")


def check_storage_location(value: str | None) -> str | None:
    """A local path, or a URI of a scheme pyarrow can write to: never a URI folded into a
    local folder named `s3a:` that the user believes is a bucket."""
    if value is None or "://" not in value:
        return value
    scheme, _, rest = value.partition("://")
    if scheme not in STORAGE_SCHEMES:
        raise ValueError(
            f"{scheme}:// is not a storage this can write to; use a local path or "
            f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}"
        )
    if scheme != "file" and not rest.split("/", 1)[0]:
        raise ValueError("the URI names no bucket")
    return value
