"""The envelope commands of our outbound sessions (aiosmtplib), sent byte for byte.

aiosmtplib's ``mail()``/``rcpt()`` re-parse the address (``quote_address``) and
encode it as ASCII unless told otherwise, which fails on an internationalized
address (RFC 6531) and may rewrite an unusual but valid one. Every session of
ours (shadow copies, hop-by-hop, smart host, MX) sends MAIL FROM and RCPT TO
through these instead: the address exactly as received, UTF-8 encoded, in angle
brackets. Deciding *whether* SMTPUTF8 may be used is ``envelope.plan_send``'s job.
"""

from __future__ import annotations

from typing import Iterable

import aiosmtplib


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
