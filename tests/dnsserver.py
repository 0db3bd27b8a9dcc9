"""A small authoritative DNS server on loopback (UDP) for tests: MX and address lookups of next
hops go over real sockets to it, as the node's would to its resolver (``delivery.external_dns_servers``).

``records``: name -> {type: [rdata text]}, e.g. ``{"far.test": {"MX": ["10 mx1.far.test."]},
"mx1.far.test": {"A": ["127.0.0.1"]}}``. A name not in it is NXDOMAIN; a type it lacks is an empty
answer (NOERROR, no data); a name in ``failing`` gets SERVFAIL. Editable while it runs: answers
carry ``ttl`` (0 by default, so a resolver's cache keeps none).
"""

from __future__ import annotations

import socket
import threading
from typing import Self

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset


class TestDnsServer:
    __test__ = False  # not a pytest class

    def __init__(self, host: str = "127.0.0.1"):
        self.records: dict[str, dict[str, list[str]]] = {}
        self.failing: set[str] = set()
        self.queries: list[tuple[str, str]] = []
        self.ttl = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
            except Exception:  # noqa: BLE001, S112 - not a DNS query: no answer, as a server drops it
                continue
            self._sock.sendto(self.answer(query).to_wire(), peer)

    def answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        self.queries.append((name, rdtype))
        if name in self.failing:
            response.set_rcode(dns.rcode.SERVFAIL)
        elif name not in self.records:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif self.records[name].get(rdtype):
            response.answer.append(dns.rrset.from_text_list(question.name, self.ttl, "IN", rdtype,
                                                            self.records[name][rdtype]))
        return response
