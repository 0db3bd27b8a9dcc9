"""RFC 3461 DSN parameters: MAIL's ``RET=`` and ``ENVID=``, RCPT's ``NOTIFY=`` and ``ORCPT=``.

Pure functions over text, no I/O. The receive connectors check the parameters (case kept:
aiosmtpd upper-cases what it hands over, and ENVID and ORCPT are the sender's own text) and the
queue stores them as received, one text per message (``RET=HDRS ENVID=QQ314159``) and one per
recipient (``NOTIFY=SUCCESS,FAILURE ORCPT=rfc822;bob@example.com``). Delivery passes them on
unchanged to a next hop that offers DSN (RFC 3461 section 5.2); the outcomes read from them
whether the sender is told of a delivery, a delay or a failure, and what the notice carries.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAIL_KEYS = ("RET", "ENVID")
RCPT_KEYS = ("NOTIFY", "ORCPT")

SUCCESS, FAILURE, DELAY = "SUCCESS", "FAILURE", "DELAY"
_NOTIFY_VALUES = frozenset({SUCCESS, FAILURE, DELAY})

XTEXT = re.compile(r"(?:[!-*,-<>-~]|\+[0-9A-Fa-f]{2})+")
"""RFC 3461 4: xtext, printable ASCII but '+' and '=', with '+XX' for any other octet (also
RFC 4954's AUTH= parameter: smtp/server.py)."""
_UTF8_XTEXT = re.compile(r"(?:[!-*,-<>-~\u0080-\U0010ffff]|\+[0-9A-Fa-f]{2}|\\x\{[0-9A-Fa-f]{1,6}\})+")
"""RFC 6533 3: utf-8-addr-xtext / utf-8-addr-unitext, xtext with UTF-8 and ``\\x{HEX}`` too."""
_ADDR_TYPE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")
_ENVID_MAX = 100  # RFC 3461 4.4
_ORCPT_MAX = 500  # RFC 3461 4.2


def parse(raw: str, keys: tuple[str, ...]) -> tuple[str, str | None]:
    """The DSN parameters (of ``keys``) among a MAIL or RCPT argument's parameters ``raw``, as one
    text in the order given (``RET``/``NOTIFY`` values upper-cased, ENVID and ORCPT kept as sent),
    and the reason they are refused, or None. Other parameters are left alone."""
    out: dict[str, str] = {}
    for token in raw.split():
        key, eq, value = token.partition("=")
        key = key.upper()
        if key not in keys:
            continue
        if key in out:
            return "", f"{key} given twice"
        if not eq or not value:
            return "", f"{key} needs a value"
        error = _CHECKS[key](value)
        if error:
            return "", error
        out[key] = value.upper() if key in ("RET", "NOTIFY") else value
    return " ".join(f"{k}={v}" for k, v in out.items()), None


def _check_ret(value: str) -> str | None:
    return None if value.upper() in ("FULL", "HDRS") else "RET must be FULL or HDRS"


def _check_envid(value: str) -> str | None:
    if len(value) > _ENVID_MAX:
        return f"ENVID longer than {_ENVID_MAX} characters"
    if not XTEXT.fullmatch(value):
        return "ENVID is not xtext"
    decoded = xtext_decode(value)  # RFC 3461 4.4: printable US-ASCII (graphic and space), as Postfix checks
    return None if decoded.isascii() and decoded.isprintable() else "ENVID must be printable US-ASCII"


def _check_notify(value: str) -> str | None:
    words = value.upper().split(",")
    if words == ["NEVER"]:
        return None
    if len(set(words)) != len(words) or not set(words) <= _NOTIFY_VALUES:
        return "NOTIFY must be NEVER, or one or more of SUCCESS, FAILURE, DELAY"
    return None


def _check_orcpt(value: str) -> str | None:
    if len(value) > _ORCPT_MAX:
        return f"ORCPT longer than {_ORCPT_MAX} characters"
    addr_type, semi, address = value.partition(";")
    if not semi or not _ADDR_TYPE.fullmatch(addr_type) or not address:
        return "ORCPT must be addr-type;xtext"
    utf8 = addr_type.lower() == "utf-8"
    if not (_UTF8_XTEXT if utf8 else XTEXT).fullmatch(address):
        return "ORCPT's address is not xtext"
    return None if xtext_decode(address, utf8).isprintable() else "ORCPT's address holds control characters"


_CHECKS = {"RET": _check_ret, "ENVID": _check_envid, "NOTIFY": _check_notify, "ORCPT": _check_orcpt}


def value(params: str, key: str) -> str | None:
    """The value of ``key`` in a stored parameter text, or None."""
    for token in params.split():
        k, _, v = token.partition("=")
        if k == key:
            return v
    return None


def wants(params: str, kind: str) -> bool:
    """Whether a recipient's sender is told of ``kind`` (SUCCESS, FAILURE or DELAY). Without
    NOTIFY: failures and delays (RFC 3461 4.1: the default is FAILURE, and delays MAY be told),
    never a success; NOTIFY=NEVER: nothing."""
    notify = value(params, "NOTIFY")
    if notify is None:
        return kind in (FAILURE, DELAY)
    return kind in notify.split(",")


def xtext_encode(text: str) -> str:
    """RFC 3461 4's xtext of ``text``'s UTF-8: '+XX' for '+', '=' and every octet outside '!'..'~'."""
    return "".join(chr(b) if 0x21 <= b <= 0x7E and b not in (0x2B, 0x3D) else f"+{b:02X}"
                   for b in text.encode("utf-8", "surrogateescape"))


def xtext_decode(text: str, utf8: bool = False) -> str:
    """RFC 3461 4's xtext decoded: '+XX' is the octet XX (octets read as UTF-8, an undecodable one
    as U+FFFD); with ``utf8`` (RFC 6533's utf-8-addr-xtext, ORCPT's ``utf-8`` type) a ``\\x{HEX}``
    is the character too (in plain xtext it is text: a backslash is an xtext character)."""
    out = bytearray()
    pos = 0
    for m in (_ESCAPE if utf8 else _PLUS_ESCAPE).finditer(text):
        out += text[pos:m.start()].encode("utf-8")
        if m.group(1):
            out.append(int(m.group(1), 16))
        else:
            code = int(m.group(2), 16)
            out += (chr(code) if code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF else "\ufffd").encode("utf-8")
        pos = m.end()
    out += text[pos:].encode("utf-8")
    return out.decode("utf-8", "replace")


_ESCAPE = re.compile(r"\+([0-9A-Fa-f]{2})|\\x\{([0-9A-Fa-f]{1,6})\}")
_PLUS_ESCAPE = re.compile(r"\+([0-9A-Fa-f]{2})()")


def envid_of(params: str) -> str | None:
    """The message's ENVID, decoded (for the DSN's Original-Envelope-Id), or None."""
    envid = value(params, "ENVID")
    return xtext_decode(envid) if envid is not None else None


def orcpt_of(params: str) -> str | None:
    """The recipient's ORCPT as ``type;address``, its address decoded (the DSN's
    Original-Recipient), or None."""
    orcpt = value(params, "ORCPT")
    if orcpt is None:
        return None
    addr_type, _, address = orcpt.partition(";")
    return f"{addr_type};{xtext_decode(address, addr_type.lower() == 'utf-8')}"


def returns_full(params: str) -> bool:
    """RET=FULL: a notice carries the whole message, not only its headers (the default)."""
    return value(params, "RET") == "FULL"


class DsnRequest:
    """What a message's sender asked of DSNs, for a transaction that passes it on (RFC 3461 5.2):
    MAIL's parameters, and each recipient's by its address (any case)."""

    __slots__ = ("mail", "rcpt")

    def __init__(self, mail: str, rcpt: dict[str, str]):
        self.mail = mail
        self.rcpt = {a.lower(): p for a, p in rcpt.items() if p}

    @classmethod
    def of(cls, mail: str, addresses: Sequence[str], params: Sequence[str]) -> DsnRequest | None:
        """From stored texts (``params`` parallel to ``addresses``); None when there are none."""
        if not mail and not any(params):
            return None
        return cls(mail, dict(zip(addresses, params)))

    def mail_params(self) -> list[str]:
        return self.mail.split()

    def rcpt_params(self, address: str) -> str:
        return self.rcpt.get(address.lower(), "")
