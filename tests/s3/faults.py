"""S3 faults injected at the HTTP layer of distckpt's own boto3 clients: a botocore
``before-send`` handler answers chosen requests with an S3 error instead of sending them,
so botocore's retry logic and distckpt's error paths see exactly what a real server's error
would give (the real server cannot be told to throttle or fail one request)."""

from __future__ import annotations

from typing import Any, Callable

from botocore.awsrequest import AWSResponse


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **kw: Any):
        yield self.body


def _error_response(request: Any, status: int, code: str) -> AWSResponse:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected {code}</Message></Error>'
    ).encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


class Fault:
    """Answer requests of ``operations`` whose URL contains ``url_part`` with ``status``/``code``
    (the first ``times`` of them; ``None``: all). ``hits`` counts the injected answers and
    ``seen`` every matching request (injected or sent)."""

    def __init__(
        self, operations: tuple[str, ...], url_part: str, status: int, code: str, times: int | None = None
    ) -> None:
        self.operations, self.url_part, self.status, self.code, self.times = operations, url_part, status, code, times
        self.hits = 0
        self.seen = 0

    def handler(self, request: Any, **kw: Any) -> AWSResponse | None:
        if self.url_part not in request.url:
            return None
        self.seen += 1
        if self.times is not None and self.hits >= self.times:
            return None
        self.hits += 1
        return _error_response(request, self.status, self.code)

    def install(self) -> "Fault":
        """Apply to every distckpt S3 client made from now on in this process."""
        from distckpt._storage import s3_client

        def hook(client: Any) -> None:
            for op in self.operations:
                client.meta.events.register(f"before-send.s3.{op}", self.handler)

        s3_client.client_hooks.append(hook)
        s3_client.reset_clients()
        return self


def uninstall_all() -> None:
    from distckpt._storage import s3_client

    s3_client.client_hooks.clear()
    s3_client.reset_clients()


PUTS = ("PutObject", "UploadPart", "CreateMultipartUpload")
GETS = ("GetObject",)
Predicate = Callable[[Any], bool]
