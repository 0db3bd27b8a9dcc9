"""A peer that accepts connections but never answers must not hold up the sender's 250 for long."""

from __future__ import annotations

import time

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
