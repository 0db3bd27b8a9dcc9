"""The container set-up without a Docker engine: docker-compose.yml and the Dockerfile, proved.

- ``docker-compose config -q`` (Debian's docker-compose v1) validates the file, with and without
  its profiles; Debian's ``promtool`` checks the Prometheus config the "metrics" profile mounts.
- The Dockerfile's daemon image runs the ``transportd`` CLI as its ENTRYPOINT (the console script
  pyproject.toml installs, the same CLI the tests run) as a non-root user; what it COPYs exists.
- The compose topology runs as local processes: every service ``docker compose up -d`` starts
  (the ones without a profile) is run with the Dockerfile's ENTRYPOINT + the service's
  ``command`` and ``environment``, exactly as the file gives them, each in its own mount
  namespace (``unshare --mount``) where /etc/hosts maps every service name to its own 127.0.5.x
  address and every volume is bind-mounted at its container path (named volumes are folders
  shared between services, as Docker shares them; ``:ro`` stays read-only). Published ports are
  forwarded from 127.0.5.1, which stands for the Docker host's 127.0.0.1 (so the test cannot
  collide with anything on 127.0.0.1). Each service must pass its own healthcheck; mail sent with
  swaks to the published ports must reach the sink's volume and node1's mailbox volume;
  ``transportd queue list`` run like ``docker compose exec`` must work from the environment alone;
  and ``docker compose restart node1`` (SIGTERM, start again on the same volumes) must keep a
  queued message, which is delivered once the sink is back.

A wrong flag, config key, path, volume or environment variable in the compose file makes a
service fail to start, fail its healthcheck or lose mail here. What this cannot show: the image
build itself, Docker's DNS and port publishing, and the non-root user (processes run as the test's
user). Needs root (mount namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import swaks, wait_for

from transportd.queue.mailbox import MailboxStore

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKER_COMPOSE = shutil.which("docker-compose")
HOST_ADDRESS = "127.0.5.1"  # the Docker host's 127.0.0.1 in published ports
SERVICE_NET = "127.0.5."


def load_compose() -> dict:
    """docker-compose.yml as compose reads it with nothing set: ``${VAR:-default}`` is the default."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), COMPOSE.read_text())
    assert "${" not in text, "give every variable in docker-compose.yml a default: ${VAR:-default}"
    return yaml.safe_load(text)


# ----------------------------------------------------------------------------- Dockerfile

def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """{stage name: [(INSTRUCTION, arguments)]} with continuation lines joined."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, args = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.search(r"\bAS\s+(\S+)$", args, re.IGNORECASE)
            assert m, f"every stage is named: {line}"
            current = stages.setdefault(m.group(1), [])
            base = args.split()[0]
            if base in stages:  # FROM an earlier stage: inherits its instructions
                current.extend(stages[base])
        current.append((instr, args.strip()))
    return stages


def last(stage: list[tuple[str, str]], instr: str) -> str | None:
    found = [a for i, a in stage if i == instr]
    return found[-1] if found else None


def test_dockerfile_runs_the_transportd_cli_as_a_non_root_user():
    stages = dockerfile_stages()
    compose = load_compose()
    targets = {s["build"]["target"] for s in compose["services"].values() if "build" in s}
    assert targets <= set(stages), f"compose builds targets the Dockerfile lacks: {targets - set(stages)}"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["transportd"] == "transportd.cli:main"
    for target in targets:
        stage = stages[target]
        assert json.loads(last(stage, "ENTRYPOINT")) == ["transportd"], target
        user = last(stage, "USER")
        assert user and user not in ("root", "0"), f"{target} runs as {user}"
    # Everything COPYed from the build context exists (COPY --from copies between stages).
    for stage in stages.values():
        for instr, args in stage:
            if instr == "COPY" and not args.startswith("--from"):
                for src in args.split()[:-1]:
                    assert (REPO / src).exists(), f"COPY {src}: no such file in the repository"
    # The image's CMD parses with the real CLI (a flag renamed in cli.py breaks this).
    from click.testing import CliRunner

    from transportd.cli import cli
    cmd = json.loads(last(stages["daemon"], "CMD"))
    res = CliRunner().invoke(cli, [*cmd, "--help"])
    assert res.exit_code == 0, res.output


# ----------------------------------------------------------------------------- docker-compose config

@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose (Debian's v1) is not installed")
@pytest.mark.parametrize("profiles", [(), ("analytics", "metrics")])
def test_docker_compose_config_validates(profiles):
    args = [DOCKER_COMPOSE, "--project-directory", str(REPO), "-f", str(COMPOSE)]
    for p in profiles:
        args += ["--profile", p]
    res = subprocess.run(args + ["config", "-q"], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus (promtool) is not installed")
def test_prometheus_profile_config_is_valid_and_scrapes_every_node():
    compose = load_compose()
    mounts = [v.split(":") for v in compose["services"]["prometheus"]["volumes"]]
    src = next(REPO / s for s, t, *_ in mounts if t == "/etc/prometheus/prometheus.yml")
    res = subprocess.run(["promtool", "check", "config", str(src)], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    targets = {t for job in yaml.safe_load(src.read_text())["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]}
    nodes = [n for n in compose["services"] if n.startswith("node")]
    expected = set()
    for n in nodes:
        cfg = tomllib.loads(config_of(compose, n).read_text())
        expected.add(cfg["metrics"]["listen"])
    assert targets == expected


RULES = REPO / "config" / "compose" / "transportd-rules.yml"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus (promtool) is not installed")
def test_alerting_rules_ship_with_the_metrics_profile_and_pass_promtool():
    compose = load_compose()
    mounts = {t: REPO / s for s, t, *_ in (v.split(":") for v in compose["services"]["prometheus"]["volumes"])}
    prometheus_yml = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    for rule_file in prometheus_yml["rule_files"]:
        assert mounts[f"/etc/prometheus/{rule_file}"] == RULES, rule_file
    res = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    names = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {"TransportdQueueOldestMessageAge", "TransportdMessagesNotRedundant", "TransportdHeartbeatFailures",
            "TransportdPoisonMessages", "TransportdMessagesPartiallyRedundant"} <= names


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus (promtool) is not installed")
def test_alerting_rules_fire_when_a_queue_waits_too_long(tmp_path):
    """``promtool test rules`` on the shipped file: the queue-age alert fires once a queue's oldest
    message has been older than 1 h for 10 min, and not for a queue that keeps moving; the
    heartbeat and poison alerts fire on their series."""
    node = {"instance": "node1:9101", "job": "transportd"}

    def series(name: str, values: str, **labels: str) -> dict:
        body = ",".join(f'{k}="{v}"' for k, v in {**node, **labels}.items())
        return {"series": f"{name}{{{body}}}", "values": values}

    fired = {"instance": node["instance"], "severity": "warning"}  # the rules aggregate by instance
    tests = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            # Stuck: the oldest message ages a minute per minute, from 50 min old.
            series("transportd_queue_oldest_message_age_seconds", "3000+60x40", queue="dns:stuck.example"),
            # Moving: its oldest message is never more than 5 min old.
            series("transportd_queue_oldest_message_age_seconds", "300x40", queue="dns:moving.example"),
            series("transportd_shadow_heartbeat_consecutive_failures", "0 0 1 2 3 4 5 6 7 8 9",
                   primary="node2.transportd.test"),
            series("transportd_poison_queue_length", "0 0 0 1 1 1 1 1"),
        ],
        "alert_rule_test": [
            # 3600 s is passed at 10 min; pending for 10 min more: firing from 21 min, not at 15.
            {"eval_time": "15m", "alertname": "TransportdQueueOldestMessageAge", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "TransportdQueueOldestMessageAge", "exp_alerts": [
                {"exp_labels": {**fired, "queue": "dns:stuck.example"}, "exp_annotations": {
                    "summary": "node1:9101: a message has waited over 1 h in queue dns:stuck.example",
                    "description": "The oldest message in dns:stuck.example was received 1h 15m 0s ago. See "
                                   "`transportd queue list` and `transportd message list --filter "
                                   "queue=dns:stuck.example`."}}]},
            {"eval_time": "3m", "alertname": "TransportdHeartbeatFailures", "exp_alerts": []},
            {"eval_time": "8m", "alertname": "TransportdHeartbeatFailures", "exp_alerts": [
                {"exp_labels": {**fired, "primary": "node2.transportd.test"}, "exp_annotations": {
                    "summary": "node1:9101: 7 failed heartbeats in a row to node2.transportd.test",
                    "description": "node2.transportd.test is unreachable from its shadow; its shadows are promoted "
                                   "after shadow_resubmit_time_span. See `transportd shadow show "
                                   "node2.transportd.test`."}}]},
            {"eval_time": "3m", "alertname": "TransportdPoisonMessages", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "TransportdPoisonMessages", "exp_alerts": [{
                "exp_labels": fired, "exp_annotations": {
                    "summary": "node1:9101: 1 message(s) in the Poison queue",
                    "description": "See `transportd message list --queue Poison`; release with `message resume`, "
                                   "drop with `message remove`."}}]},
        ],
    }]}
    spec = tmp_path / "rules.test.yml"
    spec.write_text(yaml.safe_dump(tests))
    res = subprocess.run(["promtool", "test", "rules", str(spec)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    # The test can fail: the same series with a threshold the stuck queue never reaches.
    tests["tests"][0]["input_series"][0]["values"] = "60x40"
    spec.write_text(yaml.safe_dump(tests))
    res = subprocess.run(["promtool", "test", "rules", str(spec)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode != 0 and "TransportdQueueOldestMessageAge" in res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus (promtool) is not installed")
def test_not_redundant_alert_is_about_messages_with_no_copy_only(tmp_path):
    """``transportd_messages_not_redundant`` has three states; ``partial`` messages (fewer shadows
    than shadow_copies) still have a copy on a peer: TransportdMessagesNotRedundant ("without a
    shadow copy") does not count them (node1 below has only those), it fires on ``unprotected``
    and ``reshadowing`` (node2: 1 + 2, the partial one left out); the lower-severity
    TransportdMessagesPartiallyRedundant says what partial ones are."""
    def series(instance: str, state: str, values: str) -> dict:
        return {"series": f'transportd_messages_not_redundant{{instance="{instance}",job="transportd",'
                          f'state="{state}"}}', "values": values}

    tests = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            series("node1:9101", "partial", "2x60"), series("node1:9101", "unprotected", "0x60"),
            series("node1:9101", "reshadowing", "0x60"),
            series("node2:9101", "partial", "4x60"), series("node2:9101", "unprotected", "1x60"),
            series("node2:9101", "reshadowing", "2x60"),
        ],
        "alert_rule_test": [
            {"eval_time": "20m", "alertname": "TransportdMessagesNotRedundant", "exp_alerts": [
                {"exp_labels": {"instance": "node2:9101", "severity": "warning"}, "exp_annotations": {
                    "summary": "node2:9101: 3 queued message(s) without a shadow copy for 15 min",
                    "description": "Shadow copies cannot be made (peers down or refusing). See `transportd shadow "
                                   "list` on the peers and the node's log (HAREDIRECTFAIL)."}}]},
            {"eval_time": "20m", "alertname": "TransportdMessagesPartiallyRedundant", "exp_alerts": []},
            {"eval_time": "35m", "alertname": "TransportdMessagesPartiallyRedundant", "exp_alerts": [
                {"exp_labels": {"instance": instance, "severity": "info"}, "exp_annotations": {
                    "summary": f"{instance}: {n} queued message(s) with fewer shadow copies than shadow_copies "
                               "for 30 min",
                    "description": "Each still has a shadow copy on at least one peer; the missing copies cannot "
                                   "be made (too few peers up or accepting). See `transportd shadow list` on the "
                                   "peers and the node's log."}}
                for instance, n in (("node1:9101", 2), ("node2:9101", 4))]},
        ],
    }]}
    spec = tmp_path / "rules.test.yml"
    spec.write_text(yaml.safe_dump(tests))
    res = subprocess.run(["promtool", "test", "rules", str(spec)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def config_of(compose: dict, service: str) -> Path:
    """The host file behind the service's TRANSPORTD_CONFIG (through its bind mounts)."""
    svc = compose["services"][service]
    path = environment(svc)["TRANSPORTD_CONFIG"]
    for spec in svc["volumes"]:
        src, target = spec.split(":")[:2]
        if src.startswith(".") and path.startswith(target.rstrip("/") + "/"):
            return REPO / src / path[len(target.rstrip("/")) + 1:]
    raise AssertionError(f"{service}: {path} is not on a bind mount")


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


# ----------------------------------------------------------------------------- the topology as processes

class Forwarder:
    """A published port: HOST_ADDRESS:port -> the service's address (threads, loopback only)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.target = target
        self.sock = socket.create_server(listen, reuse_port=False)
        self.sock.settimeout(0.2)
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stopping = True
        self.sock.close()
        self.thread.join(timeout=2)


class ComposeTopology:
    def __init__(self, base: Path, procs: Any):
        self.compose = load_compose()
        self.services: dict[str, dict] = self.compose["services"]
        self.stages = dockerfile_stages()
        self.base = base
        self.procs = procs
        self.ips = {name: f"{SERVICE_NET}{10 + i}" for i, name in enumerate(self.services)}
        self.hosts = base / "hosts"
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{ip} {name} {self.services[name].get('hostname', name)}\n" for name, ip in self.ips.items()))
        self.running: dict[str, subprocess.Popen] = {}
        self.forwarders: list[Forwarder] = []
        self.created_mount_points: list[Path] = []

    # -- what compose would do ------------------------------------------------------------

    def default_services(self) -> list[str]:
        """What ``docker compose up -d`` starts (no profile), dependencies first."""
        order: list[str] = []

        def visit(name: str) -> None:
            if name in order:
                return
            deps = self.services[name].get("depends_on") or []
            for d in (deps if isinstance(deps, list) else list(deps)):
                visit(d)
            order.append(name)
        for name, svc in self.services.items():
            if not svc.get("profiles"):
                visit(name)
        return order

    def volume_dir(self, name: str) -> Path:
        assert name in (self.compose.get("volumes") or {}), f"volume {name} is not declared"
        d = self.base / "volumes" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def secrets_dir(self) -> Path:
        """Compose secrets (files) appear in /run/secrets; the test makes its own secret files."""
        d = self.base / "secrets"
        if not d.exists():
            d.mkdir()
            for name in self.compose.get("secrets") or {}:
                (d / name).write_text(f"test-secret-{uuid.uuid4()}\n")
        return d

    def mounts(self, service: str) -> list[tuple[Path, str, bool]]:
        out = []
        for spec in self.services[service].get("secrets") or []:
            name = spec if isinstance(spec, str) else spec["source"]
            assert name in (self.compose.get("secrets") or {}), f"{service}: secret {name} is not declared"
            assert isinstance(spec, str) or "target" not in spec, f"{service}: secret {name}: a target"
        if self.services[service].get("secrets"):
            out.append((self.secrets_dir(), "/run/secrets", True))
        for spec in self.services[service].get("volumes") or []:
            parts = spec.split(":")
            src, target, ro = parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")
            host = (REPO / src).resolve() if src.startswith((".", "/")) else self.volume_dir(src)
            assert host.exists(), f"{service}: bind mount source {src} does not exist"
            out.append((host, target, ro))
        return sorted(out, key=lambda m: m[1].count("/"))

    def stage(self, service: str) -> list[tuple[str, str]]:
        build = self.services[service].get("build")
        assert build, f"{service}: default services are built from the Dockerfile"
        return self.stages[build["target"]]

    def argv(self, service: str, words: list[str]) -> list[str]:
        """A container command line: ``transportd`` is the console script, run from this tree."""
        assert words[0] == "transportd", f"{service}: runs {words[0]}, not the transportd CLI"
        return [sys.executable, "-m", "transportd", *words[1:]]

    def entrypoint_and_command(self, service: str) -> list[str]:
        svc = self.services[service]
        stage = self.stage(service)
        entry = svc.get("entrypoint") or json.loads(last(stage, "ENTRYPOINT"))
        command = svc.get("command") or json.loads(last(stage, "CMD"))
        assert isinstance(command, list), f"{service}: give command in exec (list) form"
        return [*entry, *command]

    def launch(self, service: str, words: list[str], **popen: Any) -> subprocess.Popen:
        """Run ``words`` in a fresh mount namespace laid out like the service's container."""
        lines = ["set -e", f"mount --bind {shlex.quote(str(self.hosts))} /etc/hosts"]
        done: list[str] = []
        for host, target, ro in self.mounts(service):
            t = Path(target)
            inside = any(target.startswith(d.rstrip("/") + "/") for d in done)
            done.append(target)
            if inside:  # in a volume mounted above: made there, as Docker does
                lines.append(f"mkdir -p {shlex.quote(target)}")
            elif not t.exists():  # a mount point the image has and this machine lacks
                missing = [p for p in [t, *t.parents] if not p.exists()]
                t.mkdir(parents=True, exist_ok=True)
                self.created_mount_points += [p for p in missing if p not in self.created_mount_points]
            lines.append(f"mount --bind {shlex.quote(str(host))} {shlex.quote(target)}")
            if ro:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        workdir = last(self.stage(service), "WORKDIR") or "/"
        lines.append(f"cd {shlex.quote(workdir)} 2>/dev/null || cd /")
        lines.append('exec "$@"')
        env = {**os.environ, "PYTHONPATH": str(REPO), **environment(self.services[service])}
        return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines),
                                 service, *self.argv(service, words)], env=env, **popen)

    def exec(self, service: str, *words: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Like ``docker compose exec SERVICE WORDS``."""
        p = self.procs.add(self.launch(service, list(words), stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(p.args, p.returncode, out.decode(), err.decode())

    def up(self, service: str) -> None:
        with open(self.base / f"{service}.log", "ab") as log:
            self.running[service] = self.procs.add(self.launch(
                service, self.entrypoint_and_command(service), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL))
        self.wait_healthy(service)

    def wait_healthy(self, service: str, timeout: float = 60) -> None:
        test = self.services[service]["healthcheck"]["test"]
        assert test[0] == "CMD", f"{service}: healthcheck in CMD form"
        deadline = time.monotonic() + timeout
        while True:
            proc = self.running[service]
            assert proc.poll() is None, f"{service} exited {proc.returncode}:\n{self.log(service)}"
            res = self.exec(service, *test[1:])
            if res.returncode == 0:
                return
            assert time.monotonic() < deadline, f"{service} unhealthy: {res.stderr}\n{self.log(service)}"
            time.sleep(0.3)

    def stop(self, service: str) -> None:
        """Like ``docker compose stop``: SIGTERM, then SIGKILL after the grace period."""
        proc = self.running.pop(service)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def publish(self) -> dict[str, dict[int, int]]:
        """Forward every published port; {service: {host port: container port}}."""
        out: dict[str, dict[int, int]] = {}
        for name in self.default_services():
            for spec in self.services[name].get("ports") or []:
                parts = str(spec).split(":")
                assert len(parts) == 3 and parts[0] == "127.0.0.1", \
                    f"{name}: publish on the host's loopback only ({spec})"
                host_port, container_port = int(parts[1]), int(parts[2])
                self.forwarders.append(Forwarder((HOST_ADDRESS, host_port), (self.ips[name], container_port)))
                out.setdefault(name, {})[host_port] = container_port
        return out

    def log(self, service: str) -> str:
        p = self.base / f"{service}.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""

    def close(self) -> None:
        for f in self.forwarders:
            f.close()
        for name in list(self.running):
            self.stop(name)
        for p in sorted(self.created_mount_points, key=lambda p: -len(p.parts)):
            try:
                p.rmdir()
            except OSError:
                pass


def can_unshare_mounts() -> str | None:
    if os.geteuid() != 0:
        return "needs root for mount namespaces (unshare --mount)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    res = subprocess.run(["unshare", "--mount", "sh", "-c", "mount --bind /etc/hostname /etc/hostname"],
                         capture_output=True, text=True, timeout=30, check=False)
    return None if res.returncode == 0 else f"unshare --mount does not work here: {res.stderr.strip()}"


@pytest.fixture
def topology(tmp_path, procs):
    reason = can_unshare_mounts()
    if reason:
        pytest.skip(reason)
    t = ComposeTopology(tmp_path, procs)
    try:
        yield t
    finally:
        t.close()
        for name in t.services:
            if (tmp_path / f"{name}.log").exists():
                print(f"===== {name} (last lines) =====\n{t.log(name)}")


def sink_messages(t: ComposeTopology, marker: str) -> list[Path]:
    store = [t.volume_dir(src) for src, target in (v.split(":")[:2] for v in t.services["sink"]["volumes"])
             if not src.startswith(".")]
    return [p for d in store for p in (d / "new").glob("*") if marker.encode() in p.read_bytes()]


def test_compose_services_run_as_their_command_lines_and_deliver_mail(topology):
    t = topology
    services = t.default_services()
    assert {"node1", "node2", "node3", "sink"} <= set(services)
    assert "analytics" not in services  # under a profile: `up -d` does not need it
    for name in services:
        t.up(name)
    published = t.publish()
    node_port = {name: next(iter(ports)) for name, ports in published.items()}
    assert set(node_port) == {"node1", "node2", "node3"}

    # Relayed through node1 to the sink (shadowed on node3, the other site, before the 250).
    marker = f"compose-{uuid.uuid4()}"
    res = swaks(node_port["node1"], "--to", "carol@elsewhere.test", "--from", "zed@example.test",
                "--header", f"Subject: {marker}", server=HOST_ADDRESS)
    assert "250 2.0.0 Ok: queued as" in res.stdout, res.stdout + res.stderr
    wait_for(lambda: sink_messages(t, marker), timeout=30, what="the message in the sink's volume")

    # Sent to node3, for a mailbox database on node1: travels node3 -> node1 by service name.
    res = swaks(node_port["node3"], "--to", "alice@example.test", "--from", "zed@example.test",
                "--header", f"Subject: {marker}-local", server=HOST_ADDRESS)
    assert "250 2.0.0 Ok: queued as" in res.stdout, res.stdout + res.stderr
    mailboxes = t.volume_dir("node1-mailboxes")
    wait_for(lambda: MailboxStore(mailboxes).list("alice@example.test"), timeout=30,
             what="alice's message in node1's mailbox volume")

    # `docker compose exec node1 transportd ...`: the environment alone finds the config.
    res = t.exec("node1", "transportd", "tracking", "search", "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    events = {r["event-id"] for r in rows}
    assert {r["server-ip"] for r in rows if r["event-id"] == "RECEIVE"} == {t.ips["node1"]}
    assert {"RECEIVE", "HAREDIRECT", "SENDEXTERNAL", "DELIVER"} <= events, events
    # Everything landed in the named volumes, not in the image's filesystem.
    assert (t.volume_dir("node1-queue") / "queue.db").is_file()
    assert list(t.volume_dir("node1-msgtrk").glob("MSGTRK*.LOG"))
    assert list(t.volume_dir("node3-msgtrk").glob("MSGTRK*.LOG"))
    # The node's metrics listener (inside the compose network) counts the traffic.
    cfg = tomllib.loads(config_of(t.compose, "node1").read_text())
    mhost, _, mport = cfg["metrics"]["listen"].rpartition(":")
    with socket.create_connection((t.ips[mhost], int(mport)), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        text = b""
        while chunk := s.recv(65536):
            text += chunk
    assert re.search(rb'transportd_messages_received_total\{connector="frontend"\} 1\.0', text), text[-2000:]
    # The series an on-call operator alerts on (config/compose/transportd-rules.yml uses them).
    for series in (rb'transportd_delivery_attempts_total\{delivery_type="smtp",result="delivered"\} 1\.0',
                   rb'transportd_connections_limit\{connector="frontend"\}', rb'transportd_connections_open\{',
                   rb'# TYPE transportd_shadow_heartbeat_consecutive_failures gauge',
                   rb'# TYPE transportd_queue_oldest_message_age_seconds gauge',
                   rb'transportd_poison_queue_length 0\.0', rb'transportd_queue_database_up 1\.0',
                   rb'process_cpu_seconds_total', rb'python_gc_objects_collected_total'):
        assert re.search(series, text), (series, text[-3000:])

    # `docker compose restart node1` keeps a queued message: the sink is down, node1 restarts.
    t.stop("sink")
    marker2 = f"compose-{uuid.uuid4()}"
    res = swaks(node_port["node1"], "--to", "dave@elsewhere.test", "--from", "zed@example.test",
                "--header", f"Subject: {marker2}", server=HOST_ADDRESS)
    assert "250 2.0.0 Ok: queued as" in res.stdout, res.stdout + res.stderr
    t.stop("node1")
    t.up("node1")
    queued = t.exec("node1", "transportd", "message", "list", "--json")
    assert queued.returncode == 0, queued.stderr
    assert [json.loads(line)["subject"] for line in queued.stdout.splitlines()] == [marker2]
    t.up("sink")
    retry = t.exec("node1", "transportd", "queue", "retry", "smarthost:sink:2500")
    assert retry.returncode == 0, retry.stderr
    wait_for(lambda: sink_messages(t, marker2), timeout=60, what="the queued message after the restart")


def test_health_fails_for_a_listener_that_does_not_greet(tmp_path):
    """The healthcheck command must be able to fail: nothing listening, not an SMTP greeting, a
    421 (said as text: it was a Python bytes repr, b'421 4.3.2 ...\\r\\n'), or a close."""
    from conftest import free_port
    closed = free_port()
    answers = {b"HTTP/1.0 400 Bad Request\r\n\r\n": "answered HTTP/1.0 400 Bad Request",
               b"421 4.3.2 Too many connections, try again later\r\n":
                   "answered 421 4.3.2 Too many connections, try again later",
               b"": "closed the connection without a greeting"}
    servers, ports = {}, {}
    for answer in answers:
        server = socket.create_server(("127.0.0.1", 0))
        servers[answer], ports[answer] = server, server.getsockname()[1]

        def talk(server: socket.socket = server, answer: bytes = answer) -> None:
            conn, _ = server.accept()
            conn.sendall(answer)
            conn.close()
        threading.Thread(target=talk, daemon=True).start()
    try:
        res = subprocess.run([sys.executable, "-m", "transportd", "health", "--timeout", "3",
                              "--server", f"127.0.0.1:{closed}",
                              *(a for p in ports.values() for a in ("--server", f"127.0.0.1:{p}"))],
                             capture_output=True, text=True, timeout=60, check=False,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        for server in servers.values():
            server.close()
    assert res.returncode == 1
    assert f"127.0.0.1:{closed}: Connection refused" in res.stderr
    for answer, said in answers.items():
        assert f"127.0.0.1:{ports[answer]}: {said}\n" in res.stderr, res.stderr
    assert "b'" not in res.stderr and "\\r" not in res.stderr, res.stderr
    # A --server that is no address is bad input (exit 2), not an unhealthy listener; nothing is tried.
    res = subprocess.run([sys.executable, "-m", "transportd", "health", "--server", "nonsense"],
                         capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "--server" in res.stderr and "nonsense" in res.stderr, res.stderr
    assert "unhealthy" not in res.stderr
