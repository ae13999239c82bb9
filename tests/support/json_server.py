"""A real HTTP server on a free loopback port, in a thread, that answers every ``POST`` with
JSON: what to answer is the test's (``answer(path, body) -> (status, JSON)``), and every request
is recorded as ``(path, body)``. Stand-in for an engine's HTTP API (a TensorRT-LLM server's
``/kv_cache_events``, an OpenAI-compatible server)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

__all__ = ["Answer", "JsonServer"]

Answer = Callable[[str, Any], tuple[int, Any]]


class JsonServer:
    """See the module docstring. ``running()`` serves until the block ends."""

    def __init__(self, answer: Answer) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                body = json.loads(raw) if raw else None
                with server.lock:
                    server.requests.append((self.path, body))
                    status, reply = answer(self.path, body)
                payload = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @contextlib.contextmanager
    def running(self) -> Iterator[Self]:
        thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        thread.start()
        try:
            yield self
        finally:
            self.httpd.shutdown()
            self.httpd.server_close()
            thread.join(timeout=5)
