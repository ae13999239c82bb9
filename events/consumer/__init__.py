"""``EventConsumer``: every worker's stream, read back into one ``PrefixIndex`` (asyncio).

How a router uses it::

    config = ConsumerConfig(step_budget_s=0.005)     # every setting, with documented defaults
    async with EventConsumer(redis_url, config, index=index, on_entry=hook) as consumer:
        ...                                          # the index fills in the background
        consumer.workers(), consumer.last_seq("w3"), consumer.stats(), await consumer.lag()

One task does everything, in a loop, so the index has a single writer:

1. every ``registry_interval_s``: read the registry (``kvmesh:workers``) and follow new
   workers, forget unregistered ones; check Redis's ``run_id`` (a changed id is a restart
   that lost every stream: resynchronise every worker, and hold it while it registers again);
2. every ``liveness_interval_s``: read each worker's heartbeat key; a worker whose heartbeat
   expired leaves the index until it beats again; one that stays behind the event id its
   heartbeat reports is marked stale (``WorkerState.stale = "behind_heartbeat"``);
3. resynchronise the workers that need it: forget the worker, replay its snapshot in slices of
   ``step_budget_s``, read its stream again after the snapshot;
4. one blocking ``XREAD`` over the streams of every synchronised worker, and apply what it
   returns, giving the event loop back whenever ``step_budget_s`` (10 ms) has passed.

The parts, one concept each (each module's docstring has the rules it keeps)::

    config.py    ConsumerConfig: every setting, its default and its check
    loop.py      EventConsumer: the task and its rounds (1-4 above), the XREADs, lifecycle,
                 queries (workers, last_seq, lag) and stats
    registry.py  Registry: the followed workers, Redis's run_id, the hold after a restart
    liveness.py  Liveness: heartbeats, expiry, behind_heartbeat
    resync.py    Resyncer: when to resynchronise, snapshot loading and requests, suspects
    apply.py     Applier: each entry checked against what was applied, then applied or
                 skipped; EntryHook
    state.py     WorkerState (per worker) and Counters (in all): the records the parts share

The parts are plain objects built by ``EventConsumer`` and called only from its task (and
``check_run_id``, which a router awaits on the same event loop, and which writes no index);
none starts a task of its own.

Errors: whatever a stream entry or a snapshot holds is caught as ``events.errors.EventsError``
(an ``EnvelopeError``, a ``SnapshotError``, an ``InvalidEventError`` from the index), counted
and skipped. Connection errors: log, back off, retry (``events.redis_io.Backoff``); on
reconnection the ``run_id`` check decides whether everything must be resynchronised.

Stats: ``stats()`` (counters, and ``apply_lag_ms``: age of the last entry applied, by its stream
id's timestamp) and ``await lag()`` (per worker: entries not read yet, and the age of the oldest).
"""

from events.consumer.apply import EntryHook
from events.consumer.config import ConsumerConfig
from events.consumer.loop import EventConsumer
from events.consumer.state import WorkerState

__all__ = ["ConsumerConfig", "EntryHook", "EventConsumer", "WorkerState"]
