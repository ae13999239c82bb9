"""The cluster as Redis tells it: what the router and the dashboard both read, and neither owns.

``ClusterView`` (``view``) follows every registered worker: its registry entry, heartbeat, load,
stream position and blocks (an ``EventConsumer`` filling a ``PrefixIndex``), and the operators'
cordons (``fleet``), and keeps one ``Member`` (``members``) per worker with what a reader needs:
its URL, capacity, load, whether its data is fresh and, if not, why. ``ClusterMetrics``
(``metrics``) exports it. It imports ``app.core``, ``events`` and ``cache``, never a service.
"""
