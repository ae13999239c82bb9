"""``kvmesh replay``: a Mooncake trace through an in-process cluster, once per routing policy.

* ``trace``: parsing and checking trace lines (``TraceError`` names the line and field), and
  the prompt tokens a request's block ids stand for (``TokenSource``);
* ``cluster``: the simulated workers (real ``KVCacheManager``s, the ``guaranteed_no_evict``
  schedule, a virtual clock), the real event path into a ``PrefixIndex``, the real
  ``RouterCore``; ``run_policy`` replays one policy (or ``pooled``, the hit-ratio bound);
* ``report``: the figures per policy, the table, the plots;
* ``cli``: the ``kvmesh replay`` subcommand.
"""
