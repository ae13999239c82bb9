"""``app.core.serving``: a service served by ``serve`` in its own process has settled its heap
once started, and exits 0 when asked to stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import httpx

from app.core.net import free_port
from tests.support.processes import wait_ready

_SERVICE = textwrap.dedent(
    """
    import gc, sys
    from fastapi import FastAPI
    from app.core.serving import serve

    app = FastAPI()

    @app.get("/ready")
    def ready() -> dict:
        return {"frozen": gc.get_freeze_count(), "threshold": list(gc.get_threshold())}

    serve(app, "127.0.0.1", int(sys.argv[1]), "warning")
    """
)


def test_a_started_service_has_frozen_its_start_up_heap() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", _SERVICE, str(port)]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            wait_ready(base, proc)
            state = httpx.get(f"{base}/ready").json()
            # The imports alone (FastAPI, pydantic, uvicorn) are tens of thousands of objects;
            # without the freeze the count is 0.
            assert state["frozen"] > 20_000
            assert state["threshold"] == [20_000, 10, 10]
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
