"""A real S3-protocol server on 127.0.0.1 (moto in server mode) for tests.

Clients find it the standard way, through `AWS_ENDPOINT_URL` and the `AWS_*` credentials in the
environment: pyarrow's `S3FileSystem` (ours and Ray Train's) and boto3 alike. Those variables
are set when this module is imported, before the session's Ray starts, so that Ray's workers
inherit them as a cloud node's processes would inherit an instance profile's; the server itself
starts only when a test asks for it.

The server runs in this process: `stop()` then `start()` makes the bucket unreachable for a
while and keeps its objects, as a real outage would.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid


def _reserve_port() -> socket.socket:
    """A free port, held by a bound socket until the server takes it (`S3Server.start`):
    the port must be known at import, for the environment, and nothing may take it meanwhile."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    return holder


_port_holder: socket.socket | None = _reserve_port()
PORT = _port_holder.getsockname()[1]
ENDPOINT = f"http://127.0.0.1:{PORT}"
CREDENTIALS = {
    "AWS_ENDPOINT_URL": ENDPOINT,
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups on a machine without one
}


def export_credentials() -> None:
    for key, value in CREDENTIALS.items():
        os.environ.setdefault(key, value)


class S3Server:
    def __init__(self) -> None:
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        global _port_holder
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        if _port_holder is not None:
            _port_holder.close()
            _port_holder = None
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=PORT, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def new_bucket(self, prefix: str = "runs") -> str:
        """A fresh bucket; returns its `s3://` URI."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=ENDPOINT).create_bucket(Bucket=name)
        return f"s3://{name}"

    def keys(self, uri: str) -> list[str]:
        """Every object under `uri` (s3://bucket/prefix), as keys relative to it."""
        import boto3

        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        prefix = f"{prefix.rstrip('/')}/" if prefix else ""
        pages = boto3.client("s3", endpoint_url=ENDPOINT).get_paginator("list_objects_v2")
        return sorted(
            item["Key"][len(prefix) :]
            for page in pages.paginate(Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", [])
        )
