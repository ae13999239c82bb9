"""``kvmesh demo``: the whole system on one machine with a built-in workload (``runner``)."""
