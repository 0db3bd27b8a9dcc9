from conftest import queued_id, swaks, wait_for


def test_local_and_smart_host_delivery(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()
    r = swaks(node.port, "--to", "alice@example.test", "--from", "bob@remote.test")
    local_id = queued_id(r)
    r = swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test")
    queued_id(r)
    wait_for(lambda: node.maildir_files("alice@example.test"), what="maildir file")
    wait_for(lambda: sink.messages(), what="message at the sink")
    events = {e["event-id"] for e in node.tracking()}
    assert {"RECEIVE", "DELIVER", "SENDEXTERNAL"} <= events
    assert node.tracking(event_id="DELIVER")[0]["internal-message-id"] == str(local_id)
