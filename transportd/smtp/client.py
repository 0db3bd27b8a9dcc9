"""Outbound SMTP sessions (aiosmtplib): next-hop hosts, connecting, the envelope sent byte for byte.

It owns finding a next hop's hosts (MX by preference, equal ones in random order, RFC 5321 5.1; a null MX
is permanent, RFC 7505), opening a session to the first host that answers, and
the MAIL/RCPT commands of every session of ours. It never reads the queue or
decides an outcome (node/connectors.py does). aiosmtplib's ``mail()``/``rcpt()`` re-parse the address (``quote_address``) and
encode it as ASCII unless told otherwise, which fails on an internationalized
address (RFC 6531) and may rewrite an unusual but valid one. Every session of
ours (shadow copies, hop-by-hop, smart host, MX) sends MAIL FROM and RCPT TO
through these instead: the address exactly as received, UTF-8 encoded, in angle
brackets. Deciding *whether* SMTPUTF8 may be used is ``envelope.plan_send``'s job.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Iterable

import aiosmtplib

from transportd.errors import PEER_FAILURES, NextHopPermanentError, NextHopUnavailable


@dataclass
class SmtpTarget:
    host: str
    port: int


def order_mx(records: Iterable[tuple[int, str]], rng: random.Random | None = None) -> list[str]:
    """MX host names by preference, hosts of equal preference in a random order (RFC 5321 5.1:
    "the SMTP client SHOULD pick one at random"), so their load is spread; empty names dropped."""
    shuffle = (rng or random).random
    keyed = sorted((pref, shuffle(), host) for pref, host in records)
    return [host for _, _, host in keyed if host]


async def resolve_mx(domain: str, port: int) -> list[SmtpTarget]:
    """MX hosts by preference (equal ones shuffled), else the domain's own address (RFC 5321 5.1)."""
    import dns.asyncresolver
    import dns.exception
    import dns.resolver
    try:
        answer = await dns.asyncresolver.resolve(domain, "MX", lifetime=10)
        hosts = order_mx((r.preference, str(r.exchange).rstrip(".")) for r in answer)
        if not hosts:
            raise NextHopPermanentError(f"556 5.1.10 {domain} does not accept mail (null MX, RFC 7505)")
        return [SmtpTarget(h, port) for h in hosts]
    except dns.resolver.NoAnswer:
        return [SmtpTarget(domain, port)]
    except dns.resolver.NXDOMAIN:
        raise NextHopPermanentError(f"550 5.1.2 Host or domain name not found: {domain}") from None
    except dns.exception.DNSException as exc:
        raise NextHopUnavailable(f"MX lookup for {domain} failed: {exc}") from None


async def connect(targets: list[SmtpTarget], *, local_hostname: str, timeout: float, connect_timeout: float,
                  tls: dict[str, Any]) -> tuple[aiosmtplib.SMTP, SmtpTarget]:
    """A session (EHLO done) to the first target that answers; NextHopUnavailable when none does."""
    errors = []
    for t in targets:
        client = aiosmtplib.SMTP(hostname=t.host, port=t.port, local_hostname=local_hostname,
                                 timeout=timeout, **tls)
        try:
            await asyncio.wait_for(client.connect(timeout=connect_timeout), connect_timeout + 1)
            await client.ehlo()
            return client, t
        except PEER_FAILURES as exc:
            errors.append(f"{t.host}:{t.port}: {describe(exc)}")
            close(client)
    raise NextHopUnavailable("; ".join(errors) or "no hosts for next hop")


def close(client: aiosmtplib.SMTP) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken session
        pass


async def rset_ok(client: aiosmtplib.SMTP) -> bool:
    """RSET after a failure in the middle of a transaction: True when the session can go on."""
    if not client.is_connected:
        return False
    try:
        await asyncio.wait_for(client.rset(), 10)
        return True
    except Exception:  # noqa: BLE001
        return False


async def rset(client: aiosmtplib.SMTP) -> None:
    try:
        await client.rset()
    except aiosmtplib.SMTPException:
        pass


async def quit(client: aiosmtplib.SMTP) -> None:
    try:
        await asyncio.wait_for(client.quit(), 5)
    except Exception:  # noqa: BLE001 - the session is over either way
        close(client)


def reply_of(exc: aiosmtplib.SMTPResponseException) -> str:
    return f"{exc.code} {exc.message}".strip()


def describe(exc: BaseException) -> str:
    """An exception as one short line for a reply or a log."""
    text = str(exc) or exc.__class__.__name__
    return text.replace("\r", " ").replace("\n", " ")[:300]


def _path(address: str) -> bytes:
    return b"<" + address.encode("utf-8", "surrogateescape") + b">"


async def mail(client: aiosmtplib.SMTP, sender: str, options: Iterable[str] = ()) -> aiosmtplib.SMTPResponse:
    """MAIL FROM:<sender> [options]; raises SMTPSenderRefused on anything but 250."""
    resp = await client.execute_command(b"MAIL", b"FROM:" + _path(sender),
                                        *(o.encode("ascii") for o in options))
    if resp.code != 250:
        raise aiosmtplib.SMTPSenderRefused(resp.code, resp.message, sender)
    return resp


async def rcpt(client: aiosmtplib.SMTP, recipient: str) -> aiosmtplib.SMTPResponse:
    """RCPT TO:<recipient>; raises SMTPRecipientRefused on anything but 250/251."""
    resp = await client.execute_command(b"RCPT", b"TO:" + _path(recipient))
    if resp.code not in (250, 251):
        raise aiosmtplib.SMTPRecipientRefused(resp.code, resp.message, recipient)
    return resp
