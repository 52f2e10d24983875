"""The wire formats, sans-I/O: ``framing`` (HTTP/1.1 body framing), ``sse``
(server-sent events), ``addresses`` (``HOST:PORT`` and upstream URLs)."""
