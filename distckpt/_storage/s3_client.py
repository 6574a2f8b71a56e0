"""Thin S3 object operations for distckpt (boto3), with errors that name the bucket and key but
never the credentials.

Credentials come from boto3's standard chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
profiles, instance roles); the endpoint from ``endpoint_url`` or ``AWS_ENDPOINT_URL``. Requests
are retried by botocore's ``standard`` mode: throttling (503 ``SlowDown``), 5xx and connection
errors, with exponential backoff and jitter, up to ``MAX_ATTEMPTS`` attempts.

Logs: at DEBUG botocore logs every request with its headers (the access key id is in
``Authorization: ... Credential=<id>/...``). Once this process has a client from
:func:`get_client`, every ``botocore``, ``boto3``, ``s3transfer`` and ``urllib3`` logger carries
a filter that redacts, from each record's message, the ``Authorization`` and
``X-Amz-Security-Token`` header values, ``Credential=`` / ``X-Amz-Credential=`` / ``Signature=`` /
``X-Amz-Signature=`` values, and the literal access key id, secret key and session token of the
credentials boto3 resolved (records only; exception texts are botocore's error messages, which
carry no keys).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from typing import Any, Callable

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.handlers import VALID_BUCKET, VALID_S3_ARN
from typing_extensions import override

from .._errors import ConfigError, StorageError
from .base import LockFile

__all__ = [
    "MAX_ATTEMPTS",
    "TRANSFER",
    "S3LockFile",
    "S3Objects",
    "client_hooks",
    "get_client",
    "reset_clients",
    "split_url",
]

MAX_ATTEMPTS = 5
# Downloads: parallel ranged GETs of 32 MiB above 64 MiB, 8 in flight (docs/object-storage.md
# has the measurements). Uploads stream their own multipart parts (s3_dcp).
TRANSFER = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=32 << 20, max_concurrency=8)
client_hooks: list[Callable[[Any], None]] = []
"""Called with every new client: a seam for tests to register botocore event handlers (fault
injection); empty in production."""

_CRED_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
_clients: dict[tuple[int, str | None, str | None, str], Any] = {}
_clients_lock = threading.Lock()


# Error codes of a request the credentials or the bucket policy do not allow (never retried).
_AUTH_CODES = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")`` (no leading/trailing slash on the key).

    Raises:
        ConfigError: not an ``s3://`` URL, no bucket, or a bucket name S3 clients refuse.
    """
    if url.rstrip("/") == "s3:":  # "s3://" (or its trailing "/" stripped by a caller)
        raise ConfigError("'s3://': no bucket (expected s3://bucket/prefix)")
    if not url.startswith("s3://"):
        raise ConfigError(f"{url!r} is not an s3:// URL")
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"{url!r}: no bucket (expected s3://bucket/prefix)")
    # botocore's own check (a bucket name or an access-point / outpost ARN) raises a bare regex message.
    if not (VALID_BUCKET.search(bucket) or VALID_S3_ARN.search(bucket)):
        raise ConfigError(
            f"{url!r}: {bucket!r} is not a valid bucket name (letters, digits, '.', '-' and '_', at most 255 "
            "characters; AWS itself allows only 3-63 lowercase letters, digits, '.' and '-') nor an S3 "
            "access-point ARN: fix the URL"
        )
    return bucket, key.strip("/")


class _RedactKeys(logging.Filter):
    """Rewrites a record's message with credentials replaced by ``***`` (module docstring, "Logs")."""

    _FIELDS = re.compile(
        r"""('(?:Authorization|X-Amz-Security-Token)': b?['"])[^'"]*"""
        r"""|((?:X-Amz-)?Credential=|(?:X-Amz-)?Signature=|X-Amz-Security-Token=|x-amz-security-token:)"""
        r"""[^\s,&'"]+""",
        re.IGNORECASE,
    )

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: logging reports it itself
            return True
        clean = self._FIELDS.sub(lambda m: (m.group(1) or m.group(2)) + "***", text)
        for secret in self.secrets:
            clean = clean.replace(secret, "***")
        if clean != text:
            record.msg, record.args = clean, None
        return True


_redact = _RedactKeys()
_LOG_ROOTS = ("botocore", "boto3", "s3transfer", "urllib3")
_covered_loggers = -1  # size of logging's logger registry when the filter was last installed


def _protect_logs(session: Any = None) -> None:
    """Install :class:`_RedactKeys` on the S3 stack's loggers (also ones created since the last
    call) and learn ``session``'s resolved credentials."""
    global _covered_loggers
    if session is not None:
        creds = session.get_credentials()
        frozen = creds.get_frozen_credentials() if creds is not None else None
        if frozen is not None:
            _redact.secrets.update(v for v in (frozen.access_key, frozen.secret_key, frozen.token) if v and len(v) >= 4)
    names = logging.Logger.manager.loggerDict
    if session is None and len(names) == _covered_loggers:
        return
    for name in [*_LOG_ROOTS, *list(names)]:
        if name.split(".", 1)[0] in _LOG_ROOTS:
            logger = logging.getLogger(name)
            if _redact not in logger.filters:
                logger.addFilter(_redact)
    _covered_loggers = len(names)


def get_client(endpoint_url: str | None = None, region: str | None = None) -> Any:
    """A boto3 S3 client shared by this process's threads (boto3 clients are thread-safe); from
    the first one on, the S3 stack's log records are redacted (module docstring, "Logs")."""
    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    # Keyed by a digest of the credential variables too (never the values): a changed key gets a new client.
    creds = hashlib.sha256("\0".join(os.environ.get(v, "") for v in _CRED_VARS).encode()).hexdigest()
    key = (os.getpid(), endpoint_url, region, creds)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            config = Config(
                retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"},
                connect_timeout=5,
                read_timeout=60,
                max_pool_connections=32,
                s3={"addressing_style": "path"} if endpoint_url else None,
            )
            session = boto3.session.Session()
            client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
            _protect_logs(session)
            for hook in client_hooks:
                hook(client)
            _clients[key] = client
        else:
            _protect_logs()  # loggers of modules botocore imported since (cheap when none)
    return client


def reset_clients() -> None:
    """Forget this process's clients (the next request makes a new one: new hooks, new settings)."""
    with _clients_lock:
        _clients.clear()


def describe(e: BaseException) -> str:
    """One line for an S3 failure: the error code and message boto reports (no credentials)."""
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        return f"{err.get('Code', '?')}: {err.get('Message') or e}"
    return f"{type(e).__name__}: {e}"


def error_code(e: BaseException) -> str:
    return str(e.response.get("Error", {}).get("Code", "")) if isinstance(e, ClientError) else ""


class S3Objects:
    """Operations on the objects of one bucket; every failure becomes
    :class:`~distckpt._errors.StorageError` (an ``OSError``) naming ``s3://bucket/key``
    (``FileExistsError`` for a failed conditional create).

    Args:
        bucket: the bucket.
        endpoint_url, region: as :func:`get_client`.
    """

    def __init__(self, bucket: str, *, endpoint_url: str | None = None, region: str | None = None) -> None:
        self.bucket, self.endpoint_url, self.region = bucket, endpoint_url, region

    @property
    def client(self) -> Any:
        """This process's boto3 client for the endpoint and region (:func:`get_client`)."""
        return get_client(self.endpoint_url, self.region)

    def url(self, key: str) -> str:
        """``s3://bucket/key`` of ``key``."""
        return f"s3://{self.bucket}/{key}"

    def _fail(self, what: str, key: str, e: BaseException) -> StorageError:
        # botocore retries only transient failures: report the attempts it really made.
        retries = e.response.get("ResponseMetadata", {}).get("RetryAttempts") if isinstance(e, ClientError) else None
        attempts = MAX_ATTEMPTS if retries is None else int(retries) + 1
        hint = ""
        if error_code(e) in _AUTH_CODES:
            hint = (
                "; check the credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (not shown) and the bucket policy"
            )
        return StorageError(f"S3 {what} {self.url(key)} failed after {attempts} attempt(s): {describe(e)}{hint}")

    def put(self, key: str, body: bytes, *, if_absent: bool = False) -> None:
        """PUT one object; with ``if_absent`` a conditional create (``If-None-Match: *``).

        Raises:
            FileExistsError: ``if_absent`` and the object exists.
            StorageError: any other failure (after retries).
        """
        kwargs: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **kwargs)
        except ClientError as e:
            if if_absent and error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise FileExistsError(f"{self.url(key)} already exists (conditional create refused)") from e
            raise self._fail("PUT", key, e) from e
        except BotoCoreError as e:
            raise self._fail("PUT", key, e) from e

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or ``None`` when it does not exist. Raises ``StorageError``."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail("GET", key, e) from e
        except BotoCoreError as e:
            raise self._fail("GET", key, e) from e

    def create_multipart(self, key: str) -> str:
        """Start a multipart upload; returns its id. Raises ``StorageError``."""
        try:
            return str(self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"])
        except (ClientError, BotoCoreError) as e:
            raise self._fail("PUT (multipart start)", key, e) from e

    def upload_part(self, key: str, upload_id: str, number: int, body: bytes | bytearray) -> dict[str, Any]:
        """Upload part ``number`` (1-based); returns ``{"PartNumber", "ETag"}``. Raises ``StorageError``."""
        try:
            etag = self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )["ETag"]
        except (ClientError, BotoCoreError) as e:
            raise self._fail(f"PUT (part {number})", key, e) from e
        return {"PartNumber": number, "ETag": etag}

    def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> None:
        """Make the uploaded parts the object. Raises ``StorageError``."""
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except (ClientError, BotoCoreError) as e:
            raise self._fail("PUT (multipart complete)", key, e) from e

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Discard an unfinished multipart upload (best effort: the server expires it otherwise)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except (ClientError, BotoCoreError):
            pass

    def download(self, key: str, fileobj: Any) -> None:
        """Download into a file object (parallel ranged GETs when large). Raises ``StorageError``
        (``FileNotFoundError`` when absent)."""
        try:
            self.client.download_fileobj(self.bucket, key, fileobj, Config=TRANSFER)
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"{self.url(key)}: no such object") from e
            raise self._fail("GET", key, e) from e
        except Exception as e:  # noqa: BLE001 - botocore / s3transfer failures
            raise self._fail("GET", key, e) from e

    def list_objects(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of every object under ``prefix``. Raises ``StorageError``."""
        out: dict[str, int] = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    out[obj["Key"]] = int(obj["Size"])
        except (ClientError, BotoCoreError) as e:
            raise self._fail("LIST", prefix, e) from e
        return out

    def delete(self, keys: list[str]) -> None:
        """Delete objects (absent ones are fine). Raises ``StorageError``."""
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            try:
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except (ClientError, BotoCoreError) as e:
                raise self._fail("DELETE", batch[0], e) from e

    def delete_prefix(self, prefix: str) -> list[str]:
        """Delete every object under ``prefix`` (ends with ``/``); returns their keys."""
        keys = sorted(self.list_objects(prefix))
        self.delete(keys)
        return keys

    def copy(self, src: str, dst: str) -> None:
        """Copy object ``src`` to ``dst`` in the bucket (server side).

        Raises:
            StorageError: the copy failed (names ``src``).
        """
        try:
            self.client.copy_object(Bucket=self.bucket, Key=dst, CopySource={"Bucket": self.bucket, "Key": src})
        except (ClientError, BotoCoreError) as e:
            raise self._fail("COPY", src, e) from e

    def check_bucket(self, root: str) -> None:
        """Fail early when the bucket is missing or the credentials do not grant access.

        Raises:
            ConfigError: naming the bucket (and the endpoint), never the credentials.
        """
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = error_code(e)
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise ConfigError(
                    f"CheckpointConfig.root={root!r}: bucket {self.bucket!r} does not exist "
                    f"at {self._endpoint()}; create it first"
                ) from None
            if code in _AUTH_CODES:
                raise ConfigError(
                    f"CheckpointConfig.root={root!r}: access to bucket {self.bucket!r} at "
                    f"{self._endpoint()} was denied ({code}): check the credentials in "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (not shown)"
                ) from None
            raise ConfigError(f"CheckpointConfig.root={root!r}: bucket {self.bucket!r}: {describe(e)}") from None
        except BotoCoreError as e:
            raise ConfigError(
                f"CheckpointConfig.root={root!r}: cannot reach S3 for bucket {self.bucket!r} ({type(e).__name__}: {e})"
            ) from None

    def _endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)


class S3LockFile(LockFile):
    """``<prefix>/.lock`` (see :class:`distckpt._storage.base.LockFile`): conditional create."""

    def __init__(self, objects: S3Objects, key: str) -> None:
        self.objects, self.key, self.where = objects, key, objects.url(key)

    @override
    def create_exclusive(self, text: str) -> bool:
        try:
            self.objects.put(self.key, text.encode(), if_absent=True)
        except FileExistsError:
            return False
        return True

    @override
    def read(self) -> str | None:
        data = self.objects.get(self.key)
        return None if data is None else data.decode("utf-8", "replace")

    @override
    def replace(self, text: str) -> None:
        self.objects.put(self.key, text.encode())

    @override
    def remove(self) -> None:
        self.objects.delete([self.key])
