"""Simulated parts for demos and tests: an OpenAI-compatible engine and a harness."""
