"""What a message asks of a next hop: SMTPUTF8 (RFC 6531/6532) and 8BITMIME (RFC 6152).

Pure functions, no I/O. Given how a message was received (the SMTPUTF8 MAIL
parameter, BODY=) and what a next hop advertised in its EHLO, ``plan_send``
returns the MAIL parameters to send, the message bytes to send (converted to 7 bit
when the next hop has no 8BITMIME, as Postfix does), or the reply that fails the
recipients with no attempt at all: a message that needs SMTPUTF8 is never offered
to a next hop without it (RFC 6531 section 3.4), and 8-bit data is never sent
unannounced (nor is a NUL in the body, which 7bit data may not hold either: RFC
2045 2.7; its part is converted too). The addresses and headers themselves are
never changed: they are sent byte for byte as received (UTF-8). The one exception is a DSN (the null
sender) in the RFC 6533 form to an ASCII address: for a next hop without SMTPUTF8
it becomes the classic 7-bit DSN (``dsn.downgrade_dsn``), since a DSN that fails
is reported to no one. Addresses are kept as written for a U-label domain too:
RFC 6531 would let an ASCII local part go to a next hop without SMTPUTF8 with its
domain as the A-label, but the message's own headers then still name the U-label
(5.6.9 for them anyway), and the recipient would reach the next hop spelt otherwise
than the sender wrote it; so it is failed 5.6.7 as any other non-ASCII address.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from transportd.smtp.dsn import downgrade_dsn
from transportd.smtp.mime7bit import needs_smtputf8_headers, to_7bit

# RFC 6531 section 3.6 / RFC 3463 enhanced codes used when no attempt is made.
NO_SMTPUTF8_ADDRESS = ("550 5.6.7 Non-ASCII address not permitted: the next hop does not support SMTPUTF8 "
                       "(RFC 6531 3.4)")
NO_SMTPUTF8_HEADERS = ("550 5.6.9 UTF-8 header message cannot be transferred: the next hop does not support "
                       "SMTPUTF8 (RFC 6531 3.4)")
NO_CONVERSION = "554 5.6.3 Conversion required but not supported: 8-bit message to a next hop without 8BITMIME"


def is_ascii(text: str) -> bool:
    return text.isascii()


def needs_smtputf8(sender: str, recipients: Iterable[str], data: bytes, received_smtputf8: bool) -> bool:
    """True when the message cannot travel without SMTPUTF8: a non-ASCII envelope address, or
    UTF-8 headers in a message received as SMTPUTF8 (RFC 6532)."""
    if not sender.isascii() or not all(r.isascii() for r in recipients):
        return True
    return bool(received_smtputf8) and needs_smtputf8_headers(data)


def message_parameters(sender: str, recipients: Iterable[str], data: bytes, *, smtputf8: bool,
                       body_type: str) -> list[str]:
    """The MAIL parameters for a next hop that has every extension (a peer of the cluster)."""
    out = []
    if needs_smtputf8(sender, recipients, data, smtputf8):
        out.append("SMTPUTF8")
    if body_type.upper() == "8BITMIME" or not data.isascii():
        out.append("BODY=8BITMIME")
    return out


@dataclass(frozen=True)
class SendPlan:
    options: list[str]      # MAIL parameters: SMTPUTF8, BODY=8BITMIME
    data: bytes             # the message as it is to be sent
    error: str | None = None  # set: fail the recipients with this reply, make no attempt
    converted: bool = False  # the body was converted to 7 bit (quoted-printable)
    downgraded: bool = False  # an RFC 6533 DSN sent as the classic 7-bit DSN (RFC 3464)


def plan_send(sender: str, recipients: Iterable[str], data: bytes, *, smtputf8: bool, body_type: str,
              next_hop_smtputf8: bool, next_hop_8bitmime: bool) -> SendPlan:
    """MAIL parameters and bytes for one next hop, or the reason it gets no attempt."""
    recipients = list(recipients)
    options: list[str] = []
    if needs_smtputf8(sender, recipients, data, smtputf8):
        if not next_hop_smtputf8:
            ascii_envelope = sender.isascii() and all(r.isascii() for r in recipients)
            # A DSN to an ASCII sender: said in 7 bit (RFC 6533 3, as Postfix and Exchange do), not
            # lost, which a failed DSN would be: no one is told of it.
            classic = downgrade_dsn(data) if ascii_envelope and not sender else None
            if classic is not None:
                plan = plan_send(sender, recipients, classic, smtputf8=False, body_type="", next_hop_smtputf8=False,
                                 next_hop_8bitmime=next_hop_8bitmime)
                return replace(plan, downgraded=plan.error is None)
            return SendPlan([], data, NO_SMTPUTF8_HEADERS if ascii_envelope else NO_SMTPUTF8_ADDRESS)
        options.append("SMTPUTF8")
    eight_bit = not data.isascii()
    if next_hop_8bitmime:
        if body_type.upper() == "8BITMIME" or eight_bit:
            options.append("BODY=8BITMIME")
    elif eight_bit or b"\0" in data.partition(b"\r\n\r\n")[2]:  # a NUL is not 7bit data either (RFC 2045 2.7)
        converted = to_7bit(data)
        head_ok = "SMTPUTF8" in options or not needs_smtputf8_headers(converted)
        body = converted.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in converted else b""
        if not head_ok or not body.isascii():
            return SendPlan(options, data, NO_CONVERSION)
        return SendPlan(options, converted, converted=True)
    return SendPlan(options, data)
