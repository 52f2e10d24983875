"""Fault injection (opt-in): ``spec`` reads the one grammar
(``NAME[:ARG...][@RULE,...]``) for the tap, the mitmproxy addon and the simulated
engine; ``plan`` is the tap's fault layer (what a connection's bytes become, sans-I/O),
and every name of it is importable from there: ``kinds`` (the tap's faults and
``parse_fault``), ``plan`` itself (``FaultPlan``: which faults a request gets),
``connection`` (``ConnectionFaults``), ``actions`` (what the relay is asked to do),
``segments`` and ``stages`` (a response's bytes, and its faults at work)."""
