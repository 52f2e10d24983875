"""Benchmark of the inline tap against a direct connection and peer proxies (``make bench``).

Run ``python -m bench.run --help``; what is measured and how is in ``bench/README.md``.
"""
