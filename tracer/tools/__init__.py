"""Experiments on a serving stack: ``replay`` (and ``replay_compare``), ``bench`` and
``compare`` (with ``workload`` and ``streamclient``), ``demo`` (the incident, end to end)."""
