"""``app.core.http_protocol``: what is written in one event-loop iteration leaves in one write,
a whole answer leaves at once, a close sends what is pending first, an abort drops it (a real
worker answers through it in ``test_worker_process``)."""

from __future__ import annotations

import asyncio
from typing import Any

from app.core.http_protocol import _JoiningTransport


class _Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.calls.append(bytes(data))

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def abort(self) -> None:
        self.calls.append("abort")
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def test_writes_of_one_iteration_leave_in_one_write() -> None:
    recorder = _Recorder()
    joined = _JoiningTransport(recorder, asyncio.get_running_loop())
    joined.write(b"HTTP/1.1 200 OK\r\n\r\n")
    joined.write(b"body")
    assert recorder.calls == []
    await asyncio.sleep(0)
    assert recorder.calls == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    joined.writelines([b"a", bytearray(b"b")])
    await asyncio.sleep(0)
    joined.write(b"c")
    joined.close()
    await asyncio.sleep(0)
    assert recorder.calls == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"ab", b"c", "close"]
    assert joined.get_extra_info("peername") == ("127.0.0.1", 1)


async def test_an_abort_drops_what_is_pending() -> None:
    recorder = _Recorder()
    joined = _JoiningTransport(recorder, asyncio.get_running_loop())
    joined.write(b"never sent")
    joined.abort()
    await asyncio.sleep(0)
    assert recorder.calls == ["abort"]


async def test_a_whole_answer_leaves_at_once_unless_something_waits_before_it() -> None:
    recorder = _Recorder()
    joined = _JoiningTransport(recorder, asyncio.get_running_loop())
    joined.write_whole(b"HTTP/1.1 200 OK\r\n\r\none")
    assert recorder.calls == [b"HTTP/1.1 200 OK\r\n\r\none"]  # no loop iteration needed
    joined.write(b"HTTP/1.1 200 OK\r\n\r\n")
    joined.write_whole(b"two")  # after the head still pending, in the same write
    assert recorder.calls == [b"HTTP/1.1 200 OK\r\n\r\none"]
    await asyncio.sleep(0)
    assert recorder.calls == [b"HTTP/1.1 200 OK\r\n\r\none", b"HTTP/1.1 200 OK\r\n\r\ntwo"]
    joined.close()
    joined.write_whole(b"late")  # a closed transport takes nothing
    assert recorder.calls[-1] == "close"
