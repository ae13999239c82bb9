"""``kvmesh worker``: one GPU's KV cache as an asyncio service.

``settings`` (flags and ``KVMESH_`` variables), ``engine`` (the single writer of the manager,
continuous batching), ``backend`` / ``torch_backend`` (the model step), ``api`` and
``schemas`` (HTTP), ``metrics`` (Prometheus), ``service`` (lifespan, uvicorn, signals).
"""
