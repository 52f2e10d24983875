"""The scenario matrix in one table: each case's whole expect.json (verdict, forbidden
and required kinds, no fault finding contradicting the verdict, the connections named).

    .venv/bin/python -m tests.scenarios.matrix
    TRACER_PURE_PYTHON=1 PYTHONPATH=<a worktree of another commit> .venv/bin/python tests/scenarios/matrix.py

(the second reads these scenarios with another commit's analysis: before and after).
"""

import json
import pathlib
from fnmatch import fnmatch

import tracer
from tracer.analysis.summary import Summary
from tracer.capture.files import read_into
from tracer.evidence.engine_requests import read_engine_requests
from tracer.times import parse_time

root = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "scenarios"
print("# tracer from", tracer.__file__)
for case in sorted(root.glob("*/expect.json")):
    d = case.parent
    exp = json.loads(case.read_text())
    with Summary() as s:
        for n in exp["captures"]:
            read_into(d / n, s.feed)
        marks = [parse_time(t, s.first_t, s.last_t) for t in exp.get("hang_at", [])]
        records = [
            x for n in exp.get("engine_requests", []) for x in read_engine_requests(d / n).records
        ]
        r = s.result(hang_at=marks, engine_requests=records)
        v = r["verdict"]
        fs = r["findings"]
        want = exp["verdict"]
        kinds = want["kind"] if isinstance(want["kind"], list) else [want["kind"]]
        bad = []
        if not (v["party"] == want["party"] and v["kind"] in kinds):
            bad.append("verdict")
        for pat in exp["forbidden"]:
            if [f for f in fs if fnmatch(f["kind"], pat)]:
                bad.append(f"forbidden {pat}")
        for need in exp["required"]:
            if not [
                f
                for f in fs
                if f["party"] == need["party"]
                and f["kind"] == need["kind"]
                and bool(f.get("note")) == bool(need.get("note"))
            ]:
                bad.append(f"missing {need['kind']}")
        if exp["no_faults"] and [f for f in fs if not f.get("note")]:
            bad.append("faults")
        top = next((f for f in fs if f["id"] == v.get("finding")), None)
        if (
            top
        ):  # contradictions: a fault finding sharing a request that rules out the verdict's party
            mine = set(top["requests"])
            for f in fs:
                if f is top or f.get("note"):
                    continue
                if mine & set(f["requests"]) and any(
                    x["party"] == top["party"] for x in f["ruled_out"]
                ):
                    bad.append(f"contradicted by {f['kind']}")
            for c in exp.get("idle_connections", []):
                if c not in top["connections"]:
                    bad.append(f"names not {c}")
        print(
            f"{d.name:38} {'ok ' if not bad else 'BAD'} {v['party']}/{v['kind']}/{v['confidence']}"
            + (f"  [{'; '.join(bad)}]" if bad else "")
        )
