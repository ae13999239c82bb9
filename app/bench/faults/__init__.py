"""``kvmesh bench faults``: kvmesh under faults and load, with real processes; the figures of
``docs/reliability.md``.

Each scenario is a function (one module each) that sets its cluster up, injects its fault,
measures and tears everything down; ``tests/app/test_bench_faults.py`` runs them once, through
``kvmesh bench faults --quick --json`` (``QUICK``: small numbers), and
asserts their outcomes exactly, ``run`` with larger numbers and prints them. Every scenario has
its own private ``redis-server`` (``EmbeddedRedis``; never ``$REDIS_URL``: a shared Redis would
bring other workers into the routers' view).

* ``kill_worker_under_load``: ``kvmesh router`` and N sim ``kvmesh worker`` processes, an
  open-loop client (``/v1/completions``, a share streaming); one worker is killed with SIGKILL
  mid-run. Measured: when the router's ``/workers`` stops listing it as routable and when
  ``/index/stats`` no longer holds its blocks (both from the kill), what became of the requests
  in flight at the kill (completed elsewhere after a retry, or failed with a clear status:
  a 502 in OpenAI's error shape, or an error event ending the stream), that no request was sent
  to it afterwards and that none hung.
* ``redis_restart_under_load``: the same cluster plus an in-process observer (a second router's
  ``RouterRuntime``, whose index can be read exactly); Redis is killed, stays away
  ``outage_s``, and comes back *empty* while the client keeps sending. Measured: requests
  completed/rejected/failed during the run, the time from the restart until the routing router
  is ready with every worker up and the observer has every worker synchronised again
  (``recovered_s``), and, once the load has stopped, that the observer's index equals every
  worker's reuse tree (``GET /blocks``: hash and tier) exactly and the routing router's
  ``/index/stats`` has the same block counts per worker and tier.
* ``router_restart``: W publishers (a child process, one ``EventPublisher`` per worker, as in
  ``kvmesh bench router``) publish B synthetic stored blocks each (random 64-bit hashes, chains
  of 64 blocks from the root, every fourth chain on the host tier), then stay alive. A
  ``kvmesh router`` starts cold (snapshots taken at the publishers' start, so the index is
  rebuilt from the streams); then every publisher writes a fresh snapshot (as a worker does
  when a consumer asks for one), the router is killed with SIGKILL and started again (rebuilt
  from the snapshots, the stream entries they cover skipped). Time to ready: from the process'
  start until ``/ready`` answers 200 and ``/index/stats`` holds every worker's blocks per tier.
  Last, an in-process ``RouterRuntime`` is started the same way and its index compared, block
  by block and tier by tier, with what was published.
* ``publisher_cut_off``: one publisher's Redis user is switched off (``ACL SETUSER ... off``
  and its connections killed: Redis keeps its data, the other clients carry on) while it keeps
  publishing, until its buffer (``max_buffer_blocks``) overflows; then it is switched on again.
  What it holds is what it published, so its snapshot covers the dropped events. Measured: the
  events dropped, that the stream's ``dropped`` counts add up to them (the count reaches the
  consumer), that an in-process router resynchronised that worker once for it, and that its
  index then equals what was published, exactly. ``tests/events/test_publisher_consumer.py``
  (``test_drop_path_snapshot_and_resync_while_redis_refuses_the_worker``) checks the same path
  with a real ``KVCacheManager`` and a bare consumer.
* ``load``: ``kvmesh router`` and 4 workers, R requests at a stated rate (open loop), a share
  streaming; the RSS (``VmRSS`` of ``/proc/<pid>/status``) of every process sampled every
  100 ms. Every request must complete or be rejected with a clear status; latency p50/p99 of
  the completed ones, from their due time.
* ``publishers_into_consumer``: 8 ``EventPublisher`` at full speed (batches pre-recorded from
  real ``KVCacheManager`` workloads: ``app.bench.events.record``) into one ``EventConsumer`` in
  its own process, which samples its RSS every 50 ms. Lag: for each entry applied, the time
  from the ``publish()`` of its oldest batch to its events being in the index.

Outcomes of a request (``Outcome.kind``): ``completed`` (200 with choices, or a stream ending
in ``[DONE]``), ``rejected`` (429 or 503 in OpenAI's error shape: try again later), ``failed``
(502 in that shape, or a stream ending in an error event: the client is told), ``unclear``
(anything else: a timeout, a dropped connection, a 500, a stream cut without a word). Only
``unclear`` is a defect.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from app.bench.faults.client import Outcome, summarize
from app.bench.faults.cut_off import publisher_cut_off
from app.bench.faults.harness import counts_of, rss_kib
from app.bench.faults.kill_worker import kill_worker_under_load
from app.bench.faults.load import load
from app.bench.faults.publishers import publishers_into_consumer
from app.bench.faults.redis_restart import redis_restart_under_load
from app.bench.faults.router_restart import router_restart
from app.bench.faults.synthetic import synthetic_events, synthetic_tree

__all__ = [
    "FULL",
    "QUICK",
    "SCENARIOS",
    "Outcome",
    "counts_of",
    "kill_worker_under_load",
    "load",
    "publisher_cut_off",
    "publishers_into_consumer",
    "redis_restart_under_load",
    "router_restart",
    "rss_kib",
    "run",
    "summarize",
    "synthetic_events",
    "synthetic_tree",
]

# -- the whole run -----------------------------------------------------------------------------

FULL: dict[str, dict[str, Any]] = {
    "kill_worker": {"num_workers": 4, "num_requests": 1_000, "rate": 50.0},
    "redis_restart": {"num_workers": 4, "num_requests": 1_000, "rate": 50.0, "outage_s": 1.0},
    "router_restart": {"num_workers": 8, "num_blocks": 100_000},
    "publisher_cut_off": {"num_blocks": 20_000, "buffer_blocks": 1_024},
    "load": {"num_requests": 5_000, "rate": 100.0},
    "publishers": {"num_publishers": 8, "requests_per_worker": 150},
}
QUICK: dict[str, dict[str, Any]] = {
    # What tests/app/test_bench_faults.py asserts exactly, each scenario run once.
    "kill_worker": {"num_workers": 3, "num_requests": 150, "rate": 50.0},
    # 1,000 requests in 5 s; Redis killed 1.5 s in, away 0.5 s, back empty. A 6 s TTL makes
    # the workers beat once a second: the registry stays empty for up to a second after the
    # restart, long enough that a router forgetting them would answer 503.
    "redis_restart": {
        "num_workers": 3,
        "num_requests": 1_000,
        "rate": 200.0,
        "outage_s": 0.5,
        "heartbeat_ttl_s": 6.0,
    },
    "router_restart": {"num_workers": 4, "num_blocks": 5_000},
    "publisher_cut_off": {"num_blocks": 2_048, "buffer_blocks": 256},
    "load": {"num_requests": 200, "rate": 100.0},
    "publishers": {"num_publishers": 8, "requests_per_worker": 10},
}
SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "kill_worker": kill_worker_under_load,
    "redis_restart": redis_restart_under_load,
    "router_restart": router_restart,
    "publisher_cut_off": publisher_cut_off,
    "load": load,
    "publishers": publishers_into_consumer,
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if getattr(args, "quick", False) else FULL
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    httpx_logger = logging.getLogger("httpx")
    httpx_level = httpx_logger.level
    httpx_logger.setLevel(logging.WARNING)  # not a log line per request and per poll
    try:
        for name, scenario in SCENARIOS.items():
            start = time.monotonic()
            out[name] = scenario(**sizes[name])
            out[name]["scenario_s"] = round(time.monotonic() - start, 1)
    finally:
        httpx_logger.setLevel(httpx_level)
    return out
