"""`tracer report` on real captures: the Markdown, the JSON, the picture, and a person's view.

The captures are made by real processes: the multi-round harness (openai SDK) -> tap
"front" (engine metrics, probes) -> a proxy that hangs on the 3rd request of a reused
keep-alive connection (`tracer proxy --fault hang-on-reuse:3`) -> tap "back" -> the
simulated engine. `tracer report` runs as a subprocess; the picture is checked by its
SVG ids, by the lane bands in its PNG, and in a headless Chromium screenshot of the
rendered Markdown.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from PIL import Image

from tests.support.engine import engine_running
from tests.support.incident import taps_around_a_hanging_proxy
from tests.support.procs import tracer_proxy
from tests.support.shared import made_once
from tracer.analysis.summary import RequestRow, Summary
from tracer.capture.files import read_events
from tracer.cli.commands import main
from tracer.present.timeline import LANE_COLOUR
from tracer.sim.harness import HarnessConfig, run_harness

CHROMIUM = Path("/usr/bin/chromium")


LANE_RGB = tuple(int(LANE_COLOUR[i : i + 2], 16) for i in (1, 3, 5))


@dataclass
class Incident:
    front: Path
    back: Path
    front_upstream: str  # the hanging proxy, as tap "front" saw it
    hung: int  # harness rounds that hung


async def _hang_on_reuse(tmp: Path) -> Incident:
    front, back = tmp / "front.jsonl", tmp / "back.jsonl"
    async with engine_running(ttft=0.0, itl=0.002) as sim:
        evidence = ["--engine-metrics", f"{sim.url}/metrics", "--metrics-interval", "0.2"]
        async with taps_around_a_hanging_proxy(sim.url, front, back, evidence) as (
            front_url,
            faulty_url,
        ):
            report = await run_harness(
                HarnessConfig(
                    base_url=front_url,
                    sessions=2,
                    rounds=4,
                    think=0.2,
                    max_tokens=6,
                    deadline=2.5,
                )
            )
    hung = sum(1 for r in report.rounds if r.outcome == "hung")
    return Incident(front=front, back=back, front_upstream=faulty_url, hung=hung)


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Incident:
    """One real incident for the run (made once: it takes a few seconds)."""

    def make(folder: Path) -> dict[str, Any]:
        made = anyio.run(_hang_on_reuse, folder)
        return {**asdict(made), "front": str(made.front), "back": str(made.back)}

    fields = made_once(tmp_path_factory, "report-incident", make)
    made = Incident(**{**fields, "front": Path(fields["front"]), "back": Path(fields["back"])})
    assert made.hung == 2, "each session's 3rd round must hang behind the faulty proxy"
    return made


def report(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracer", "report", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def svg_ids(svg: Path) -> Counter[str]:
    """How many drawn elements carry each gid prefix (``lane``, ``req``, ``stall`` ...)."""
    ids = [el.get("id", "") for el in ET.parse(svg).iter()]
    return Counter(i.split("-", 1)[0] for i in ids if "-" in i)


def lane_bands(png: Path, min_pixels: int = 40) -> int:
    """The lane bands in a picture: runs of pixel rows showing the lane background colour."""
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    near = (np.abs(pixels - np.array(LANE_RGB)) <= 3).all(axis=2)
    rows = near.sum(axis=1) >= min_pixels
    return int(np.count_nonzero(rows[1:] & ~rows[:-1]) + rows[0])


def section(md: str, title: str) -> str:
    start = md.index(f"## {title}\n")
    end = md.find("\n## ", start + 1)
    return md[start : end if end != -1 else len(md)]


@dataclass
class Made:
    """The report of the incident, made once by a real `tracer report` process."""

    dir: Path
    md: str
    doc: dict[str, Any]
    hung: list[RequestRow]  # the requests that hung, as tap "front" saw them
    mark: float  # the --hang-at given
    stderr: str


@pytest.fixture(scope="module")
def made(incident: Incident, tmp_path_factory: pytest.TempPathFactory) -> Made:
    summary = Summary()
    for event in read_events(incident.front):
        summary.feed(event)
    hung = sorted((r for r in summary.requests.values() if r.seq == 3), key=lambda r: r.start)
    assert len(hung) == 2, summary.requests
    mark = hung[0].start + 1.0  # the harness was seen hung a second into the hang
    out = tmp_path_factory.mktemp("report")
    done = report(
        incident.front,
        incident.back,
        "-o",
        out / "incident.md",
        "--json",
        out / "incident.json",
        "--hang-at",
        f"{mark:.3f}",
    )
    assert done.returncode == 0, done.stderr
    return Made(
        dir=out,
        md=(out / "incident.md").read_text(),
        doc=json.loads((out / "incident.json").read_text()),
        hung=hung,
        mark=mark,
        stderr=done.stderr,
    )


def test_report_of_a_hang_on_reuse_behind_a_proxy(
    incident: Incident, made: Made, tmp_path: Path
) -> None:
    md, doc, hung, mark = made.md, made.doc, made.hung, made.mark
    assert "verdict proxy — proxy_hung_on_reuse" in made.stderr
    assert doc["schema"] == "tracer.report/2"

    # the verdict first: party, kind, one sentence of why
    v = doc["verdict"]
    lines = md.splitlines()
    assert lines[0] == "# Incident report: proxy — proxy_hung_on_reuse"
    assert lines[2].startswith("**Verdict: proxy — `proxy_hung_on_reuse`** (high confidence")
    assert lines[2].endswith(v["summary"])
    # the hop between tap front and tap back, on a reused connection, the engine idle
    items = v["evidence"]
    assert all(set(e) == {"text", "t", "tap", "request", "figures"} for e in items)
    assert [e for e in items if e["figures"].get("never_seen_at") == ["back"]]
    assert [e for e in items if e["tap"] == "front" and e["figures"].get("seq") == 3
            and e["figures"]["reused"] and e["figures"]["idle_before"] > 0]  # fmt: skip
    assert [e for e in items if (e["figures"].get("running_max"), e["figures"].get("queued_max"),
            e["figures"].get("progress")) == (0, 0, 0)]  # fmt: skip
    assert {r["party"] for r in v["ruled_out"]} == {"client", "engine"}
    # ruled out, with the evidence quoted with its times
    ruled = section(md, "Ruled out, and by which evidence")
    for r in v["ruled_out"]:
        assert f"- **{r['party']}** ruled out: " in ruled
    origin = doc["overview"]["time_range"]["start"]

    def offsets(text: str) -> str:  # each epoch time quoted as seconds from the start
        return re.sub(r"\bt=(\d+\.\d+)", lambda m: f"{float(m[1]) - origin:+.3f} s", text)

    assert all(offsets(f"- {e['text']}") in ruled for e in items), ruled
    # a request's time as its evidence quotes it (t=, to the ms), then from the start
    assert any(offsets(f"t={r.start:.3f}") in ruled for r in hung), ruled
    assert "t=17" not in ruled  # no epoch times in the text

    # the picture, linked, and written beside the report
    assert "![timeline](incident-timeline.svg)" in md
    assert "[PNG](incident-timeline.png)" in md
    svg, png = made.dir / "incident-timeline.svg", made.dir / "incident-timeline.png"
    conns = doc["overview"]["totals"]["connections"]
    requests = doc["overview"]["totals"]["requests"]
    ids = svg_ids(svg)
    assert ids["lane"] == conns == doc["timeline"]["lanes"]
    assert ids["req"] == requests
    assert ids["stall"] == doc["overview"]["totals"]["stalls"] >= 2  # the two hung requests
    assert ids["hang"] == 1
    assert ids["finding"] == len(doc["findings"])
    assert {"engine-running", "engine-queued", "engine-tokens"} <= {
        el.get("id") for el in ET.parse(svg).iter()
    }
    assert lane_bands(png) == conns

    # the tables
    problems = section(md, "Requests that hung, failed or were truncated")
    for r in hung:
        row = next(line for line in problems.splitlines() if f"`{r.id}`" in line)
        assert "| 3 (reused) |" in row and "upstream_silent" in row
        assert f"| {r.request_id} |" in row
    assert len(doc["problem_requests"]) == 2
    reuse = section(md, "Connection reuse")
    front_rows = [line for line in reuse.splitlines() if line.startswith("| front/")]
    assert len(front_rows) == 2
    assert all("| 3 | 2 |" in row for row in front_rows), front_rows  # 3 requests, 2 reuses
    first_bad = [c["first_not_complete"] for c in doc["connections"] if c["tap"] == "front"]
    assert first_bad == [3, 3]  # the 3rd request on each connection did not complete
    engine = section(md, "Engine state around each finding")
    during = [line for line in engine.splitlines() if "| during:" in line]
    assert during and all("| 0-0 | 0 |" in line for line in during), during  # idle engine

    # how to reproduce: the exact commands, against the tap's upstream
    repro = section(md, "How to reproduce")
    same = f"tracer replay {incident.front} --target {incident.front_upstream}"
    assert f"{same}\n" in repro
    assert f"{same} --connections fresh\n" in repro
    assert doc["reproduce"][0]["same_connections"] == same  # the client-side tap first

    # provenance: the capture hashes can be checked
    prov = section(md, "Provenance")
    for path in (incident.front, incident.back):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"| `{path}` |" in prov and f"`{digest}`" in prov
        assert any(c["sha256"] == digest for c in doc["provenance"]["captures"])
    assert "report made by tracer 0.1.0" in prov
    assert (
        doc["provenance"]["time_range"]["start"] <= mark <= doc["provenance"]["time_range"]["end"]
    )

    # the same captures give the same picture, byte for byte
    again = report(
        incident.front, incident.back, "-o", tmp_path / "again.md", "--hang-at", f"{mark:.3f}"
    )
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again-timeline.svg").read_bytes() == svg.read_bytes()
    assert (tmp_path / "again-timeline.png").read_bytes() == png.read_bytes()


def _html(md: Path) -> Path:
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(md.read_text())
    page = md.with_suffix(".html")
    page.write_text(
        "<!doctype html><meta charset=utf-8><style>"
        "body{font-family:sans-serif;margin:8px;max-width:1380px}"
        "img{max-width:100%}table{border-collapse:collapse;font-size:11px}"
        "td,th{border:1px solid #999;padding:2px 4px}</style>" + body
    )
    return page


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed")
def test_rendered_report_shows_the_picture(made: Made, tmp_path: Path) -> None:
    """Looked at as a person would: the Markdown rendered, in a browser, with its picture."""
    page = _html(made.dir / "incident.md")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium'}",
            f"--screenshot={shot}",
            "--window-size=1400,1800",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.shape == (1800, 1400)
    assert (pixels < 100).mean() > 0.005, "no text on the page"  # dark text is there
    assert (pixels < 250).mean() > 0.05, "the page is nearly blank"
    assert lane_bands(shot) == made.doc["timeline"]["lanes"]  # the picture, every lane


async def _many_connections(tmp: Path) -> Path:
    """12 connections of 2 requests each; the last request stalls in the engine."""
    capture = tmp / "many.jsonl"
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with engine_running(ttft=0.0, itl=0.003) as sim:
        async with tracer_proxy(
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            sim.url,
            "--tap",
            "edge",
            "--capture",
            str(capture),
            "--engine-metrics",
            f"{sim.url}/metrics",
            "--metrics-interval",
            "0.1",
            "--stall-after",
            "0.6",
        ) as tap:

            async def client(n: int) -> None:
                async with httpx.AsyncClient(timeout=10) as c:
                    for i in range(2):
                        stall = n == 11 and i == 1  # alone: every other request is done
                        headers = {"x-sim-fault": "stall:after=2:for=1.5"} if stall else {}
                        async with c.stream(
                            "POST", tap.url + "/v1/chat/completions", json=body, headers=headers
                        ) as r:
                            async for _ in r.aiter_bytes():
                                pass

            async with anyio.create_task_group() as tg:
                for n in range(11):
                    tg.start_soon(client, n)
            await client(11)
    return capture


def test_many_connections_are_grouped_into_lanes(tmp_path: Path) -> None:
    capture = anyio.run(_many_connections, tmp_path)
    out = tmp_path / "many.md"
    done = report(capture, "-o", out, "--json", tmp_path / "many.json", "--max-lanes", "5")
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads((tmp_path / "many.json").read_text())
    assert doc["overview"]["totals"]["connections"] == 12
    assert doc["overview"]["totals"]["requests"] == 24
    v = doc["verdict"]
    assert (v["party"], v["kind"]) == ("engine", "engine_stall_mid_stream"), doc["findings"]
    tl = doc["timeline"]
    # 12 connections, at most 5 lanes: 3 connections per lane, 4 lanes
    assert (tl["layout"], tl["connections_per_lane"], tl["lanes"]) == ("grouped", 3, 4)
    ids = svg_ids(tmp_path / "many-timeline.svg")
    assert ids["lane"] == ids["heat"] == 4
    # only the requests that did not go cleanly are drawn one by one: the stalled one (a
    # loaded machine may add requests a note names, e.g. slow first tokens: not drawn)
    unclean = [
        r
        for r in doc["problem_requests"]
        if r["termination"] != "complete" or r["stalls"] or (r["status"] or 0) >= 400 or r["error"]
    ]
    assert ids["req"] == len(unclean) >= 1
    assert "edge/12/2" in [r["id"] for r in doc["problem_requests"]]
    assert ids["stall"] == doc["overview"]["totals"]["stalls"] >= 1
    assert lane_bands(tmp_path / "many-timeline.png") == 4
    md = out.read_text()
    assert "4 lanes of up to 3 connection(s) each" in md
    assert "**Verdict: engine — `engine_stall_mid_stream`**" in md
    ruled = section(md, "Ruled out, and by which evidence")
    assert "**client** ruled out" in ruled and "**proxy** ruled out" in ruled
    engine = section(md, "Engine state around each finding")
    during = next(line for line in engine.splitlines() if "| during:" in line)
    assert "| 1-1 |" in during or "| 0-1 |" in during, during  # the engine held it running


def test_engine_only_capture_has_nothing_to_replay(tmp_path: Path) -> None:
    async def watch() -> Path:
        capture = tmp_path / "watch.jsonl"
        async with engine_running() as sim:
            await anyio.run_process(
                [
                    sys.executable,
                    "-m",
                    "tracer",
                    "watch",
                    "--engine-metrics",
                    f"{sim.url}/metrics",
                    "--metrics-interval",
                    "0.1",
                    "--duration",
                    "1.0",  # two samples at least, on a loaded machine too
                    "--capture",
                    str(capture),
                ]
            )
        return capture

    capture = anyio.run(watch)
    out = tmp_path / "quiet.md"
    assert main(["report", str(capture), "-o", str(out)]) == 0  # in-process, this once
    md = out.read_text()
    assert md.startswith("# Incident report: none — healthy\n")
    assert "No capture names an upstream to replay against" in section(md, "How to reproduce")
    ids = svg_ids(tmp_path / "quiet-timeline.svg")
    assert ids["lane"] == 0 and ids["engine"] >= 2  # no connections; the engine still drawn


def test_bad_hang_time_is_named(
    incident: Incident, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.md"
    assert main(["report", str(incident.front), "-o", str(out), "--hang-at", "yesterday"]) == 2
    assert "--hang-at yesterday: not ISO 8601" in capsys.readouterr().err
    assert not out.exists()
