"""Developer tools run from a checkout (``python tools/NAME.py``), not installed with kvmesh:
the mypyc build of cache/ and the HTTP API reference of docs/api.md."""
