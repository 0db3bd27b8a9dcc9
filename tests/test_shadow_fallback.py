"""Regression (found by `transportd chaos`, docs/reliability.md): a silent remote-site peer must
not use up the whole shadow_copy_timeout and leave a healthy local-site peer untried.

Seen in the long chaos run: while node2's link to node3 (the preferred remote-site peer) was
partitioned, every message node2 received waited the full shadow_copy_timeout on node3, was
accepted unprotected (HAREDIRECTFAIL) although node1 was healthy, and was lost when node2
was wiped next. Here node A prefers a black-hole remote peer; node B (a real process, same
site) must get the shadow, within the timeout.
"""

from __future__ import annotations

import time

from conftest import free_port, queued_id, silent_peer, swaks, wait_port

from transportd.devtools import cluster as cluster_mod

SECRET = "fallback-secret"


def test_silent_remote_peer_does_not_starve_the_local_one(make_node):
    with silent_peer() as silent_port:
        ports = {"a": free_port(), "b": free_port()}
        shadow = {"shadow_redundancy_enabled": True, "shadow_copy_timeout": 4}
        a = make_node("nodea", overrides={"transport": {"listen": f"127.0.0.1:{ports['a']}"},
                                          "cluster": {"secret": SECRET}, "shadow_redundancy": shadow})
        b = make_node("nodeb", overrides={"transport": {"listen": f"127.0.0.1:{ports['b']}"},
                                          "cluster": {"secret": SECRET}, "shadow_redundancy": shadow})
        a.config_path.write_text(cluster_mod.render_toml(a.sections, [
            {"name": "silent.transportd.test", "site": "site-b",
             "transport": f"127.0.0.1:{silent_port}"},
            {"name": b.name, "site": "site-a", "transport": f"127.0.0.1:{ports['b']}"}]))
        b.config_path.write_text(cluster_mod.render_toml(b.sections, [
            {"name": a.name, "site": "site-a", "transport": f"127.0.0.1:{ports['a']}"}]))
        b.start()
        wait_port("127.0.0.1", ports["b"], proc=b.proc)
        a.start()
        for i in range(2):
            t0 = time.monotonic()
            queued_id(swaks(a.port, "--to", "alice@example.test", "--header", f"Subject: fallback {i}"))
            assert time.monotonic() - t0 < 10
        redirects = a.tracking(event_id="HAREDIRECT")
        assert not a.tracking(event_id="HAREDIRECTFAIL"), "accepted unprotected with a healthy peer"
        assert len(redirects) == 2
        assert all(r["source-context"].startswith(f"{b.name}=250 2.6.0") for r in redirects), redirects
        assert len(b.tracking(event_id="HARECEIVE")) == 2
