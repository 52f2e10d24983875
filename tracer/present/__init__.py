"""Results for people and tools: ``analyze``, ``info`` and ``report`` (commands),
``render`` (text, JSON, Markdown), ``timeline`` (the picture), ``top`` (live view),
``otlp`` (spans)."""
