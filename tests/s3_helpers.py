"""A local S3-compatible server for the object-store tests: moto's server mode, started on
127.0.0.1 by the test that needs it and stopped by it (nothing else may be running)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specstore.runtime.storage import Location


@dataclass(frozen=True)
class S3:
    endpoint: str
    bucket: str

    @property
    def options(self) -> dict[str, str]:
        """Lance's option names, as ``--storage-option`` takes them."""
        return {"aws_endpoint": self.endpoint, "allow_http": "true", "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing", "aws_region": "us-east-1"}

    def cli(self) -> list[str]:
        return [a for k, v in self.options.items() for a in ("--storage-option", f"{k}={v}")]

    def uri(self, prefix: str | None = None) -> str:
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"


@contextmanager
def s3_server() -> Iterator[S3]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        s3 = S3(f"http://{host}:{port}", "specstore-test")
        import boto3

        client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                              region_name="us-east-1")
        client.create_bucket(Bucket=s3.bucket)
        yield s3
    finally:
        server.stop()


def upload_tree(local_root: Path, location: Location) -> int:
    """Copy a local store's files to ``location`` as they are (what ``aws s3 sync`` does)."""
    count = 0
    for path in sorted(p for p in Path(local_root).rglob("*") if p.is_file()):
        location.upload(path, path.relative_to(local_root).as_posix())
        count += 1
    return count
