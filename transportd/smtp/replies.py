"""Every SMTP reply the daemon sends, named by code and meaning.

The receive path uses these constants only; `enhance()` adds an RFC 3463
enhanced status code to a reply that lacks one (aiosmtpd's own replies), and
`translate()` rewrites aiosmtpd's built-in wording into ours. Nothing here does
I/O.
"""

from __future__ import annotations

import re

S220_GREETING = "220 {host} ESMTP transportd ready"
S220_READY_FOR_TLS = "220 2.0.0 Ready to start TLS"  # RFC 2034 exempts the greeting only, not STARTTLS's 220
S214_HELP = "214 2.0.0 {text}"  # HELP's reply (RFC 5321 4.2): the commands served, or one's syntax
S221_BYE = "221 2.0.0 Bye"
S250_OK = "250 2.0.0 OK"
S250_SENDER_OK = "250 2.1.0 Sender OK"
S250_RECIPIENT_OK = "250 2.1.5 Recipient OK"
S250_QUEUED = "250 2.0.0 Ok: queued as {id}"
S354_START = "354 End data with <CR><LF>.<CR><LF>"
S421_TOO_MANY_CONNECTIONS = "421 4.3.2 Too many connections, try again later"
S421_TOO_MANY_FROM_SOURCE = "421 4.7.0 Too many connections from your address, try again later"
S421_TIMEOUT = "421 4.4.2 {host} Connection timed out"
S421_COMMAND_RATE = "421 4.7.0 Too many commands from your address, slow down"
S421_SHUTTING_DOWN = "421 4.3.2 Service shutting down"
S421_TOO_MANY_ERRORS = "421 4.7.0 Closing connection: too many errors"  # unrecognized commands
S451_INTERNAL = "451 4.3.0 Internal error, message not accepted; try again later"
S451_NOT_REDUNDANT = "451 4.4.0 Message failed to be made redundant"
S554_HOP_COUNT = "554 5.4.14 Hop count exceeded - possible mail loop"
S451_STORE_UNAVAILABLE = "451 4.3.0 Queue database unavailable; try again later"
S452_TOO_MANY_RECIPIENTS = "452 4.5.3 Too many recipients"
S500_LINE_TOO_LONG = "500 5.5.2 Line too long (RFC 5321 4.5.3.1.6)"
S500_COMMAND_TOO_LONG = "500 5.5.2 Command line too long"
S500_AUTH_LINE_TOO_LONG = "500 5.5.6 Authentication Exchange line is too long"  # RFC 4954 section 4
S500_UNRECOGNIZED = '500 5.5.1 Command unrecognized: "{command}"'
S500_BAD_SYNTAX = "500 5.5.2 Syntax error"
S501_BAD_ADDRESS = "501 5.1.3 Bad recipient address syntax"
S501_BAD_SENDER = "501 5.1.7 Bad sender address syntax"
S502_NOT_IMPLEMENTED = "502 5.3.3 Command not implemented"

SHADOW_REDUNDANCY_VERBS = ("XSHADOWREQUEST", "XSHADOW", "XQDISCARD", "XQUERYDISCARD", "XQSTATUS", "XRESUBMIT",
                           "XSHADOWADOPT")
"""Every verb of the shadow redundancy protocol (docs/PROTOCOL.md), the one list of them: the
transport connector serves each (redundancy/server.py, judged by redundancy/connection.py); every
other listener (the frontend) answers each S502_NOT_IMPLEMENTED, never 500 "unrecognized".
Listed here, at the bottom layer, so that both read it (redundancy/protocol.py names it VERBS)."""
S503_NEED_RCPT = "503 5.5.1 Bad sequence of commands: need RCPT"
S503_NEED_MAIL_RCPT = "503 5.5.1 Bad sequence of commands: need MAIL and RCPT"
S503_DATA_AFTER_BDAT = "503 5.5.1 Bad sequence of commands: DATA after BDAT"
S503_HELO_FIRST = "503 5.5.1 Send HELO or EHLO first"
S503_AUTH_NOT_ENABLED = "503 5.5.1 Error: authentication not enabled"
S503_AUTH_IN_TRANSACTION = "503 5.5.1 Error: MAIL transaction in progress"
S503_TLS_ACTIVE = "503 5.5.1 Error: TLS already active"
S504_HELP_TOPIC = "504 5.5.1 HELP topic not known; supported commands: {commands}"
S501_BDAT_SYNTAX = "501 5.5.4 Syntax: BDAT chunk-size [LAST]"
S501_BAD_PARAMETER = "501 5.5.4 Syntax error in parameters: {error}"
S530_AUTH_REQUIRED = "530 5.7.0 Authentication required"
S530_TLS_REQUIRED = "530 5.7.0 Must issue a STARTTLS command first"
S550_RELAY_DENIED = "550 5.7.1 Relaying denied"
S550_NO_POSTMASTER = ("550 5.1.1 No postmaster mailbox here: this node accepts mail for no domain "
                      "(routing.accepted_domains)")
S550_NOT_AUTHORIZED = "550 5.7.1 Not authorized"
S451_FORMER_PEER = "451 4.7.1 Not a configured peer of this node any more; try again later"
S553_UNDECLARED_UTF8 = "553 5.6.7 Must declare SMTPUTF8 to send unicode address"
S553_VRFY_MALFORMED = "553 5.1.3 Malformed address: could not VRFY {address}"
S552_MESSAGE_TOO_BIG = "552 5.3.4 Message size exceeds fixed maximum message size"
S552_HEADER_TOO_BIG = "552 5.3.4 Header size exceeds fixed maximum size"  # Exchange's words (MaxHeaderSize)
S554_NO_VALID_RECIPIENTS = "554 5.5.1 No valid recipients"

# aiosmtpd's wording -> ours (exact text, or a prefix when it ends with '*').
_AIOSMTPD = {
    "552 Error: Too much mail data": S552_MESSAGE_TOO_BIG,
    "552 Error: message size exceeds fixed maximum message size": S552_MESSAGE_TOO_BIG,
    "500 Line too long (see RFC5321 4.5.3.1.6)": S500_LINE_TOO_LONG,
    "500 Command line too long": S500_COMMAND_TOO_LONG,
    "500 Error: bad syntax": S500_BAD_SYNTAX,
    "503 Error: need RCPT command": S503_NEED_RCPT,
    "530 Must issue a STARTTLS command first": S530_TLS_REQUIRED,
    "221 Bye": S221_BYE,
    "250 OK": S250_OK,
    "553 5.1.3 Error: malformed address": "553 5.1.3 Malformed address",
    "220 Ready to start TLS": S220_READY_FOR_TLS,
}
# aiosmtpd's replies whose code RFC 5321 words otherwise: HELP's is 214 (4.2, 4.3.2; 504 for a
# topic that is no command here), a malformed VRFY argument is a malformed address (502 says VRFY
# is not implemented), a reply that closes the session is 421 (3.8).
_HELP = re.compile(r"^250 ((?:Syntax|Supported commands): .*)$")
_HELP_TOPIC = re.compile(r"^501 Supported commands: (.*)$")
_VRFY = re.compile(r"^502 Could not VRFY (.*)$")
_CLOSING = {"502 5.5.1 Too many unrecognized commands, goodbye.": S421_TOO_MANY_ERRORS}
_UNRECOGNIZED = re.compile(r'^500 Error: command "(.*)" not recognized$')
_HAS_ENHANCED = re.compile(r"^\d{3}[ -][245]\.\d{1,3}\.\d{1,3}(\s|$)")
_DEFAULT_DETAIL = {"2": "2.0.0", "4": "4.0.0", "5": "5.5.0"}
_SYNTAX_DETAIL = {"500": "5.5.2", "501": "5.5.4", "502": "5.5.1", "503": "5.5.1", "504": "5.5.4", "555": "5.5.4"}


def translate(reply: str) -> str:
    """Rewrite a built-in aiosmtpd reply into our wording with an enhanced code."""
    if reply in _AIOSMTPD:
        return _AIOSMTPD[reply]
    m = _UNRECOGNIZED.match(reply)
    if m:
        # The client's bytes are echoed: no CR, NUL or other control character may reach the wire.
        return S500_UNRECOGNIZED.format(command=re.sub(r"[^\x20-\x7e]", "?", m.group(1)[:40]))
    return _rfc_code(reply) or enhance(reply)


def _rfc_code(reply: str) -> str | None:
    """Ours for an aiosmtpd reply whose code RFC 5321 words otherwise, or None."""
    if m := _HELP.match(reply):
        return S214_HELP.format(text=m.group(1))
    if m := _HELP_TOPIC.match(reply):
        return S504_HELP_TOPIC.format(commands=m.group(1))
    if m := _VRFY.match(reply):
        return S553_VRFY_MALFORMED.format(address=m.group(1))  # wire_safe cleans the client's octets
    return _CLOSING.get(reply)


_UNSAFE = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


def wire_safe(reply: str) -> str:
    """A reply line that can go on the wire: control characters and undecodable octets (surrogate
    escapes of a client's bytes echoed back, e.g. by VRFY) become '?'."""
    return _UNSAFE.sub("?", reply)


def enhance(reply: str) -> str:
    """Add an enhanced status code (RFC 2034) to a single-line final reply lacking one.

    The greeting (220), EHLO continuation lines, 354 and 334 are left alone.
    """
    if len(reply) < 4 or reply[3] != " " or not reply[:3].isdigit():
        return reply
    code = reply[:3]
    if code in ("220", "354", "334") or _HAS_ENHANCED.match(reply):
        return reply
    detail = _SYNTAX_DETAIL.get(code) or _DEFAULT_DETAIL.get(code[0])
    if detail is None:
        return reply
    text = reply[4:]
    text = re.sub(r"^Error:\s*", "", text)
    return f"{code} {detail} {text}"


def is_permanent(code: int) -> bool:
    return 500 <= code <= 599


def is_transient(code: int) -> bool:
    return 400 <= code <= 499
