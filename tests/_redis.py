"""A Redis server for the store's tests: ``KVREF_REDIS_URL`` when set, else a ``redis-server`` this session starts
on a free port of 127.0.0.1 (no persistence, in a temp dir) and stops at the end.

Import the fixture into a test module (``from _redis import redis_url``). Tests that use it skip, with the reason,
when the redis client package is missing or when there is neither a URL nor a redis-server binary.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

NO_CLIENT = "the redis client package is not installed: pip install 'kvref[store]' (or pip install redis)"
NO_SERVER = "redis-server not installed: apt-get install redis-server, or set KVREF_REDIS_URL"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(exe: str, workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    import redis

    log_path = os.path.join(workdir, "redis.log")
    # the port is free when chosen but another process may take it before redis binds it: try a few
    for _ in range(5):
        port = _free_port()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                client.close()
                return proc, url
            except redis.ConnectionError:
                time.sleep(0.05)
        proc.kill()
        proc.wait()
    with open(log_path) as f:
        pytest.fail(f"redis-server did not start; its log:\n{f.read()}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip(NO_CLIENT)
    url = os.environ.get("KVREF_REDIS_URL")
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(NO_SERVER)
    proc, url = _start(exe, str(tmp_path_factory.mktemp("redis")))
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
