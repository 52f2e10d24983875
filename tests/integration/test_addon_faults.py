"""The mitmproxy fault addon (addons/faults.py) beside the trace addon and its capture
process (a real process). Hook by hook alone: tests/unit; mitmdump: tests/e2e."""

from __future__ import annotations

import warnings
from pathlib import Path

from tests.support.addon import fault_flow, faults, trace
from tracer.capture.files import read_records

with warnings.catch_warnings():  # mitmproxy.master imports ldap3, which warns on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from mitmproxy.test import taddons, tflow


def test_faults_set_anew_while_mitmproxy_runs(tmp_path: Path) -> None:
    """``tracer_faults`` set again (mitmproxy's ``set`` command, mitmweb's options): the
    plan changes from the next request on, flows already decided keep their faults,
    positions on open connections go on counting, and the capture gets ``fault_plan``."""
    tracer = trace.TraceAddon()
    addon = faults.TracerFaults()
    capture = tmp_path / "cap.jsonl"
    with taddons.context(tracer, addon) as tctx:
        tctx.configure(tracer, tracer_capture=str(capture))
        tctx.configure(addon, tracer_faults=["status:503@pos=1"])
        one = tflow.tclient_conn()
        first, held = fault_flow(one), fault_flow(one)
        addon.requestheaders(first)
        addon.requestheaders(held)  # decided under the first plan: not faulted
        tctx.configure(addon, tracer_faults=["hang-on-reuse:2", "hang-on-reuse:3"])
        addon.request(first)
        addon.request(held)
        assert first.response is not None and first.response.status_code == 503
        assert not held.intercepted
        third = fault_flow(one)  # request 3 on the connection: the new plan's
        addon.requestheaders(third)
        addon.request(third)
        assert third.intercepted
        tctx.configure(addon, tracer_faults=[])
        fourth = fault_flow(one)
        addon.requestheaders(fourth)
        addon.request(fourth)
        assert not fourth.intercepted
        tracer.done()
    plans = [(r["change"], r["faults"]) for r in read_records(capture) if r["type"] == "fault_plan"]
    assert plans == [
        ("replace", ["status:503@pos=1"]),
        ("replace", ["hang-on-reuse:2", "hang-on-reuse:3"]),
        ("clear", []),
    ]
