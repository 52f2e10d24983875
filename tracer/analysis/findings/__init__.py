"""Attribution: whose fault is it — client, proxy or engine — from evidence only.

Theory of operation
-------------------
``find(evidence)`` is a pure function of the analysis rows (requests, connections) and
the evidence timelines (engine samples, probes, health, injected faults, hang marks). It
runs a list of analyzers, each a small function from the evidence to findings, the
shape structlog gives its processors. Every finding (a ``Finding`` record, ``model``)
names:

* ``party``: client | proxy | engine | unknown — *proxy* is any hop between the client
  and the serving stack; *engine* is the serving stack (router, prefill, decode);
* ``kind``: a stable name (documented in ``captures/ANALYSIS.md``);
* ``requests`` / ``connections``: the ids it concerns;
* ``evidence``: ``EvidenceItem`` records — the quoted observation (``text``), the time
  it concerns, the tap and request it was seen at, and the figures it quotes;
* ``ruled_out``: the parties the evidence excludes, each with why (``RuledOut``);
* ``confidence``: high | medium | low; ``settle``: for ``unknown``, the observation that
  would decide it;
* ``note``: true for a finding that is not a fault (load) — it never becomes the verdict.

Rules of evidence: the engine is "idle" only when its own samples say running=0 and
queued=0 *and* its token counters did not move (SGLang's gauges can be 30 s old; the
counters cannot); the engine is "wedged" when something runs and the counters are flat;
"busy" when running/queued are high and counters rise — which is load, reported with the
figures, never as a fault and never as "cold start". A hop is blamed only when the
evidence places the fault there: between two taps (a request seen by one and not the
next), or in front of an idle engine whose fresh connections answer.

The modules, in the order the data flows: ``context`` (one pass over the rows, with
``join`` across taps and ``engine_view`` of the engines' figures), the analyzers
(``hangs``, ``client``, ``endings``, ``delivery``, ``load``), then ``taps`` and
``injected`` over their findings, and ``verdict``, which orders them. ``signs`` and
``quotes`` hold what they share: what a row shows, and how an observation is quoted.
Findings are records until the output edge (``Finding.to_json``, in ``analysis``).
"""

from .context import Context, Evidence
from .engine_view import EngineView
from .join import TIME_JOINED_REPEATS
from .model import EvidenceItem, Finding, RuledOut
from .verdict import find

__all__ = [
    "TIME_JOINED_REPEATS",
    "Context",
    "EngineView",
    "Evidence",
    "EvidenceItem",
    "Finding",
    "RuledOut",
    "find",
]
