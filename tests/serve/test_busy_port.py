"""``kvrunner serve`` on a port another process holds: one line naming the address,
exit status 1, before the model is loaded (a model that cannot load is never
reached)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from serve_kit import server_env


def test_a_busy_port_is_named_before_the_model_loads(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "kvrunner.cli.main", "serve", "--port", str(port),
             "--model", str(tmp_path / "no-such-checkpoint")],
            capture_output=True, text=True, timeout=120, env=server_env(tmp_path))
        took = time.monotonic() - started
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0], lines[0]
    assert "no-such-checkpoint" not in done.stderr  # the model was never looked at
    assert "listening on" not in done.stdout
    assert took < 60, took
