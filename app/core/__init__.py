"""What every kvmesh service stands on, and nothing service-specific: the settings base
(``settings``), the HTTP layer (``http``: orjson bodies, OpenAI's error shape, the admin token,
the error handlers; ``middleware``: the body limit), the API's error tree (``errors``), the
start-up check of a Redis URL's credentials (``redis``) and the private ``redis-server`` of
demos, benches and tests (``embedded_redis``). It imports no other part of ``app``."""
