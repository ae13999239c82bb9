"""The live dashboard: what it aggregates (``state``) and how it is served (``api``), on the
router at ``/dashboard`` or on its own with ``kvmesh dashboard``."""
