"""The cache-aware router: pure policies (``policy``), the routing state (``core``), and the
service around them (``service``, ``api``)."""
