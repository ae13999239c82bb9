"""How a service's FastAPI app owns its runtime: started by the app's lifespan, kept on
``app.state.runtime`` for the routes (``runtime_of``, their dependency), closed when it ends.
Extensions are started with the runtime and stopped before it (the router's dashboard)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request

__all__ = ["Closable", "runtime_lifespan", "runtime_of"]


class Closable(Protocol):
    async def aclose(self) -> None: ...


R = TypeVar("R", bound=Closable)
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[dict[str, Any]]]


def runtime_lifespan(
    start: Callable[[], Awaitable[R]],
    extensions: Sequence[Callable[[FastAPI, R], AbstractAsyncContextManager[None]]] = (),
) -> Lifespan:
    """A lifespan that starts the runtime (``start()``), then each extension; and stops them in
    the reverse order."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        runtime = await start()
        app.state.runtime = runtime
        try:
            async with contextlib.AsyncExitStack() as stack:
                for extension in extensions:
                    await stack.enter_async_context(extension(app, runtime))
                yield {"runtime": runtime}
        finally:
            await runtime.aclose()

    return lifespan


async def runtime_of(request: Request) -> Any:
    """The app's runtime, for ``Annotated[XRuntime, Depends(runtime_of)]``. A coroutine: a plain
    function dependency would run in the thread pool, a thread hop per request."""
    return request.app.state.runtime
