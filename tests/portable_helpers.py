"""Beam's portable path on this machine: the Python job service and an EXTERNAL worker pool,
each a subprocess on 127.0.0.1 started by the test that needs them and stopped by it. The pool
starts workers with the ``python`` first on PATH, so this virtualenv's bin goes first."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def portable_services(log_dir: Path) -> Iterator[list[str]]:
    """Yield the Beam options that send a pipeline to a local job service with EXTERNAL workers."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}
    job_port, pool_port = free_port(), free_port()
    procs = []
    try:
        for args, port, name in (
            (["-m", "apache_beam.runners.portability.local_job_service_main", "--port", str(job_port)], job_port, "job"),
            (["-m", "apache_beam.runners.worker.worker_pool_main", "--service_port", str(pool_port)], pool_port, "pool"),
        ):
            log = open(log_dir / f"{name}.log", "w")
            proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            procs.append(proc)
            _wait_port(port, proc, 120)
        yield ["--runner", "PortableRunner", f"--job_endpoint=localhost:{job_port}", "--environment_type=EXTERNAL",
               f"--environment_config=localhost:{pool_port}"]
    finally:
        for proc in reversed(procs):
            _stop(proc)
