"""The router process: an ``EventConsumer`` filling a ``PrefixIndex``, a ``RouterCore`` deciding,
an HTTP client proxying, and the loop that keeps the core's view of the workers current.

``RouterRuntime.start(settings)`` builds everything (nothing at import time; a Redis that
refuses the URL's credentials stops it, see ``app.core.redis``) and starts two tasks on the
event loop:

* the consumer (``events.consumer``): every registered worker's stream into the index; it gives
  the loop back every ``step_budget_ms`` so that requests never wait long behind it;
* the sync loop: every ``sync_interval_s`` it copies the consumer's view (registered, alive,
  synchronised) into the core; every ``load_interval_s`` it reads each worker's load hash,
  heartbeat TTL and stream tail in one pipeline. A worker is routed to only while its heartbeat
  key exists; when the sync loop finds one gone it asks the consumer to check at once, and the
  worker leaves the core and the index when the consumer expires it (within about 0.2 s). The
  consumer decides, not the sync loop, because Redis also loses every heartbeat when it
  restarts empty: the consumer then holds each worker for its heartbeat TTL, and the router
  keeps routing to them while they register again, instead of answering 503 "no worker is up".

Every load tick also reads the operators' cordons (``app.router.fleet``, one hash for the
fleet): a cordoned or draining worker takes no new request from any router.

A worker's data is *stale* (reported in ``/workers``, ``/ready``, metrics and every decision,
never silently used as fresh) when the consumer is resynchronising it, when the entries it has
not read yet are older than ``max_lag_ms``, when its heartbeat is late (under a third of its TTL
left), when its heartbeat reports an event id the consumer has not applied within 2 s
(``behind_heartbeat``), when it has published no load, or while Redis does not answer (the
router then routes on what it last knew).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from redis.asyncio import Redis

from app.core.errors import NotFound, Unavailable
from app.core.http import uvicorn_config
from app.core.redis import RedisCredentialsError, check_credentials
from app.dashboard.api import FrameHub
from app.dashboard.state import DashboardState
from app.router.core import RouterCore
from app.router.fleet import Cordon, CordonState, clear_cordon, parse_cordons, set_cordon
from app.router.metrics import RouterMetrics
from app.router.settings import RouterSettings
from events import keys
from events.consumer import EventConsumer, WorkerState
from events.index import PrefixIndex
from events.redis_io import REDIS_ERRORS, raise_if_cancelled, redis_client

__all__ = [
    "RouterRuntime",
    "WorkerStatus",
    "create_app",
    "serve",
]

logger = logging.getLogger(__name__)

_DEFAULT_TOKENS_PER_BLOCK = 16


@dataclass(slots=True)
class WorkerStatus:
    """What the sync loop last read about one worker, beyond what the core keeps."""

    lag_ms: float = 0.0
    heartbeat_age_s: float | None = None
    heartbeat_ttl_s: float | None = None
    has_load: bool = False
    tokens_per_block: int | None = None


class RouterRuntime:
    """Everything one router process owns; see the module docstring."""

    def __init__(self, settings: RouterSettings, redis: Redis, *, routing: bool = True) -> None:
        self.settings = settings
        self.redis = redis
        self.index = PrefixIndex()
        # A standalone dashboard (routing=False) follows the streams the same way, read-only.
        self.source = "router" if routing else "dashboard"
        self.dashboard = DashboardState(record_decisions=routing)
        self.consumer = EventConsumer(
            redis,
            index=self.index,
            step_budget_s=settings.step_budget_ms / 1000,
            on_entry=self.dashboard.on_entry,
        )
        self.core = RouterCore(
            self.index,
            tokens_per_block=settings.tokens_per_block or _DEFAULT_TOKENS_PER_BLOCK,
            policy=settings.policy,
            weights=settings.weights(),
            seed=settings.seed,
            predict_ttl_s=settings.predict_ttl_s,
        )
        self.tokens_per_block_known = settings.tokens_per_block is not None
        self.status: dict[str, WorkerStatus] = {}
        self.incompatible: dict[str, str] = {}  # worker -> why it is not routed to
        self.cordons: dict[str, Cordon] = {}  # as last read from Redis (app.router.fleet)
        self.num_bad_cordons = 0  # entries of the cordons hash that did not parse
        self._cordon_writes = 0  # this router's own cordon writes (a read sent before one is old)
        self._cordon_restarts = 0  # the consumer's Redis restarts when the cordons were read
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.proxy_timeout_s, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=1_024, max_keepalive_connections=256),
        )
        self.tokenizer: Any = None
        self.synced_once = False
        self.redis_ok = False
        self.started_at = time.time()
        self._next_load_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self.num_sync_errors = 0
        self.metrics = RouterMetrics(self)
        self.hub = FrameHub(self)

    @classmethod
    async def start(cls, settings: RouterSettings, *, routing: bool = True) -> RouterRuntime:
        if settings.redis_url is None:
            raise ValueError("redis_url: the router reads the workers' streams; give their Redis")
        redis = redis_client(settings.redis_url, socket_timeout=5.0)
        try:
            await check_credentials(redis, "router" if routing else "dashboard")
        except RedisCredentialsError:
            await redis.aclose()
            raise
        runtime = cls(settings, redis, routing=routing)
        if settings.tokenizer is not None:
            from tokenizers import Tokenizer

            runtime.tokenizer = Tokenizer.from_file(settings.tokenizer)
        await runtime.consumer.start()
        runtime._task = asyncio.create_task(runtime._run_sync(), name="kvmesh-router-sync")
        runtime.hub.start()
        logger.info("%s: started", runtime.source)
        return runtime

    async def aclose(self) -> None:
        await self.hub.aclose()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.consumer.aclose()
        await self.http.aclose()
        await self.redis.aclose()

    # -- the sync loop -------------------------------------------------------------------------

    async def _run_sync(self) -> None:
        while True:
            try:
                await self.sync_once()
                self.redis_ok = True
            except REDIS_ERRORS as exc:
                self.num_sync_errors += 1
                if self.redis_ok:
                    logger.warning("router: Redis read failed: %s", exc)
                self.redis_ok = False
                # Routing goes on with the last index and loads, said to be stale.
                for worker in self.core.workers:
                    self.core.set_stale(worker, "redis_unreachable")
            except Exception:
                self.num_sync_errors += 1
                logger.exception("router: sync error")
            # redis-py may swallow the cancellation of aclose() mid-command (or turn it into a
            # connection error): without this check the loop would never stop.
            raise_if_cancelled()
            await asyncio.sleep(self.settings.sync_interval_s)

    async def sync_once(self) -> None:
        """Bring the core's workers in line with the consumer's (and, when due, the loads)."""
        now = time.monotonic()
        if now >= self._next_load_at:
            await self._read_loads()
            self._next_load_at = now + self.settings.load_interval_s
        self._apply_view()
        self.synced_once = True

    def _apply_view(self) -> None:
        core = self.core
        states = self.consumer.workers()
        for worker in list(core.workers):
            state = states.get(worker)
            if state is None or not state.alive:
                core.remove_worker(worker)
        for worker in list(self.status):
            if worker not in states:
                del self.status[worker]
                self.incompatible.pop(worker, None)
        for worker, state in states.items():
            if not state.alive:
                continue
            status = self.status.setdefault(worker, WorkerStatus())
            info = state.info
            if not self._compatible(worker, info, status):
                core.remove_worker(worker)
                continue
            capacity = info.get("capacity") or [0]
            cordon = self.cordons.get(worker)
            view = core.upsert_worker(
                worker,
                url=info.get("url"),
                capacity_blocks=int(capacity[0]) if capacity else 0,
                draining=bool(info.get("draining")),
                cordon=cordon.state if cordon is not None else None,
            )
            core.set_stale(worker, self._stale_reason(state, status))
            if not view.url:
                core.set_stale(worker, "no_url")

    def _compatible(self, worker: str, info: dict[str, Any], status: WorkerStatus) -> bool:
        tpb = info.get("tokens_per_block")
        status.tokens_per_block = tpb if isinstance(tpb, int) else None
        if status.tokens_per_block is None:
            self.incompatible[worker] = "its registry entry has no tokens_per_block"
            return False
        if not self.tokens_per_block_known:
            self.core.tokens_per_block = status.tokens_per_block
            self.tokens_per_block_known = True
            logger.info("router: hashing prompts in blocks of %d tokens", status.tokens_per_block)
        if status.tokens_per_block != self.core.tokens_per_block:
            self.incompatible[worker] = (
                f"tokens_per_block {status.tokens_per_block}, the router hashes "
                f"{self.core.tokens_per_block}"
            )
            return False
        self.incompatible.pop(worker, None)
        return True

    def _stale_reason(self, state: WorkerState, status: WorkerStatus) -> str | None:
        if not state.synced:
            return "resyncing"
        if state.stale is not None:  # its heartbeat reports events this index has not got
            return state.stale
        if status.lag_ms > self.settings.max_lag_ms:
            return "lagging"
        if (
            status.heartbeat_age_s is not None
            and status.heartbeat_ttl_s
            and status.heartbeat_age_s > status.heartbeat_ttl_s * 2 / 3
        ):
            return "heartbeat_late"
        if not status.has_load:
            return "no_load"
        return None

    async def _read_loads(self) -> None:
        states = [s for s in self.consumer.workers().values() if s.alive]
        writes = self._cordon_writes
        async with self.redis.pipeline(transaction=False) as pipe:
            # Always at least this: redis_ok (and /ready) is true only when Redis answers.
            pipe.hgetall(keys.CORDONS_KEY)
            for state in states:
                pipe.hgetall(keys.load_key(state.worker))
                pipe.pttl(keys.alive_key(state.worker))
                pipe.xinfo_stream(state.key)
            cordons_raw, *replies = await pipe.execute(raise_on_error=False)
        if writes == self._cordon_writes:  # else this read predates our own write: skip it
            await self._set_cordons(cordons_raw)
        now_ms = time.time() * 1000
        behind: list[WorkerState] = []
        for i, state in enumerate(states):
            load_raw, pttl, info = replies[3 * i : 3 * i + 3]
            status = self.status.setdefault(state.worker, WorkerStatus())
            ttl_s = state.info.get("heartbeat_ttl_s")
            status.heartbeat_ttl_s = float(ttl_s) if isinstance(ttl_s, int | float) else None
            if isinstance(pttl, int) and pttl >= 0 and status.heartbeat_ttl_s:
                status.heartbeat_age_s = max(status.heartbeat_ttl_s - pttl / 1000, 0.0)
            elif isinstance(pttl, int) and pttl == -2 and state.held_until <= time.monotonic():
                # Expired, or lost by a Redis restart: the consumer tells which, now.
                self.consumer.check_liveness_soon()
                status.heartbeat_age_s = None
            load = _parse_load(load_raw)
            status.has_load = bool(load)
            if load:
                self.core.set_load(state.worker, load)
            last_id = info.get("last-generated-id") if isinstance(info, dict) else None
            status.lag_ms = 0.0
            if last_id is not None and _id_key(last_id) > _id_key(state.pos):
                behind.append(state)
        if behind:
            # The age of the oldest entry not read yet is the index's lag for that worker.
            async with self.redis.pipeline(transaction=False) as pipe:
                for state in behind:
                    pipe.xrange(state.key, min=f"({_id_text(state.pos)}", max="+", count=1)
                firsts = await pipe.execute(raise_on_error=False)
            for state, first in zip(behind, firsts, strict=True):
                if isinstance(first, list) and first:
                    age = now_ms - _id_key(first[0][0])[0]
                    self.status[state.worker].lag_ms = max(age, 0.0)

    async def _set_cordons(self, raw: Any) -> None:
        if isinstance(raw, Exception):  # not a hash (WRONGTYPE): keep what was last read
            if not self.num_bad_cordons:
                logger.warning("router: cannot read %s: %s", keys.CORDONS_KEY, raw)
            self.num_bad_cordons = 1
            return
        cordons, bad = parse_cordons(raw)
        if bad and bad != self.num_bad_cordons:
            logger.warning("router: %d malformed entries in %s skipped", bad, keys.CORDONS_KEY)
        self.num_bad_cordons = bad
        lost = {w: c for w, c in self.cordons.items() if w not in cordons}
        if lost:
            # Gone because someone lifted them, or because Redis restarted empty (it needs no
            # persistence): then they are written back, so that no router puts a cordoned
            # worker back in rotation. HSETNX: a newer word from another router wins.
            await self.consumer.check_run_id()
            if self.consumer.num_redis_restarts != self._cordon_restarts:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for worker, cordon in lost.items():
                        pipe.hsetnx(keys.CORDONS_KEY, worker, json.dumps(cordon.as_dict()))
                    await pipe.execute()
                logger.warning(
                    "router: Redis restarted; wrote back the cordons of %s", ", ".join(sorted(lost))
                )
                cordons.update(lost)
        self._cordon_restarts = self.consumer.num_redis_restarts
        self.cordons = cordons

    def apply_cordon(self, worker: str, cordon: Cordon | None) -> None:
        """What this router's admin API just wrote, applied now, not at the next load tick."""
        self._cordon_writes += 1
        if cordon is None:
            self.cordons.pop(worker, None)
        else:
            self.cordons[worker] = cordon
        self._apply_view()

    # -- fleet admin (app.router.fleet) --------------------------------------------------------

    async def cordon(self, worker: str, state: CordonState) -> dict[str, Any]:
        """Cordon (no new requests) or drain (cordon, then the worker's own ``POST /drain``)
        ``worker`` for every router; its ``/workers`` entry, with the worker's answer."""
        self._check_known(worker)
        try:
            cordon = await set_cordon(self.redis, worker, state)
        except REDIS_ERRORS as exc:
            raise self._not_recorded(exc) from None
        self.apply_cordon(worker, cordon)
        entry = self.worker_entry(worker)
        if state == "draining":
            entry["worker_answer"] = await self._ask_worker(worker, "/drain")
        return entry

    async def uncordon(self, worker: str) -> dict[str, Any]:
        """Back in rotation; a worker that drains is asked to admit again (``/resume``): the
        cordon said so, or the worker's registry entry does (a drain that a cordon replaced,
        or that another router's cordons know of before this one's)."""
        self._check_known(worker)
        state = self.consumer.workers().get(worker)
        previous = self.cordons.get(worker)
        draining = (previous is not None and previous.state == "draining") or (
            state is not None and bool(state.info.get("draining"))
        )
        try:
            await clear_cordon(self.redis, worker)
        except REDIS_ERRORS as exc:
            raise self._not_recorded(exc) from None
        self.apply_cordon(worker, None)
        entry = self.worker_entry(worker)
        if draining:
            entry["worker_answer"] = await self._ask_worker(worker, "/resume")
        return entry

    def _check_known(self, worker: str) -> None:
        if worker not in self.consumer.workers() and worker not in self.cordons:
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
        state = self.consumer.workers().get(worker)
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

    def worker_entry(self, worker: str) -> dict[str, Any]:
        """``worker``'s entry of ``GET /workers`` (a cordoned worker no longer registered:
        state ``gone``, with its cordon)."""
        for entry in self.workers_report():
            if entry["worker"] == worker:
                return entry
        return {"worker": worker, "state": "gone", "cordon": self.cordon_report(worker)}

    def cordon_report(self, worker: str) -> dict[str, Any] | None:
        """An operator's cordon of ``worker`` as ``/workers`` shows it: for a drain, what is
        still in flight there (the worker's own count and this router's) and whether it is
        done (nothing left)."""
        cordon = self.cordons.get(worker)
        if cordon is None:
            return None
        out = cordon.as_dict()
        if cordon.state == "draining":
            view = self.core.workers.get(worker)
            load = view.load if view is not None else {}
            reported = load.get("running_requests", load.get("active_sequences", 0))
            waiting = load.get("waiting_requests", 0)
            routed = view.inflight_running if view is not None else 0
            out["in_flight"] = {"running": reported, "waiting": waiting, "this_router": routed}
            out["done"] = view is not None and reported + waiting + routed == 0
        return out

    # -- queries -------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def workers_report(self) -> list[dict[str, Any]]:
        """Every followed worker: the core's view, the consumer's, and the sync loop's."""
        out: list[dict[str, Any]] = []
        per_worker = self.index.stats()["per_worker"]
        states = self.consumer.workers()
        for worker in sorted(states):
            state = states[worker]
            view = self.core.workers.get(worker)
            status = self.status.get(worker, WorkerStatus())
            entry: dict[str, Any] = (
                view.as_dict()
                if view is not None
                else {"worker": worker, "url": state.info.get("url"), "state": "gone"}
            )
            if worker in self.incompatible:
                entry["state"] = "incompatible"
                entry["stale_reason"] = self.incompatible[worker]
            tiers = per_worker.get(worker, {"gpu": 0, "host": 0})
            entry.update(
                alive=state.alive,
                synced=state.synced,
                epoch=state.epoch,
                last_seq=state.last_seq,
                lag_ms=round(status.lag_ms, 3),
                heartbeat_age_s=status.heartbeat_age_s,
                blocks={"gpu": tiers["gpu"], "host": tiers["host"]},
                predicted_blocks=self.core.num_predicted(worker),
                cordon=self.cordon_report(worker),
            )
            out.append(entry)
        return out

    def readiness(self) -> dict[str, Any]:
        """Ready when Redis answers, the workers are known, at least one is up and fresh, and
        every alive worker's stream has been caught up with (loaded from its snapshot)."""
        states = self.consumer.workers()
        catching_up = sorted(w for w, s in states.items() if s.alive and not s.synced)
        stale = {w: v.stale_reason for w, v in self.core.workers.items() if v.stale_reason}
        fresh = sorted(w for w, v in self.core.workers.items() if v.state == "up")
        reasons: list[str] = []
        if not self.redis_ok:
            reasons.append("redis is not answering")
        if not self.synced_once:
            reasons.append("the worker registry has not been read yet")
        if not fresh:
            reasons.append("no worker is up with fresh data")
        if catching_up:
            reasons.append(f"catching up with {', '.join(catching_up)}")
        return {
            "ready": not reasons,
            "reasons": reasons,
            "workers_up": fresh,
            "stale": stale,
            "catching_up": catching_up,
        }


def _parse_load(raw: Any) -> dict[str, int]:
    if not isinstance(raw, dict):
        return {}
    load: dict[str, int] = {}
    for name, value in raw.items():
        try:
            load[name.decode() if isinstance(name, bytes) else str(name)] = int(value)
        except (TypeError, ValueError):
            continue
    return load


def _id_text(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _id_text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def create_app(settings: RouterSettings, *, routing: bool = True) -> FastAPI:
    """The router's app; with ``routing=False`` the standalone dashboard (``kvmesh dashboard``):
    the same view of the cluster, read-only, without the routing endpoints."""
    from app.dashboard.api import install as install_dashboard
    from app.router.api import install

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        runtime = await RouterRuntime.start(settings, routing=routing)
        app.state.runtime = runtime
        try:
            yield {"runtime": runtime}
        finally:
            await runtime.aclose()

    app = FastAPI(
        title="kvmesh router" if routing else "kvmesh dashboard",
        summary="Cache-aware, load-aware placement of LLM requests across kvmesh workers"
        if routing
        else "A live view of the cluster's KV cache and its events (read-only)",
        lifespan=lifespan,
    )
    install(app, settings, routing=routing)
    install_dashboard(app)
    return app


def serve(settings: RouterSettings, *, routing: bool = True) -> None:
    """Run the router (or the standalone dashboard) until SIGTERM/SIGINT (blocking)."""
    app = create_app(settings, routing=routing)
    config = uvicorn_config(app, settings.host, settings.port, settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    _Server(config).run()


class _Server(uvicorn.Server):
    """uvicorn, exiting with status 0 on SIGTERM/SIGINT (it re-raises the signal otherwise)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
