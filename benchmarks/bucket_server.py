"""The S3-protocol bucket `bucket_storage.py` measures against: the tests' moto server
(`tests/support/s3_server.py`) in a child process, its requests logged, ranged GETs read at the
cost of the range (bucket_storage.py's docstring says why).

    .venv/bin/python benchmarks/bucket_server.py LOG [--moto-as-is]   # what `Bucket` starts
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def _cheap_ranged_gets() -> None:
    """In the server process: answer `Range: bytes=A-B` GETs by reading only those bytes."""
    from moto.s3 import models, responses

    ranged = threading.local()
    whole = models.FakeKey.value

    class _Window:
        """What `_handle_range_header` needs of an object's content: its length and a slice."""

        def __init__(self, key) -> None:
            self.key = key

        def __len__(self) -> int:
            return self.key.size

        def __getitem__(self, part: slice) -> bytes:
            with self.key.lock:
                self.key._value_buffer.seek(part.start)
                return self.key._value_buffer.read(part.stop - part.start)

    def value(self):
        return _Window(self) if getattr(ranged, "on", False) else whole.fget(self)

    models.FakeKey.value = property(value, whole.fset)
    key_response = responses.S3Response.key_response

    def ranged_key_response(self, request, full_url, headers):
        spec = request.headers.get("range", "")
        ranged.on = request.method == "GET" and re.fullmatch(r"bytes=\d+-\d+", spec) is not None
        try:
            return key_response(self, request, full_url, headers)
        finally:
            ranged.on = False

    responses.S3Response.key_response = ranged_key_response


def _log_requests(path: str) -> None:
    """In the server process: one line per request (start, end, method, path[?query])."""
    from urllib.parse import urlsplit

    from moto.s3 import responses

    lock = threading.Lock()
    log = open(path, "a", buffering=1)  # noqa: SIM115 (open for the server's lifetime)

    def logging(respond):
        def logged(self, request, full_url, headers):
            started = time.time()
            try:
                return respond(self, request, full_url, headers)
            finally:
                url = urlsplit(full_url)
                where = f"{url.path}?{url.query}" if url.query else url.path
                with lock:
                    log.write(f"{started:.4f} {time.time():.4f} {request.method} {where}\n")

        return logged

    for name in ("key_response", "bucket_response"):
        setattr(responses.S3Response, name, logging(getattr(responses.S3Response, name)))


def serve(log_path: str, as_is: bool) -> None:
    """The child: moto's server, until its stdin closes."""
    sys.path.insert(0, str(TESTS))
    from support import s3_server

    if not as_is:
        _cheap_ranged_gets()
    _log_requests(log_path)
    server = s3_server.S3Server()
    server.start()
    print(s3_server.ENDPOINT, flush=True)
    sys.stdin.read()
    server.stop()


class Bucket:
    """The S3 server in a child process; its endpoint and credentials in os.environ."""

    def __init__(self, work: Path, as_is: bool) -> None:
        sys.path.insert(0, str(TESTS))
        from support import s3_server

        self.log = work / "s3-requests.log"
        cmd = [sys.executable, __file__, str(self.log)]
        self.process = subprocess.Popen(
            [*cmd, *(["--moto-as-is"] if as_is else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.endpoint = self.process.stdout.readline().strip()
        if not self.endpoint.startswith("http://"):
            raise RuntimeError("the S3 server did not start")
        os.environ.update({**s3_server.CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint})

    def new(self, prefix: str) -> str:
        import uuid

        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return f"s3://{name}"

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def requests(self, since: float = 0.0) -> list[tuple[float, float, str, str]]:
        rows = []
        for line in self.log.read_text().splitlines():
            start, end, method, path = line.split(" ", 3)
            if float(start) >= since:
                rows.append((float(start), float(end), method, path))
        return rows

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="moto's S3 server until stdin closes")
    parser.add_argument("log", help="one line per request: start, end, method, path")
    parser.add_argument("--moto-as-is", action="store_true", help="whole-object ranged GETs")
    args = parser.parse_args()
    serve(args.log, args.moto_as_is)
