"""``RouterRuntime``: everything one router process owns, and its lifecycle. No FastAPI here.

``RouterRuntime.start(settings)`` builds (nothing at import time; a Redis that refuses the URL's
credentials stops it, see ``app.core.redis``): a ``ClusterView`` (``app.cluster``: every worker
as Redis tells it, kept current by its consumer and sync tasks), a ``RouterCore`` deciding on
the view's index, the HTTP client that proxies to workers, and each model's tokenizer for its
text and chat prompts (``--model NAME=DIR``; ``--tokenizer`` for the models it does not name).
After each of the view's sync rounds the runtime copies its members into the core
(``_apply_view``): URL, capacity, load, draining, an operator's cordon, and why the data is
stale if it is. A worker registered with another block size than the router hashes with is not
routed to (``incompatible`` in ``GET /workers``).

Every decision is passed to the ``decision_hooks`` (the dashboard's, where one is attached).
Fleet admin (``cordon``, ``uncordon``) writes through the view, so every router honours it, and
asks the worker itself to drain or resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from app.chat import ModelTokenizer
from app.cluster.fleet import CordonState
from app.cluster.view import ClusterView, ViewConfig
from app.core.errors import BadRequest, NotFound, Unavailable
from app.router.core import RouterCore
from app.router.metrics import RouterMetrics
from app.router.policies import Decision
from app.router.settings import RouterSettings
from app.router.share import DecisionShare, default_router_id
from app.router.upstream import HttpxUpstream, Upstream, WorkerClient
from events.consumer import EventConsumer
from events.index import PrefixIndex
from events.redis_io import REDIS_ERRORS, redis_client

__all__ = ["DecisionHook", "RouterRuntime"]

logger = logging.getLogger(__name__)

_DEFAULT_TOKENS_PER_BLOCK = 16

# (request id, kind: "route" or "completion", the decision, prompt tokens, block hashes)
DecisionHook = Callable[[str, str, Decision, int, Sequence[int]], None]


def view_config(settings: RouterSettings) -> ViewConfig:
    return ViewConfig(
        load_interval_s=settings.load_interval_s,
        sync_interval_s=settings.sync_interval_s,
        max_lag_ms=settings.max_lag_ms,
        step_budget_s=settings.step_budget_ms / 1000,
        read_interval_s=settings.event_read_interval_ms / 1000,
    )


class RouterRuntime:
    """Everything one router process owns; see the module docstring."""

    def __init__(self, settings: RouterSettings, view: ClusterView) -> None:
        self.settings = settings
        self.view = view
        self.core = RouterCore(
            view.index,
            tokens_per_block=settings.tokens_per_block or _DEFAULT_TOKENS_PER_BLOCK,
            policy=settings.policy,
            weights=settings.weights(),
            seed=settings.seed,
            predict_ttl_s=settings.predict_ttl_s,
            approx_ttl_s=settings.approx_ttl_s,
        )
        self.tokens_per_block_known = settings.tokens_per_block is not None
        self.incompatible: dict[str, str] = {}  # worker -> why it is not routed to
        self.decision_hooks: list[DecisionHook] = []
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.proxy_timeout_s, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=1_024, max_keepalive_connections=256),
        )
        # The proxy's hop to the workers (``self.http`` for other schemes than http).
        self.upstream: Upstream = WorkerClient(
            connect_timeout_s=settings.connect_timeout_s,
            read_timeout_s=settings.proxy_timeout_s,
            fallback=HttpxUpstream(self.http),
        )
        self.share: DecisionShare | None = None  # --share-decisions: the other routers' flights
        self.tokenizers: dict[str, ModelTokenizer] = {}  # --model NAME=DIR
        self.default_tokenizer: ModelTokenizer | None = None  # --tokenizer
        self.started_at = time.time()
        self.metrics = RouterMetrics(self.core, view)
        view.sync_hooks.append(self._apply_view)

    @classmethod
    async def start(cls, settings: RouterSettings) -> RouterRuntime:
        if settings.redis_url is None:
            raise ValueError("redis_url: the router reads the workers' streams; give their Redis")
        view = await ClusterView.connect(settings.redis_url, view_config(settings), name="router")
        runtime = cls(settings, view)
        for name, path in settings.model_paths().items():
            runtime.tokenizers[name] = await asyncio.to_thread(ModelTokenizer.load, path)
        if settings.tokenizer is not None:
            runtime.default_tokenizer = await asyncio.to_thread(
                ModelTokenizer.load, settings.tokenizer
            )
        if settings.share_decisions:
            share_redis = redis_client(settings.redis_url, socket_timeout=5.0)
            runtime.share = DecisionShare(
                share_redis,
                settings.router_id or default_router_id(),
                runtime.core,
                max_flight_s=settings.proxy_timeout_s,
            )
            await runtime.share.start()
        await view.start()
        logger.info("router: started")
        return runtime

    async def aclose(self) -> None:
        if self.share is not None:
            await self.share.aclose()
            await self.share.redis.aclose()
        await self.view.aclose()
        await self.upstream.aclose()
        await self.http.aclose()

    # What readers of the runtime reach most (the view's own).
    @property
    def index(self) -> PrefixIndex:
        return self.view.index

    @property
    def consumer(self) -> EventConsumer:
        return self.view.consumer

    # -- the view into the core ----------------------------------------------------------------

    def _apply_view(self) -> None:
        core = self.core
        members = self.view.members
        for worker in list(core.workers):
            if worker not in members:
                if url := core.workers[worker].url:
                    self.upstream.forget(url)  # its kept connections too
                core.remove_worker(worker)
        for worker in list(self.incompatible):
            if worker not in self.view.consumer.workers():
                del self.incompatible[worker]
        for worker, member in members.items():
            if not self._compatible(worker, member.tokens_per_block):
                core.remove_worker(worker)
                continue
            model = member.info.get("model")
            view = core.upsert_worker(
                worker,
                url=member.url,
                model=model if isinstance(model, str) and model else None,
                foreign=bool(member.info.get("source")),
                approximate=member.approximate,
                capacity_blocks=member.capacity_blocks,
                draining=member.draining,
                cordon=member.cordon.state if member.cordon is not None else None,
            )
            if member.load and view.load is not member.load:
                core.set_load(worker, member.load)
            core.set_stale(worker, member.stale_reason)

    def _compatible(self, worker: str, tokens_per_block: int | None) -> bool:
        if tokens_per_block is None:
            self.incompatible[worker] = (
                "its registry entry has no tokens_per_block (a positive integer)"
            )
            return False
        if not self.tokens_per_block_known:
            self.core.tokens_per_block = tokens_per_block
            self.tokens_per_block_known = True
            logger.info("router: hashing prompts in blocks of %d tokens", tokens_per_block)
        if tokens_per_block != self.core.tokens_per_block:
            self.incompatible[worker] = (
                f"tokens_per_block {tokens_per_block}, the router hashes "
                f"{self.core.tokens_per_block}"
            )
            return False
        self.incompatible.pop(worker, None)
        return True

    # -- decisions -----------------------------------------------------------------------------

    def on_decision(
        self,
        request_id: str,
        kind: str,
        decision: Decision,
        num_tokens: int,
        block_hashes: Sequence[int],
    ) -> None:
        for hook in self.decision_hooks:
            hook(request_id, kind, decision, num_tokens, block_hashes)

    def tokenizer_for(self, model: str | None) -> ModelTokenizer | None:
        """The tokenizer of ``model``'s prompts: its own (``--model``), else ``--tokenizer``'s;
        a request naming no model uses the only ``--model`` there is, if one."""
        if model is not None and model in self.tokenizers:
            return self.tokenizers[model]
        if model is None and self.default_tokenizer is None and len(self.tokenizers) == 1:
            return next(iter(self.tokenizers.values()))
        return self.default_tokenizer

    def resolve_model(self, name: str | None) -> str | None:
        """The model a request is for: the one it names (NotFound, in OpenAI's words, when no
        worker serves it), or when it names none the only one served (None: any worker)."""
        core = self.core
        if name is None:
            named = core.named_models()
            if len(named) > 1:
                raise BadRequest(
                    f"model: this router serves several models ({', '.join(named)}); name one",
                    param="model",
                )
            return named[0] if named else None
        if core.workers and not core.serves(name):
            raise NotFound(
                f"The model `{name}` does not exist (no worker serves it; GET /v1/models lists "
                "those that are served).",
                param="model",
                code="model_not_found",
            )
        return name

    # -- fleet admin ---------------------------------------------------------------------------

    async def cordon(self, worker: str, state: CordonState) -> dict[str, Any]:
        """Cordon (no new requests) or drain (cordon, then the worker's own ``POST /drain``)
        ``worker`` for every router; its ``/workers`` entry, with the worker's answer."""
        self._check_known(worker)
        try:
            await self.view.cordon(worker, state)
        except REDIS_ERRORS as exc:
            raise self._not_recorded(exc) from None
        entry = self.worker_entry(worker)
        if state == "draining":
            entry["worker_answer"] = await self._ask_worker(worker, "/drain")
        return entry

    async def uncordon(self, worker: str) -> dict[str, Any]:
        """Back in rotation; a worker that drains is asked to admit again (``/resume``): the
        cordon said so, or the worker's registry entry does (a drain that a cordon replaced,
        or that another router's cordons know of before this one's)."""
        self._check_known(worker)
        state = self.view.consumer.workers().get(worker)
        previous = self.view.cordons.get(worker)
        draining = (previous is not None and previous.state == "draining") or (
            state is not None and bool(state.info.get("draining"))
        )
        try:
            await self.view.uncordon(worker)
        except REDIS_ERRORS as exc:
            raise self._not_recorded(exc) from None
        entry = self.worker_entry(worker)
        if draining:
            entry["worker_answer"] = await self._ask_worker(worker, "/resume")
        return entry

    def _check_known(self, worker: str) -> None:
        if not self.view.follows(worker):
            raise NotFound(
                f"no worker {worker!r}: GET /workers lists the workers this router follows",
                param="worker_id",
            )

    def _not_recorded(self, exc: BaseException) -> Unavailable:
        return Unavailable(
            f"Redis is not answering, nothing was recorded: {exc}",
            retry_after_s=self.settings.retry_after_s,
        )

    async def _ask_worker(self, worker: str, path: str) -> dict[str, Any]:
        """``POST path`` to the worker with this router's admin token (a fleet shares one);
        what it answered, or why it did not. An engine behind ``kvmesh ingest`` has no such
        route (404): the cordon still keeps every router's requests away."""
        state = self.view.consumer.workers().get(worker)
        url = state.info.get("url") if state is not None else None
        if not isinstance(url, str) or not url:
            return {"error": "the worker registered no URL"}
        token = self.settings.admin_token
        headers = {"authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        try:
            answer = await self.http.post(f"{url}{path}", headers=headers, timeout=5.0)
        except httpx.HTTPError as exc:
            return {"error": f"{type(exc).__name__} from {url}{path}"}
        try:
            body: Any = answer.json()
        except ValueError:
            body = answer.text[:300]
        return {"status": answer.status_code, "body": body}

    # -- reports -------------------------------------------------------------------------------

    def cordon_report(self, worker: str) -> dict[str, Any] | None:
        view = self.core.workers.get(worker)
        routed = view.inflight_running if view is not None else 0
        return self.view.cordon_report(worker, routed=routed)

    def worker_entry(self, worker: str) -> dict[str, Any]:
        """``worker``'s entry of ``GET /workers`` (a cordoned worker no longer registered:
        state ``gone``, with its cordon)."""
        for entry in self.workers_report():
            if entry["worker"] == worker:
                return entry
        return {"worker": worker, "state": "gone", "cordon": self.cordon_report(worker)}

    def workers_report(self) -> list[dict[str, Any]]:
        """Every followed worker: the core's view, the stream's and the sync loop's."""
        out: list[dict[str, Any]] = []
        states = self.view.consumer.workers()
        for worker, stream in self.view.stream_reports().items():
            view = self.core.workers.get(worker)
            entry: dict[str, Any] = (
                view.as_dict()
                if view is not None
                else {"worker": worker, "url": states[worker].info.get("url"), "state": "gone"}
            )
            if worker in self.incompatible:
                entry["state"] = "incompatible"
                entry["stale_reason"] = self.incompatible[worker]
            entry.update(
                stream,
                predicted_blocks=self.core.num_predicted(worker),
                cordon=self.cordon_report(worker),
            )
            out.append(entry)
        return out

    def readiness(self) -> dict[str, Any]:
        """``GET /ready``: the view's checks, on the workers this router may route to."""
        stale = {w: v.stale_reason for w, v in self.core.workers.items() if v.stale_reason}
        fresh = sorted(w for w, v in self.core.workers.items() if v.state == "up")
        return self.view.readiness(fresh, stale)
