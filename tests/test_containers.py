"""docker-compose.yml run by a real container engine: images built, the cluster started, mail sent.

``scripts/compose.sh`` (what ``make compose-up`` runs) builds the base image if it is missing
(debootstrap), both images, and starts the default services with podman-compose (``docker
compose`` where a Docker daemon answers) under the project ``transportd-test``, with its published
ports moved to free ports on 127.0.0.1 and a cluster secret of its own. Then, on the real engine:

1. swaks to node1's published port, the sink paused: node3 (the other site) holds the shadow;
   the sink resumed, the sink container stores the message and node3 discards its shadow.
2. The sink paused, a message queued on node1, ``kill`` node1: node3's heartbeats fail for the
   (30 s) resubmit span, node3 promotes its shadow and, the sink resumed, delivers it.
3. A site partition: node3 disconnected from the transport network for a while. A message sent to
   node1 meanwhile is shadowed in its own site (node2); one sent to node3 is accepted without a
   shadow (HAREDIRECTFAIL: ``reject_message_on_shadow_failure`` is false); reconnected, both reach
   the sink.
4. The analytics service runs ``transportd analyze`` over the nodes' MSGTRK volumes: report.html.
5. ``down -v`` leaves no container, network or volume of the project.

Marker ``containers``; the default test run includes it. Whether a missing or unusable engine is a
failure or a skip: ``TRANSPORTD_CONTAINERS`` = ``require`` (.ci/run sets it where podman was set up),
``auto`` (default: skip when no engine is installed) or ``skip``. Everything the test starts is
removed by project label and id at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import wait_for

pytestmark = pytest.mark.containers

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "compose.sh"
PROJECT = "transportd-test"
MODE = os.environ.get("TRANSPORTD_CONTAINERS", "auto")
SWAKS = shutil.which("swaks")
BUILD_TIMEOUT = 1800  # a cold machine: debootstrap, then both images (Java and PySpark downloads)
LABEL = f"label=com.docker.compose.project={PROJECT}"


def engine_or_reason() -> tuple[str | None, str]:
    if MODE == "skip":
        return None, "TRANSPORTD_CONTAINERS=skip"
    if SWAKS is None:
        return None, "swaks is not installed"
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True, timeout=30,
                                                  check=False).returncode == 0:
        return "docker", ""
    if not shutil.which("podman"):
        return None, "no container engine (podman or a running Docker)"
    if not shutil.which("podman-compose"):
        return None, "podman-compose is not installed"
    res = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                         text=True, timeout=60, check=False)
    if res.returncode != 0:
        return None, f"podman info fails: {res.stderr.strip()[-500:]}"
    res = subprocess.run(["podman", "image", "exists", "localhost/transportd-python:3.11-bookworm"], timeout=30,
                         check=False)
    if res.returncode != 0 and not shutil.which("debootstrap"):
        return None, "no base image and debootstrap is not installed"
    return "podman", ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, engine: str, tmp: Path):
        self.engine = engine
        self.tmp = tmp
        secret = tmp / "secret" / "cluster-secret"
        secret.parent.mkdir(mode=0o700)
        secret.write_text(f"{uuid.uuid4().hex}{uuid.uuid4().hex}\n")
        secret.chmod(0o644)  # the containers' user reads it through the bind mount; the folder is 0700
        self.ports = {n: free_port() for n in ("node1", "node2", "node3")}
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT, "TRANSPORTD_ENGINE": engine,
                    "TRANSPORTD_SECRET_FILE": str(secret),
                    **{f"TRANSPORTD_PUBLISH_{n.upper()}": str(p) for n, p in self.ports.items()},
                    "TRANSPORTD_PUBLISH_PROMETHEUS": str(free_port())}
        self.timings: dict[str, float] = {}
        self.volumes_before = self.volumes()

    # -- commands ------------------------------------------------------------------------------

    def script(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        start = time.monotonic()
        res = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=self.env, capture_output=True,
                             text=True, timeout=timeout, check=False)
        self.timings[" ".join(args[:1])] = round(time.monotonic() - start, 1)
        assert res.returncode == 0, f"compose.sh {' '.join(args)}: rc {res.returncode}\n" \
                                    f"{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
        return res

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run([self.engine, *args], capture_output=True, text=True, timeout=timeout, check=False)
        if check:
            assert res.returncode == 0, f"{self.engine} {' '.join(args)}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
        return res

    def cid(self, service: str) -> str:
        out = self.run("ps", "-aq", "--filter", LABEL, "--filter",
                       f"label=com.docker.compose.service={service}").stdout.split()
        assert len(out) == 1, f"{service}: containers {out}"
        return out[0]

    def exec(self, service: str, *words: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run("exec", self.cid(service), *words, timeout=timeout, check=False)

    def transportd_json(self, service: str, *words: str) -> list[dict]:
        res = self.exec(service, "transportd", *words, "--json")
        assert res.returncode == 0, f"{service}: transportd {' '.join(words)}: {res.stderr[-2000:]}"
        return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]

    def swaks(self, node: str, marker: str, to: str = "carol@elsewhere.test") -> str:
        res = subprocess.run([SWAKS, "--server", f"127.0.0.1:{self.ports[node]}", "--timeout", "90",
                              "--to", to, "--from", "zed@example.test",
                              "--header", f"Subject: {marker}", "--header", f"Message-Id: <{marker}@transportd.test>"],
                             capture_output=True, text=True, timeout=120, check=False)
        return res.stdout + res.stderr

    def in_sink(self, marker: str) -> bool:
        res = self.exec("sink", "grep", "-rl", marker, "/var/spool/transportd-sink/new")
        return res.returncode == 0 and bool(res.stdout.strip())

    def shadows_for(self, holder: str, primary: str, include_done: bool = False) -> dict[str, str]:
        """{Message-ID: state} of the shadow copies ``holder`` keeps for ``primary``."""
        args = ["shadow", "show", primary] + (["--all"] if include_done else [])
        return {r["message_id"]: r["state"] for r in self.transportd_json(holder, *args)}

    def tracking(self, node: str, marker: str) -> list[dict]:
        return [r for r in self.transportd_json(node, "tracking", "search")
                if marker in (r.get("message-subject") or "") or marker in (r.get("message-id") or "")]

    def logs(self) -> str:
        out = []
        for service in ("node1", "node2", "node3", "sink"):
            ids = self.run("ps", "-aq", "--filter", LABEL, "--filter",
                           f"label=com.docker.compose.service={service}", check=False).stdout.split()
            for c in ids:
                res = self.run("logs", "--tail", "40", c, check=False, timeout=60)
                out.append(f"===== {service} ({c}) =====\n{res.stdout[-4000:]}{res.stderr[-4000:]}")
        return "\n".join(out)

    def leftovers(self) -> dict[str, list[str]]:
        what = {"containers": ["ps", "-aq", "--filter", LABEL],
                "networks": ["network", "ls", "-q", "--filter", LABEL],
                "volumes": ["volume", "ls", "-q", "--filter", LABEL]}
        out = {k: self.run(*args, check=False).stdout.split() for k, args in what.items()}
        # Anonymous volumes (an image's VOLUME no service mounts) carry no label: new since the start.
        out["anonymous volumes"] = [v for v in self.volumes() - self.volumes_before
                                    if re.fullmatch(r"[0-9a-f]{64}", v)]
        return out

    def volumes(self) -> set[str]:
        return set(self.run("volume", "ls", "-q", check=False).stdout.split())

    def remove_everything(self) -> None:
        """By project label, then by id: containers, then networks and volumes."""
        subprocess.run(["bash", str(SCRIPT), "down", "-v"], cwd=REPO, env=self.env, capture_output=True,
                       timeout=300, check=False)
        left = self.leftovers()
        for c in left["containers"]:
            self.run("rm", "-f", c, check=False)
        for n in left["networks"]:
            self.run("network", "rm", "-f", n, check=False) if self.engine == "podman" else \
                self.run("network", "rm", n, check=False)
        for v in left["volumes"]:
            self.run("volume", "rm", "-f", v, check=False)
        for v in left["anonymous volumes"]:  # not forced: a volume some other container uses stays
            self.run("volume", "rm", v, check=False)


def mid(marker: str) -> str:
    return f"<{marker}@transportd.test>"


@pytest.fixture
def cluster(tmp_path):
    engine, reason = engine_or_reason()
    if engine is None:
        if MODE == "require":
            pytest.fail(f"TRANSPORTD_CONTAINERS=require but the container engine cannot be used: {reason}")
        pytest.skip(reason)
    c = Cluster(engine, tmp_path)
    busy = subprocess.run([engine, "network", "ls", "--format", "{{.Name}}"], capture_output=True, text=True,
                          timeout=60, check=False).stdout.split()
    others = [n for n in busy if n.endswith(("_transport", "_site-a", "_site-b")) and not n.startswith(PROJECT)]
    assert not others, f"another compose cluster holds the fixed subnets ({others}): make compose-down first"
    c.remove_everything()  # what an interrupted run may have left
    try:
        yield c
    finally:
        print(f"timings (s): {c.timings}")
        try:
            print(c.logs())
        finally:
            c.remove_everything()


def test_the_compose_cluster_runs_in_containers(cluster):
    c = cluster
    started = time.monotonic()
    c.script("up", timeout=BUILD_TIMEOUT)
    node1_fqdn = "node1.transportd.test"

    # 1. Relayed through node1; node3 (the other site) holds the shadow until the delivery is known.
    c.run("pause", c.cid("sink"))
    m1 = f"ctr-{uuid.uuid4().hex[:12]}"
    out = c.swaks("node1", m1)
    assert "250 2.0.0 Ok: queued as" in out, out
    assert c.shadows_for("node3", node1_fqdn).get(mid(m1)) == "Shadow"
    c.run("unpause", c.cid("sink"))
    wait_for(lambda: c.in_sink(m1), timeout=90, interval=1, what="the message in the sink container")
    wait_for(lambda: mid(m1) not in c.shadows_for("node3", node1_fqdn), timeout=60, interval=1,
             what="node3 discarding its shadow after the delivery")
    events = {r["event-id"] for r in c.tracking("node3", m1)}
    assert {"HARECEIVE", "HADISCARD"} <= events, events

    # 2. node1 killed with the message queued (sink paused): node3 promotes it after the resubmit span.
    c.run("pause", c.cid("sink"))
    m2 = f"ctr-{uuid.uuid4().hex[:12]}"
    out = c.swaks("node1", m2)
    assert "250 2.0.0 Ok: queued as" in out, out
    assert c.shadows_for("node3", node1_fqdn).get(mid(m2)) == "Shadow"
    node1 = c.cid("node1")
    killed = time.monotonic()
    c.run("kill", node1)
    if c.run("inspect", "--format", "{{.State.Running}}", node1).stdout.strip() == "true":
        c.run("stop", "-t", "0", node1)  # a restart policy brought it back: keep it down
    wait_for(lambda: any(r["event-id"] == "RESUBMIT" for r in c.tracking("node3", m2)), timeout=150,
             interval=2, what="node3 promoting node1's shadow")
    promoted_after = time.monotonic() - killed
    assert promoted_after >= 25, f"promoted {promoted_after:.0f} s after the kill: before the 30 s resubmit span"
    c.run("unpause", c.cid("sink"))
    wait_for(lambda: c.in_sink(m2), timeout=120, interval=1, what="the promoted message in the sink")
    wait_for(lambda: any(r["event-id"] == "SENDEXTERNAL" for r in c.tracking("node3", m2)), timeout=30,
             interval=1, what="node3's SENDEXTERNAL row of the promoted message")
    c.run("start", node1)
    c.script("compose", "ps", timeout=120)

    def healthy(service: str) -> bool:
        return c.exec(service, "transportd", "health").returncode == 0
    wait_for(lambda: healthy("node1"), timeout=120, interval=2, what="node1 back")

    # 3. Site partition: site-b (node3) cut off the transport network for a while.
    c.run("pause", c.cid("sink"))
    transport_net = f"{PROJECT}_transport"
    node3 = c.cid("node3")
    ip = c.run("inspect", "--format", "{{(index .NetworkSettings.Networks \"" + transport_net + "\").IPAddress}}",
               node3).stdout.strip()
    assert re.fullmatch(r"10\.78\.0\.\d+", ip), ip
    c.run("network", "disconnect", transport_net, node3)
    cut = time.monotonic()
    try:
        m3, m4 = f"ctr-{uuid.uuid4().hex[:12]}", f"ctr-{uuid.uuid4().hex[:12]}"
        out = c.swaks("node1", m3)
        assert "250 2.0.0 Ok: queued as" in out, out
        # Protected within its site: the remote site cannot be reached, node2 holds the shadow.
        assert c.shadows_for("node2", node1_fqdn).get(mid(m3)) == "Shadow"
        out = c.swaks("node3", m4)
        # node3 alone: accepted without a shadow (RejectMessageOnShadowFailure off), and said so.
        assert "250 2.0.0 Ok: queued as" in out, out
        assert any(r["event-id"] == "HAREDIRECTFAIL" for r in c.tracking("node3", m4))
        # The partition lasts a while (20 s), shorter than the 30 s resubmit span: nothing is promoted.
        time.sleep(max(0.0, 20 - (time.monotonic() - cut)))
    finally:
        c.run("network", "connect", "--ip", ip, "--alias", "node3", transport_net, node3)
    c.run("unpause", c.cid("sink"))
    for m in (m3, m4):
        wait_for(lambda m=m: c.in_sink(m), timeout=120, interval=1, what=f"{m} in the sink after the partition")

    # 4. The analytics service over the nodes' MSGTRK volumes.
    reports = c.tmp / "reports"
    c.script("analyze", str(reports), timeout=600)
    html = (reports / "report.html").read_text()
    assert "node1.transportd.test" in html or "RECEIVE" in html, html[:2000]

    # 5. Down with the volumes: nothing of the project is left.
    c.script("down", "-v", timeout=300)
    assert c.leftovers() == {"containers": [], "networks": [], "volumes": [], "anonymous volumes": []}
    print(f"containers test: {time.monotonic() - started:.0f} s")
