"""Fixed faults (no ``--fault-control``) are shown by the admin's ``/faults`` and cannot
be changed; a controlled plan refuses bad specs. The admin's routes in this process."""

from __future__ import annotations

import json

from tracer.faults.plan import parse_fault


def test_fixed_faults_are_shown_and_not_changed() -> None:
    """Without ``--fault-control`` the plan is read-only: the tap's connections do not
    follow requests for faults, so a plan set later could not reach them."""
    from tracer.proxy.admin import AdminServer
    from tracer.proxy.relay import Tap, TapConfig

    config = TapConfig("127.0.0.1", 0, "127.0.0.1", 9, faults=[parse_fault("drop-done")])
    admin = AdminServer(Tap(config), "127.0.0.1", 0)
    status, _, body = admin.route("GET", "/faults")
    assert status == 200 and json.loads(body)["faults"] == ["drop-done"]
    status, _, body = admin.route("PUT", "/faults", b"status:503")
    assert status == 403 and "--fault-control" in json.loads(body)["error"]
    assert admin.route("PATCH", "/faults")[0] == 405
    controlled = AdminServer(
        Tap(TapConfig("127.0.0.1", 0, "127.0.0.1", 9, fault_control=True)), "127.0.0.1", 0
    )
    status, _, body = controlled.route("PUT", "/faults", b'["status:503@every=2", "drop-done"]')
    assert status == 200 and json.loads(body)["faults"] == ["status:503@every=2", "drop-done"]
    status, _, body = controlled.route("POST", "/faults", b"\n# nothing\n")
    assert status == 400 and "no fault spec" in json.loads(body)["error"]
    status, _, body = controlled.route("PUT", "/faults", b'["status:503", 7]')
    assert status == 400 and "list of fault specs" in json.loads(body)["error"]
