"""A peer that accepts connections but never answers must not hold up the sender's 250 for long."""

from __future__ import annotations

import time

from clusters import HEARTBEAT
from conftest import free_port, queued_id, silent_peer, swaks


def test_silent_peer_bounded_by_shadow_copy_timeout(make_node):
    with silent_peer() as silent_port:
        node = make_node(overrides={
            "transport": {"listen": f"127.0.0.1:{free_port()}"},
            "cluster": {"secret": "s3cret"},
            "shadow_redundancy": {"shadow_redundancy_enabled": True, "shadow_copy_timeout": 2},
        })
        with open(node.config_path, "a") as f:
            f.write(f'\n[[peers]]\nname = "silent.transportd.test"\nsite = "site-b"\n'
                    f'transport = "127.0.0.1:{silent_port}"\n')
        node.start()
        t0 = time.monotonic()
        res = swaks(node.port, "--to", "alice@example.test")
        elapsed = time.monotonic() - t0
        queued_id(res)  # accepted, unprotected (RejectMessageOnShadowFailure is false)
        assert 1.5 < elapsed < 8, elapsed
        fail = node.tracking(event_id="HAREDIRECTFAIL")
        assert len(fail) == 1
        context = fail[0]["source-context"]
        assert context.startswith("silent.transportd.test:"), context
        assert node.alive


def test_black_holed_primaries_are_promoted_within_the_span_plus_one_heartbeat(cluster):
    """Three primaries black-holed at once (SIGSTOP: connections are accepted by the kernel and
    never answered, as across a partition). node4 holds shadows of each; it promotes all three
    within ShadowResubmitTimeSpan + one heartbeat (+ the exchange's time-out): heartbeats run
    concurrently and promotion is decided by elapsed time, not by a count of slow failures."""
    import signal
    span = 3.0
    c = cluster(nodes=4, sites=1)  # one site: shadows rotate over every peer, node4 among them
    c.start()
    node4 = c["node4"]
    primaries = [c[f"node{i}"] for i in (1, 2, 3)]
    # The sink is down: nothing is delivered, so every shadow stays until the promotion.
    k = 0
    while not all(node4.shadow_row(p.name)["shadows"] for p in primaries):
        for p in primaries:
            queued_id(swaks(p.frontend_port, "--from", "a@example.test", "--to", f"r{k}@elsewhere.test",
                            server=p.host))
        k += 1
        assert k < 12, {p.name: node4.shadow_row(p.name) for p in primaries}
    stopped = time.monotonic()
    for p in primaries:
        p.proc.send_signal(signal.SIGSTOP)
    try:
        limit = max(1.0, HEARTBEAT / 2)
        deadline = span + HEARTBEAT + limit + 1.5  # + scheduling slack on a loaded 2-core machine

        def promoted() -> set[str]:
            return {r["source-context"].split(" ")[0] for r in node4.tracking(event_id="RESUBMIT")}
        while promoted() != {p.name for p in primaries}:
            assert time.monotonic() - stopped < deadline, \
                f"promoted {sorted(promoted())} after {time.monotonic() - stopped:.1f}s (deadline {deadline:.1f}s)"
            time.sleep(0.1)
        reasons = {r["source-context"].split(" ", 1)[1] for r in node4.tracking(event_id="RESUBMIT")}
        assert reasons == {"(ShadowHeartbeatFailure)"}
    finally:
        for p in primaries:
            p.proc.send_signal(signal.SIGCONT)
