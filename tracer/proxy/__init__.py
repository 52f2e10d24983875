"""The inline tap: ``relay`` (accept, connect upstream, forward first, observe after),
``admin`` (/metrics, /status, /mark, /faults), ``inject`` (x-request-id, opt-in)."""
