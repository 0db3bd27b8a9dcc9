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
    # the SENDEXTERNAL row follows the sink's reply: wait for it, not only for the sink
    wait_for(lambda: {"RECEIVE", "DELIVER", "SENDEXTERNAL"} <= {e["event-id"] for e in node.tracking()},
             what="RECEIVE, DELIVER and SENDEXTERNAL rows")
    assert node.tracking(event_id="DELIVER")[0]["internal-message-id"] == str(local_id)
