"""A peer that accepts connections but never answers must not hold up the sender's 250 for long."""

from __future__ import annotations

import socket
import threading
import time

from conftest import free_port, queued_id, swaks


def test_silent_peer_bounded_by_shadow_copy_timeout(make_node):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing():
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=accept_and_say_nothing, daemon=True)
    t.start()
    try:
        node = make_node(overrides={
            "transport": {"listen": f"127.0.0.1:{free_port()}"},
            "cluster": {"secret": "s3cret"},
            "shadow_redundancy": {"shadow_redundancy_enabled": True, "shadow_copy_timeout": 2},
        })
        with open(node.config_path, "a") as f:
            f.write(f'\n[[peers]]\nname = "silent.transportd.test"\nsite = "site-b"\n'
                    f'transport = "127.0.0.1:{silent.getsockname()[1]}"\n')
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
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        silent.close()
