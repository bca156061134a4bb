"""The audit trail: who ran what, from which code, on which cluster.

Every `submit`, `stop`, `sweep`, `promote` and `cluster up`/`down` appends a record before it
acts: when (UTC), the OS user and host, the action, the cluster, the command line (secrets
hidden: redaction.py's rule, and passwords in URLs), the git commit of the working directory
and whether its tree was dirty, the config's digest, the job id, the run and its MLflow run.

The log is `audit/` under the storage the runs go to (a folder, or a bucket prefix): one
object per record, named by its time and a random suffix, created and never overwritten, so
records from several machines never collide and the log only grows. A record that cannot be
written stops the action with one line; nothing is skipped silently. A submitted job's record
also travels with the job (`AUDIT_ENV`): its driver tags its MLflow run with the same facts,
and writes the record itself where the submitting machine cannot (a folder on a remote head).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import posixpath
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from raytrain_lm.errors import UserError
from raytrain_lm.redaction import REDACTED, looks_secret
from raytrain_lm.storage import (
    exists,
    filesystem,
    is_uri,
    join,
    makedirs,
    read_bytes,
    write_bytes,
)

AUDIT_FOLDER = "audit"
AUDIT_ENV = "RAYTRAIN_LM_AUDIT"  # a submitted job's record, for its driver
TAG_PREFIX = "raytrain_lm.audit."
TAGGED = ("action", "time", "user", "host", "cluster", "git_commit", "git_dirty",
          "config_digest", "job_id")  # fmt: skip
# user:password@ in a URL; the password may hold / and @ (the last @ ends it)
_URL_PASSWORD = re.compile(r"(://[^/:@\s]*:)\S*@")


def new_record(
    action: str,
    *,
    cluster: str | None = None,
    config_digest: str | None = None,
    job_id: str | None = None,
    run: str | None = None,
    mlflow_run: str | None = None,
    working_dir: str | Path = ".",
) -> dict[str, Any]:
    commit, dirty = git_state(working_dir)
    return {
        "time": datetime.now(timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "user": getpass.getuser(),
        "host": socket.gethostname(),
        "action": action,
        "cluster": hide_secrets(cluster) if cluster else cluster,
        "command": hidden_command(_command()),
        "git_commit": commit,
        "git_dirty": dirty,
        "config_digest": config_digest,
        "job_id": job_id,
        "run": run,
        "mlflow_run": mlflow_run,
    }


def _command() -> list[str]:
    """This process's command line, the CLI's as the user typed it (`raytrain-lm ...`, also
    for `python -m raytrain_lm.cli`); from the Python API, the program's own."""
    program = sys.argv[0] if sys.argv else ""
    if Path(program).name == "raytrain-lm" or program.endswith(
        os.path.join("raytrain_lm", "cli", "__main__.py")
    ):
        return ["raytrain-lm", *sys.argv[1:]]
    return list(sys.argv)


def hidden_command(words: list[str]) -> list[str]:
    """`words` with every secret hidden: `key=value` words (hide_secrets), and the value
    after a credential's key written as its own word (`--data.hf_token VALUE`, as the CLI
    takes an override)."""
    hidden = []
    for i, word in enumerate(words):
        previous = words[i - 1] if i else ""
        named = previous.startswith("--") and "=" not in previous and looks_secret(previous[2:])
        hidden.append(REDACTED if named else hide_secrets(word))
    return hidden


def hide_secrets(word: str) -> str:
    """A command-line word with a secret's value hidden: `key=value` where the key names a
    credential, and the password in a URL (`postgresql://user:PASSWORD@host`)."""
    key, equals, value = word.partition("=")
    if equals and looks_secret(key.lstrip("-")) and value:
        return f"{key}={REDACTED}"
    return _URL_PASSWORD.sub(rf"\1{REDACTED}@", word)


def git_state(working_dir: str | Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git tree at `working_dir`; (None, None) outside one."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=working_dir, capture_output=True, text=True,
            timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=working_dir,
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(changes.strip())


def digest(text: str) -> str:
    """A config's digest: the first 16 hex digits of the SHA-256 of its resolved YAML."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def folder(storage: str | Path) -> str:
    return str(join(os.path.expandvars(os.path.expanduser(str(storage))), AUDIT_FOLDER))


def write(storage: str | Path, record: dict[str, Any]) -> str:
    """Appends `record` to the log under `storage`; returns where it went. A new object each
    time (created exclusively in a folder; a name no other record has in a bucket)."""
    where = folder(storage)
    path = f"{where}/{new_name(record)}"
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        if is_uri(where):
            if exists(path):  # never overwrite, even on a name collision
                raise FileExistsError(path)
            write_bytes(path, data)
        else:
            makedirs(where)
            with open(path, "xb") as out:
                out.write(data)
    except OSError as exc:
        raise UserError(
            f"audit: cannot write the record of `{record['action']}` under {where} "
            f"({type(exc).__name__}: {exc}); nothing was done"
        ) from None
    return path


def new_name(record: dict[str, Any]) -> str:
    """A record's object name: its time (so a listing is in order), its action and a random
    suffix no other record has."""
    stamp = record["time"].replace(":", "").replace("-", "").replace(".", "")
    return f"{stamp}-{record['action'].replace(' ', '_')}-{uuid.uuid4().hex[:8]}.json"


def read(storage: str | Path, run: str | None = None, since: float | None = None) -> list[dict]:
    """The records under `storage`, oldest first: of `run` only, and from `since` (a Unix
    time) on, when given."""
    import pyarrow.fs as pafs

    where = folder(storage)
    fs, inner = filesystem(where)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    names = sorted(i.base_name for i in infos if i.base_name.endswith(".json"))
    records = [json.loads(read_bytes(f"{where}/{name}")) for name in names]
    if run is not None:
        records = [r for r in records if r.get("run") == run]
    if since is not None:
        records = [r for r in records if _unix_time(r["time"]) >= since]
    return sorted(records, key=lambda r: r["time"])


def mlflow_tags(record: dict[str, Any]) -> dict[str, str]:
    return {TAG_PREFIX + key: str(record[key]) for key in TAGGED if record.get(key) is not None}


def since_time(value: str, now: float | None = None) -> float:
    """`--since`: a duration back from now (`30m`, `2h`, `7d`) or an ISO date or time."""
    now = time.time() if now is None else now
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", value.strip())
    if found:
        seconds = {"s": 1, "m": 60, "h": 3600, "d": 86400}[found.group(2)]
        return now - float(found.group(1)) * seconds
    try:
        return _unix_time(value)
    except ValueError:
        raise UserError(
            f"--since {value!r}: write a duration (30m, 2h, 7d) or a date (2026-12-07 or "
            "2026-12-07T08:00)"
        ) from None


def line(record: dict[str, Any]) -> str:
    """One record as `raytrain-lm audit` prints it."""
    code = record.get("git_commit")
    code = f"{code[:10]}{' (dirty)' if record.get('git_dirty') else ''}" if code else "no git"
    facts = [
        f"{key}={record[key]}"
        for key in ("run", "job_id", "cluster", "config_digest", "mlflow_run")
        if record.get(key)
    ]
    if record.get("model"):  # a promotion's
        model = record["model"]
        facts.append(f"model={model['name']}@{model['alias']} (step {model['step']})")
    command = " ".join(record.get("command") or [])
    return (
        f"{record['time']} {record['user']}@{record['host']} {record['action']} "
        f"{' '.join(facts)} code={code} | {command}"
    )


def _unix_time(text: str) -> float:
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def job_record(output_dir: str) -> dict[str, str]:
    """In a submitted job's driver: writes the submit's record if the submitting machine
    could not (a folder on this head: the storage above `output_dir`), before the run starts;
    returns its facts as tags for the run's MLflow run ({} outside a submitted job)."""
    raw = os.environ.get(AUDIT_ENV)
    if not raw:
        return {}
    record = json.loads(raw)
    if record.pop("written_by", None) == "job":
        write(storage_of(output_dir), record)
    return mlflow_tags(record)


def storage_of(output_dir: str | Path) -> str:
    """The storage whose `runs` folder is `output_dir`: where the audit log goes (a bucket's
    root when `output_dir` is one)."""
    path = str(output_dir).rstrip("/")
    scheme, separator, rest = path.partition("://")
    if separator and "/" not in rest:
        return path
    return posixpath.dirname(path) or "."


def script_writing(storage: str, record: dict[str, Any]) -> str:
    """A one-line job writing `record` under `storage` on the head (a folder there that this
    machine cannot reach), with the standard library only, exclusively as `write` does."""
    code = (
        "import os, sys; "
        "d = os.path.join(os.path.expandvars(os.path.expanduser(sys.argv[1])), 'audit'); "
        "os.makedirs(d, exist_ok=True); "
        "f = open(os.path.join(d, sys.argv[2]), 'x'); f.write(sys.argv[3] + '\\n'); f.close()"
    )
    words = [storage, new_name(record), json.dumps(record, sort_keys=True)]
    return f"python -c {shlex.quote(code)} " + " ".join(shlex.quote(w) for w in words)
