"""Captures in, answers out: the connection and request rows (``summary``, ``rows``,
``spill`` for big captures) and ``findings/`` (who is at fault, with evidence). Reads
events only: no sockets, no clocks."""
