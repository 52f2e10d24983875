"""tracer: a traffic-layer diagnostic proxy and connection tracer for LLM serving."""

__version__ = "0.1.0"
