"""Bytes and flows in, typed events out: ``wire`` is the sans-I/O HTTP/1.1 observer
on h11 (the tap's), ``flows`` turns mitmproxy's hook facts into the same events (the
addon's capture process)."""
