"""The admin endpoint over the wire: a cross-origin POST changes no fault (issue 24).
Its routes in this process: tests/unit/test_admin_guard.py."""

from __future__ import annotations

import anyio
import httpx
import pytest

from tracer.proxy.admin import AdminServer
from tracer.proxy.relay import Tap, TapConfig


@pytest.mark.anyio
async def test_a_cross_origin_post_changes_no_fault_over_the_wire() -> None:
    """What a web page can send (text/plain, an Origin, no token) is refused on a real
    socket, and the plan stays empty."""
    admin = AdminServer(
        Tap(TapConfig("127.0.0.1", 0, "127.0.0.1", 9, fault_control=True)), "127.0.0.1", 0
    )
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(admin.serve)
        url = f"http://{host}:{port}/faults"
        async with httpx.AsyncClient() as client:
            page = {"origin": "http://evil.example", "content-type": "text/plain"}
            r = await client.post(url, content=b"status:503", headers=page)
            assert r.status_code in (401, 403)
            r = await client.get(url, headers={"host": f"rebound.example:{port}"})
            assert r.status_code == 421
            assert (await client.get(url)).json()["faults"] == []
            auth = {"authorization": f"Bearer {admin.token}"}
            r = await client.post(url, json=["status:503"], headers=auth)
            assert r.status_code == 200 and r.json()["faults"] == ["status:503"]
        tg.cancel_scope.cancel()
