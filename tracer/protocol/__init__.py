"""The wire formats, sans-I/O: ``head`` (HTTP/1.x heads), ``framing`` (HTTP/1.1 body
framing), ``sse`` (server-sent events), ``addresses`` (``HOST:PORT`` and upstream URLs)."""
