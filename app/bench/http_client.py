"""The least an HTTP/1.1 client can do, as a load generator for the router and worker benches.

httpx spent about 1 ms of CPU per request, as much as the router under test, and on two cores
the client's lag then shows as the router's latency. ``KeepAliveConnection`` writes the
request, reads the status line, the headers and Content-Length bytes, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson

__all__ = ["KeepAliveConnection"]


class KeepAliveConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON to ``path``."""

    def __init__(self, host: str, port: int, path: str = "/route") -> None:
        self.host, self.port = host, port
        self._request_line = b"POST %s HTTP/1.1\r\n" % path.encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> dict[str, Any]:
        """The JSON answer to one POST; ValueError unless it is a 200. After any failure the
        connection is dropped (the next request opens a new one)."""
        try:
            return await self._post(body)
        except BaseException:
            writer, self._writer, self._reader = self._writer, None, None
            if writer is not None:
                writer.close()
            raise

    async def _post(self, body: bytes) -> dict[str, Any]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        self._writer.write(
            self._request_line + b"Host: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (self.host.encode(), len(body)) + body
        )
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        content = await self._reader.readexactly(length)
        if status != 200:
            raise ValueError(f"status {status}: {content[:200]!r}")
        answer: dict[str, Any] = orjson.loads(content)
        return answer

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
