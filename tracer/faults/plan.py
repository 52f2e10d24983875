"""HTTP-aware fault injection, sans-I/O: fault specs, rules, and per-connection decisions.

Theory of operation
-------------------
A TCP-level fault injector (Toxiproxy) cannot say "the third request on a reused
keep-alive connection" or "after the fifth SSE event". This module can, because it
follows both directions of one HTTP/1.1 connection at message level. It has no sockets
and no clocks: the relay feeds it bytes and carries out the ``Action`` values it returns
(``Forward`` to the upstream, ``Deliver`` to the client, ``Hold`` the client-bound
stream for some seconds, ``Cut`` the connection, ``Freeze`` it, ``ArmIdle`` a timer) and
writes an ``Injected`` record for each injection, so that analysis never mistakes an
injected fault for an external one.

* **Specs** (``parse_fault``, ``kinds.py``): ``NAME[:ARG...][@RULE,...]``, e.g.
  ``hang-on-reuse:3``, ``stall-after-events:5:10@path=/v1/chat/*``, ``status:503@every=4``,
  ``drop-request@prob=0.1,seed=7``. ``KINDS`` lists the faults, ``RULE_KEYS`` the rules.
  The spelling (and its errors) is ``spec``'s, the same as the sim engine's faults;
  ``docs/faults.md`` documents both.
* **Plan** (``FaultPlan``, ``decision.py``): the faults of one tap and their counters
  (``every``, ``prob`` with its seeded generator, ``times``), shared by all its connections.
  ``decide`` is called once per request head, in arrival order, and is deterministic for
  a given sequence of requests.
* **Connection** (``ConnectionFaults``, ``connection.py``): client bytes are cut into
  requests (head, then body framing) and each head is decided before any of its bytes is
  forwarded; a request that is not faulted is forwarded byte for byte. Upstream bytes are cut into responses
  (head, body framing with the position of every chunk, SSE event boundaries when a
  fault needs them). Heads are read by ``protocol.head``, bodies walked by
  ``protocol.framing.BodyDecoder`` (the observer's), SSE events split by
  ``protocol.sse.SseSplitter`` (the observer's). A response no fault applies to is
  delivered byte for byte; one with faults goes through a short pipeline of stages
  (``stages.py``), one per fault (``drop-done``, ``stall``/``truncate-after-events``,
  ``buffer-stream``, ``coalesce``, ``delay-first-byte``), each taking and giving
  segments of raw bytes (``segments.py``) annotated with where heads, chunks and events
  end. Of these only ``drop-done`` changes bytes: it removes the ``[DONE]`` event and
  re-frames the chunk that held it, so the body still ends cleanly.

Rules:

1. Faults act on whole messages: a request is faulted from its first byte or not at all;
   response faults cut at event and chunk boundaries.
2. Request faults (``hang-on-reuse``, ``drop-request``, ``half-open``, ``status``) are
   exclusive: the first matching one (in the order given) wins. Response faults all
   apply, combined. ``close-idle-after`` applies to the idle time after a response.
3. What cannot be followed (not HTTP/1.x, a malformed head or framing, a protocol
   switch) turns the connection *blind*: from then on every byte passes unchanged and no
   fault applies to it, as the observer does. A hung connection (a dropped request) is
   the exception: nothing goes upstream any more, and each later request is recorded.
4. Memory is bounded: request and response heads by ``head.MAX_HEAD``, an SSE event by
   ``sse.MAX_EVENT``, a ``buffer-stream`` response by ``stages.BUFFER_LIMIT`` (beyond it
   the stage stops holding).

This module is the fault layer's face: what the relay, the admin API, the CLI and the
mitmproxy addon use is importable from here (``Action`` values from ``actions.py``). It
only re-exports, and none of the modules it imports imports it (no import cycle).
"""

from __future__ import annotations

# the fault layer's names, all importable from here
from ..protocol.head import MAX_HEAD as MAX_HEAD
from .actions import Action as Action
from .actions import ArmIdle as ArmIdle
from .actions import Cut as Cut
from .actions import Deliver as Deliver
from .actions import Forward as Forward
from .actions import Freeze as Freeze
from .actions import Hold as Hold
from .actions import Injected as Injected
from .connection import ConnectionFaults as ConnectionFaults
from .decision import NO_FAULT as NO_FAULT
from .decision import Decision as Decision
from .decision import FaultPlan as FaultPlan
from .decision import request_path as request_path
from .kinds import KINDS as KINDS
from .kinds import RULE_KEYS as RULE_KEYS
from .kinds import Acts as Acts
from .kinds import Close as Close
from .kinds import Fault as Fault
from .kinds import Kind as Kind
from .kinds import Rule as Rule
from .kinds import parse_fault as parse_fault
from .kinds import status_body as status_body
from .kinds import status_response as status_response
from .segments import SseEvents as SseEvents
from .spec import FaultSpecError as FaultSpecError  # (re-exported: callers catch it)
from .stages import BUFFER_LIMIT as BUFFER_LIMIT
