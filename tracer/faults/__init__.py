"""Fault injection (opt-in): ``spec`` reads the one grammar
(``NAME[:ARG...][@RULE,...]``) for the tap, the mitmproxy addon and the simulated
engine; ``plan`` decides, sans-I/O, what a connection's bytes become."""
