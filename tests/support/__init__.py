"""Helpers every test package shares: waiting on a condition (``wait``), real ``kvmesh``
processes (``processes``), an app inside its lifespan behind httpx (``asgi``) and the OpenAPI
fuzz strategies (``openapi``). Ports come from ``app.core.net``, as for kvmesh's own processes."""
