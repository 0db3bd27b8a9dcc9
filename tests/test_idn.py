"""Internationalized domain names: a U-label and its A-label are one domain (RFC 5890 2.3.2.1,
RFC 5891; RFC 6531 3.2 lets an SMTPUTF8 client send either).

``bücher.test`` is ``xn--bcher-kva.test`` and ``münchen.test`` is ``xn--mnchen-3ya.test``,
whichever spelling the configuration uses (accepted domains, send connector address spaces,
mailbox database rules) and whichever the client sends: one route, one mailbox, one relay
decision. The address goes on as the client spelt it. Real processes on loopback: nodes,
Python's smtplib as the client (it speaks SMTPUTF8), ``transportd sink`` as next hops (they
speak SMTPUTF8 and record the envelope as it arrived). The normalisation itself is unit-tested
first.
"""

from __future__ import annotations

import smtplib
import time

import pytest
from conftest import TransportdSink, wait_for, write_toml

from transportd.config import ConfigError, load_dict
from transportd.queue.routing import MAILBOX, SMART_HOST, NextHop, bifurcate, route_config
from transportd.smtp.addresses import domain_of, is_accepted, valid_address

BOOKS_U, BOOKS_A = "bücher.test", "xn--bcher-kva.test"
MUNICH_U, MUNICH_A = "münchen.test", "xn--mnchen-3ya.test"
LOCAL = NextHop("mailbox:local", MAILBOX, "local")


# --------------------------------------------------------------------------- normalisation

def test_config_keeps_a_u_label_domain_as_its_a_label() -> None:
    """accepted_domains, send connector address spaces and mailbox database rules take U-labels
    (any case, a final dot, ``*.``), kept as the A-label: one form to compare with."""
    cfg = load_dict({
        "routing": {"accepted_domains": ["Bücher.Test.", "*.MÜNCHEN.test", "xn--bcher-kva.test", "example.test"],
                    "mailbox_database_rules": ["*@Bücher.test=MDB02", "a*@*.münchen.test=MDB03"]},
        "send_connectors": [{"name": "faß", "address_spaces": ["faß.test", "*.ÄRGER.test"],
                             "smart_hosts": "relay.test:25"}]})
    assert cfg.routing.accepted_domains == [BOOKS_A, "*." + MUNICH_A, BOOKS_A, "example.test"]
    assert cfg.routing.mailbox_database_rules == [f"*@{BOOKS_A}=MDB02", f"a*@*.{MUNICH_A}=MDB03"]
    # IDNA 2008 (UTS 46, non-transitional): ß stays ß, not IDNA 2003's "ss".
    assert cfg.send_connectors[0].address_spaces == ("xn--fa-hia.test", "*.xn--rger-koa.test")


@pytest.mark.parametrize("sections, key", [
    ({"routing": {"accepted_domains": ["a☃.test"]}}, "routing.accepted_domains: "),
    ({"routing": {"accepted_domains": ["xn--zz.test"]}}, "routing.accepted_domains: "),
    ({"send_connectors": [{"name": "x", "address_spaces": ["ab--ü.test"], "smart_hosts": "r.test"}]},
     "send_connectors[0].address_spaces: "),
    ({"routing": {"mailbox_database_rules": ["*@bü*.test=MDB02"]}}, "routing.mailbox_database_rules: "),
])
def test_config_refuses_an_invalid_idn_naming_the_key(sections, key) -> None:
    with pytest.raises(ConfigError) as err:
        load_dict(sections)
    text = str(err.value)
    assert key in text, text
    assert "IDNA 2008" in text or "A-label" in text, text


def test_domain_spellings_compare_as_one() -> None:
    from transportd.smtp.addresses import address_key, canonical_domain

    for spelling in (BOOKS_U, "BÜCHER.TEST", BOOKS_A, "XN--BCHER-KVA.test.", "bu\u0308cher.test"):
        assert canonical_domain(spelling) == BOOKS_A, spelling  # NFC too: u + combining diaeresis
        assert domain_of(f"alice@{spelling}") == BOOKS_A
        assert is_accepted(spelling, [BOOKS_A]) and is_accepted(spelling, [BOOKS_U])
        assert is_accepted("sub." + spelling, ["*." + BOOKS_U])
    assert address_key("Alice@Bücher.test") == address_key("alice@XN--BCHER-KVA.TEST") == f"alice@{BOOKS_A}"
    # Invalid U-labels: no crash, no match, not a routable address (RFC 6531 3.3: U-labels only).
    for bad in ("a☃.test", "ab--ü.test", "ü" * 64 + ".test"):
        assert canonical_domain(bad) is None
        assert not is_accepted(bad, ["*.test", bad])
        assert not valid_address(f"alice@{bad}")
    assert valid_address(f"alice@{BOOKS_U}") and valid_address("δοκιμή@παράδειγμα.δοκιμή")


def test_route_and_bifurcate_see_one_domain_and_keep_the_spelling() -> None:
    cfg = load_dict({"routing": {"accepted_domains": [BOOKS_A], "smart_host": "relay.test:2500",
                                 "mailbox_database_rules": [f"bob@{BOOKS_A}=MDB02"]},
                     "send_connectors": [{"name": "munich", "address_spaces": [MUNICH_A],
                                          "smart_hosts": "munich.test:25"}]})
    assert route_config(f"alice@{BOOKS_U}", cfg) == LOCAL
    assert route_config(f"bob@{BOOKS_U}", cfg) == NextHop("mailbox:MDB02", MAILBOX, "MDB02")
    munich = NextHop("smarthost:munich.test:25", SMART_HOST, "munich.test:25")
    assert route_config(f"hans@{MUNICH_U}", cfg) == munich
    assert route_config("x@a☃.test", cfg) == NextHop("smarthost:relay.test:2500", SMART_HOST, "relay.test:2500")
    got = bifurcate([f"alice@{BOOKS_U}", f"ALICE@{BOOKS_A}", f"hans@{MUNICH_U}", f"fritz@{MUNICH_A}"], cfg)
    assert got == {LOCAL: [f"alice@{BOOKS_U}"], munich: [f"hans@{MUNICH_U}", f"fritz@{MUNICH_A}"]}


def test_both_spellings_share_one_mailbox_folder() -> None:
    from transportd.queue.mailbox import mailbox_name
    assert mailbox_name(f"Alice@{BOOKS_U}") == mailbox_name(f"alice@{BOOKS_A}") == f"alice@{BOOKS_A}"


# --------------------------------------------------------------------------- real processes

def _session(node, source: str = "127.0.0.1") -> smtplib.SMTP:
    s = smtplib.SMTP("127.0.0.1", node.port, timeout=30, source_address=(source, 0))
    s.ehlo("client.test")
    return s


def _send(node, rcpts: list[str], *, source: str = "127.0.0.1") -> None:
    """One message with SMTPUTF8 to ``rcpts``, each RCPT answered 250."""
    data = (f"From: <bob@example.test>\r\nSubject: idn\r\nMessage-ID: <{time.time_ns()}@client.test>\r\n"
            "Date: Wed, 25 Nov 2026 10:00:00 +0000\r\n\r\nhello\r\n").encode()
    with _session(node, source) as s:
        s.mail("bob@example.test", ["SMTPUTF8"])
        for r in rcpts:
            code, reply = s.rcpt(r)
            assert code == 250, (r, code, reply)
        code, reply = s.data(data)
        assert code == 250, (code, reply)


def _tracked(node, event_id: str) -> list[tuple[str, dict]]:
    """(recipient, row) for each recipient of each tracking row of ``event_id``."""
    from transportd.tracking import search, split_list
    directory = node.data_dir / "msgtrk"
    rows = list(search(directory, event_id=event_id)) if directory.is_dir() else []
    return [(r, row) for row in rows for r in split_list(row["recipient-address"])]


def _envelopes(sink: TransportdSink) -> list[list[str]]:
    """The RCPT TO paths of each message the sink holds, as they came over the wire."""
    out = []
    for raw in sink.messages():
        line = next(x for x in raw.decode("utf-8").split("\r\n") if x.startswith("X-Sink-Rcpt-To: "))
        out.append([r.strip().strip("<>") for r in line.removeprefix("X-Sink-Rcpt-To: ").split(",")])
    return out


@pytest.mark.parametrize("accepted", [BOOKS_U, BOOKS_A])
def test_both_spellings_of_an_accepted_domain_are_delivered_locally(make_node, procs, accepted):
    """A node whose accepted domain is configured as U-label, and one as A-label: a trusted client's
    recipients in either spelling go to the one local mailbox (the two spellings of one address
    in one message: one recipient, one copy), never to the smart host, which gets only the
    foreign recipient. An address whose domain is no valid IDN is refused 501 5.1.3 / 5.1.7,
    never relayed."""
    smart = TransportdSink(procs)
    node = make_node(smart_host=smart.address, overrides={"routing": {"accepted_domains": [accepted]}}).start()
    _send(node, [f"alice@{BOOKS_U}", f"alice@{BOOKS_A}", "carol@elsewhere.test"])
    _send(node, [f"Alice@{BOOKS_A.upper()}"])
    _send(node, [f"alice@{BOOKS_U.upper()}"])
    files = wait_for(lambda: (f := node.maildir_files(f"alice@{BOOKS_U}")) and len(f) >= 3 and f,
                     what="three messages in alice's mailbox")
    assert sorted(files) == sorted(node.maildir_files(f"alice@{BOOKS_A}")), "two mailboxes for one address"
    assert [p.parent.parent.name for p in files] == [f"alice@{BOOKS_A}"] * 3
    wait_for(lambda: _envelopes(smart), what="the foreign recipient at the smart host")
    time.sleep(1)  # a wrongly relayed copy would have followed by now
    assert _envelopes(smart) == [["carol@elsewhere.test"]]
    assert [r for r, _ in _tracked(node, "SENDEXTERNAL")] == ["carol@elsewhere.test"]
    delivered = sorted(r for r, _ in _tracked(node, "DELIVER"))
    assert delivered == sorted([f"alice@{BOOKS_U}", f"Alice@{BOOKS_A.upper()}", f"alice@{BOOKS_U.upper()}"])
    with _session(node) as s:
        s.mail("bob@example.test", ["SMTPUTF8"])
        code, reply = s.rcpt("alice@a☃.test")
        assert (code, reply[:5]) == (501, b"5.1.3"), (code, reply)
        s.rset()
        code, reply = s.mail("bob@b☃.test", ["SMTPUTF8"])
        assert (code, reply[:5]) == (501, b"5.1.7"), (code, reply)


def test_an_untrusted_client_may_send_to_either_spelling_only(make_node, procs):
    """From outside the trusted networks: RCPT to the accepted domain in U-label (any case) and in
    A-label is 250, and the message is delivered; a foreign domain (U-label or not) is still 550
    5.7.1; a domain that is no valid IDN 501 5.1.3, not a relay decision."""
    smart = TransportdSink(procs)
    node = make_node(smart_host=smart.address, overrides={"routing": {"accepted_domains": [BOOKS_A, "example.test"]}})
    node.start()
    with _session(node, source="127.0.0.2") as s:
        s.mail("someone@remote.test", ["SMTPUTF8"])
        for rcpt in (f"alice@{BOOKS_U}", f"bob@{BOOKS_U.upper()}", f"carol@{BOOKS_A}"):
            code, reply = s.rcpt(rcpt)
            assert code == 250, (rcpt, code, reply)
        for rcpt in (f"hans@{MUNICH_U}", f"x@{BOOKS_U}.evil.test", "victim@foreign.test"):
            code, reply = s.rcpt(rcpt)
            assert (code, reply[:5]) == (550, b"5.7.1"), (rcpt, code, reply)
        code, reply = s.rcpt("alice@bü☃cher.test")
        assert (code, reply[:5]) == (501, b"5.1.3"), (code, reply)
        code, reply = s.data(b"Subject: from outside\r\n\r\nhi\r\n")
        assert code == 250, (code, reply)
    for rcpt in (f"alice@{BOOKS_A}", f"bob@{BOOKS_A}", f"carol@{BOOKS_U}"):
        wait_for(lambda r=rcpt: node.maildir_files(r), what=f"{rcpt} delivered")
    assert not smart.messages()


@pytest.mark.parametrize("munich_space, books_space", [(MUNICH_A, "*." + BOOKS_A), (MUNICH_U, "*." + BOOKS_U)],
                         ids=["A-label spaces", "U-label spaces"])
def test_send_connector_address_spaces_match_either_spelling(make_node, procs, munich_space, books_space):
    """Send connectors with an address space and a ``*.domain`` one (the domain and its
    subdomains), configured as A-labels or as U-labels: recipients in either spelling go to that
    connector's smart host, sent with the address as the client spelt it; the default smart host
    gets only the rest."""
    default, munich, books = TransportdSink(procs), TransportdSink(procs), TransportdSink(procs)
    node = make_node(smart_host=default.address)
    node.sections["send_connectors"] = [
        {"name": "munich", "address_spaces": [munich_space], "smart_hosts": [munich.address]},
        {"name": "books", "address_spaces": [books_space], "smart_hosts": [books.address]}]
    write_toml(node.config_path, node.sections)
    node.start()
    _send(node, [f"hans@{MUNICH_U}", f"fritz@{MUNICH_A}", f"Sepp@{MUNICH_U.upper()}", f"eva@shop.{BOOKS_A}",
                 f"max@{BOOKS_U}", "carol@elsewhere.test"])
    wait_for(lambda: munich.messages() and books.messages() and default.messages(),
             what="the message at each connector's smart host")
    assert [sorted(e) for e in _envelopes(munich)] == [sorted([f"hans@{MUNICH_U}", f"fritz@{MUNICH_A}",
                                                               f"Sepp@{MUNICH_U.upper()}"])]
    assert [sorted(e) for e in _envelopes(books)] == [sorted([f"eva@shop.{BOOKS_A}", f"max@{BOOKS_U}"])]
    assert _envelopes(default) == [["carol@elsewhere.test"]]
    sent = {r: row["connector-id"] for r, row in _tracked(node, "SENDEXTERNAL")}
    assert sent[f"hans@{MUNICH_U}"] == sent[f"fritz@{MUNICH_A}"] == f"smarthost:{munich.address}"
    assert sent[f"max@{BOOKS_U}"] == f"smarthost:{books.address}"
