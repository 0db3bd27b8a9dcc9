"""Node configuration: one TOML file per node, every key in one registry.

This module owns the list of configuration keys (section, name, Exchange name,
default, allowed range, meaning), the frozen Config built from it, the parsing
of durations and sizes, and validation. A bad file raises ConfigError with one
line naming the key and the problem; the CLI turns that into exit code 2. It
never touches the network or the queue, and a loaded Config is never changed.

``cfg.delivery.transient_failure_retry_interval``: one frozen dataclass per
section (NodeSettings, DeliverySettings, ...), generated from the registry, so
a misspelt attribute raises AttributeError and assigning one raises
FrozenInstanceError. A changed copy comes from ``cfg.with_overrides(...)``,
validated like a file.

Every numeric key has a range (``Key.limits``): Exchange's own limit where the
key is an Exchange setting, with floors lowered only where a node must run with
faster timers than Exchange allows (sub-second heartbeats, second-long
expirations). Unknown sections and keys are refused with the closest known
name; values that contradict each other are refused naming both keys.

Durations accept a number of seconds (``90``, ``0.5``), a unit string
(``"90s"``, ``"5m"``, ``"2h"``, ``"2d"``, ``"1h30m"``) or Exchange's TimeSpan
text (``"02:00:00"``, ``"2.00:00:00"``). Sizes accept bytes or ``"36MB"``,
``"10KB"``, ``"1GiB"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import idna

from .errors import ConfigError

# --------------------------------------------------------------------------- parsers

_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.IGNORECASE)
_TIMESPAN_RE = re.compile(r"^(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2}(?:\.\d+)?)$")
_SIZE_UNITS = {
    "b": 1, "kb": 1024, "kib": 1024, "mb": 1024**2, "mib": 1024**2,
    "gb": 1024**3, "gib": 1024**3,
}


def parse_duration(value: Any) -> float:
    """Seconds from an int/float, a unit string ('5m', '1h30m') or a TimeSpan ('02:00:00')."""
    if isinstance(value, bool):
        raise ValueError("expected a duration, got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value) if not isinstance(value, int) or abs(value) < 10**300 else math.inf
    elif isinstance(value, str):
        text = value.strip()
        m = _TIMESPAN_RE.match(text)
        if m:
            days, hours, minutes, secs = m.groups()
            if int(minutes) > 59 or float(secs) >= 60 or (days and int(hours) > 23):
                # A TimeSpan as Exchange reads it ([d.]hh:mm:ss): 02:99:00 is a typo, not 219 minutes.
                raise ValueError(f"a TimeSpan [d.]hh:mm:ss has minutes and seconds under 60 (and hours "
                                 f"under 24 after days), got {value!r}")
            seconds = int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + float(secs)
        else:
            try:
                seconds = float(text)
            except ValueError:
                pos, seconds = 0, 0.0
                for part in _DURATION_RE.finditer(text):
                    if text[pos:part.start()].strip():
                        break
                    seconds += float(part.group(1)) * _UNIT_SECONDS[part.group(2).lower()]
                    pos = part.end()
                if pos == 0 or text[pos:].strip():
                    raise ValueError(
                        f"expected a duration like 30, '90s', '5m', '2h', '2d' or '02:00:00', "
                        f"got {value!r}"
                    ) from None
    else:
        raise ValueError(f"expected a duration, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be a finite number >= 0, got {value!r}")
    return seconds


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like '36MB', '10KB', '1GiB'."""
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = (m.group(2) or "b").lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ValueError(f"expected a size like 1048576, '10KB' or '36MB', got {value!r}")
        number = float(m.group(1)) * _SIZE_UNITS[unit]
        if not math.isfinite(number):
            raise ValueError(f"a size must be a finite number, got {value!r}")
        size = int(number)
    else:
        raise ValueError(f"expected a size, got {type(value).__name__}")
    if size < 0:
        raise ValueError(f"a size must be >= 0, got {value!r}")
    return size


def parse_hostport(value: Any, default_port: int | None = None) -> tuple[str, int]:
    """('127.0.0.1', 2525) from '127.0.0.1:2525' or '[::1]:25'."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected 'host:port', got {value!r}")
    text = value.strip()
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\s]+)(?::(\d+))?", text)
    if not m:
        raise ValueError(f"expected 'host:port', got {value!r}")
    host = m.group(1) or m.group(3)
    if re.fullmatch(r"[0-9.]+", host):  # no host name is all digits (RFC 3696 2): an IPv4 address
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host} is not an IPv4 address") from None
    port_text = m.group(2) or m.group(4)
    if port_text is None:
        if default_port is None:
            raise ValueError(f"expected 'host:port' with a port, got {value!r}")
        port = default_port
    else:
        port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1-65535, got {port}")
    return host, port


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _workers(value: Any) -> int | str:
    """``auto`` (one receive process per usable core) or a number of processes."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected auto or a number of processes, got {value!r}")
    return value


def worker_count(cfg: Config) -> int:
    """The frontend's receive processes: ``frontend.workers``, ``auto`` = the usable cores (1 on one core)."""
    n = cfg.frontend.workers
    if n == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            return max(1, os.cpu_count() or 1)
    return int(n)


def frontend_bindings(cfg: Config) -> str:
    """The frontend's bindings as a log line says them: ``127.0.0.1:25, 127.0.0.1:465 (implicit TLS)``."""
    return ", ".join([*cfg.frontend.listen, *(f"{b} (implicit TLS)" for b in cfg.frontend.implicit_tls_listen)])


def tracking_fields(cfg: Config) -> tuple[str, ...]:
    """The MSGTRK fields this node writes (``tracking.format``)."""
    from transportd.tracking import FIELDS_2010, FIELDS_2016
    fmt = cfg.tracking.format
    if fmt == "auto":
        fmt = "exchange2010" if cfg.shadow_redundancy.version == "2010" else "exchange2016"
    return FIELDS_2010 if fmt == "exchange2010" else FIELDS_2016


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _host_name(value: Any) -> str:
    """A host name (RFC 1123 2.1): the EHLO name, the Received and tracking name, the peers' name
    for this node. Empty: the host's FQDN, found at load."""
    text = _str(value).strip()
    if text and (len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in text.rstrip(".").split("."))):
        raise ValueError(f"{text!r} is not a host name (letters, digits and hyphens in dot-separated labels): "
                         "it is the name the node gives in EHLO (RFC 5321 4.1.1.1)")
    return text.rstrip(".")


def _str_list(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {value!r}")
    return list(value)


def domain_key(domain: str) -> str:
    """A domain in the one form in which the node compares and routes it: lower case, no final dot,
    each U-label as its A-label (IDNA 2008 with UTS 46 mapping: ``BÜCHER.test``, ``bücher.test`` and
    ``xn--bcher-kva.test`` are one domain, RFC 5890 2.3.2.1; ``faß.de`` is ``xn--fa-hia.de``, not
    IDNA 2003's ``fass.de``). ASCII labels are only lower-cased. ValueError: a label that is no
    valid U-label (a symbol, a disallowed hyphen, one too long): never taken as some other domain."""
    text = domain.strip().rstrip(".")
    if text.isascii():
        return text.lower()
    try:
        mapped = idna.uts46_remap(text, std3_rules=False, transitional=False).rstrip(".")
        return ".".join(label if label.isascii() else idna.alabel(label).decode("ascii")
                        for label in mapped.split(".")).lower()
    except (idna.IDNAError, UnicodeError, ValueError) as exc:
        raise ValueError(f"{domain!r} is not a valid internationalized domain name (IDNA 2008): {exc}") from None


_DOMAIN_NAME = re.compile(r"(\*\.)?[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")


def _domain_name(text: str) -> str:
    """One configured domain (``*.domain`` too), U-label or A-label, in its ``domain_key`` form;
    an ``xn--`` label must be a valid A-label (it could otherwise match no U-label spelling)."""
    wildcard, name = ("*.", text.strip()[2:]) if text.strip().startswith("*.") else ("", text)
    key = wildcard + domain_key(name)
    if not _DOMAIN_NAME.fullmatch(key):
        raise ValueError(f"not a domain name: {text.strip()!r}")
    for label in key.split("."):
        if label.startswith("xn--"):
            try:
                idna.ulabel(label)
            except (idna.IDNAError, UnicodeError, ValueError) as exc:
                raise ValueError(f"{text.strip()!r}: {label!r} is not a valid A-label (IDNA 2008): {exc}") from None
    return key


def _domains(value: Any) -> list[str]:
    """Domain names, each as ``domain_key`` gives it (a U-label written as its A-label)."""
    return [_domain_name(d) for d in _str_list(value)]


def _database_rules(value: Any) -> list[str]:
    """'pattern=DATABASE' entries, a U-label in a pattern's domain written as its A-label (the form
    routing matches recipients in, so both spellings of a recipient's domain find the rule)."""
    out = []
    for rule in _str_list(value):
        pattern, eq, db = rule.partition("=")
        local, at, domain = pattern.strip().rpartition("@")
        if eq and at and not domain.isascii():
            labels = domain.split(".")
            wild = next((lb for lb in labels if not lb.isascii() and re.search(r"[*?\[\]]", lb)), None)
            if wild is not None:
                raise ValueError(f"{rule!r}: {wild!r} mixes a wildcard with a U-label: write that label as "
                                 "its A-label (xn--...)")
            domain = ".".join(lb if re.search(r"[*?\[\]]", lb) else domain_key(lb) for lb in labels)
            rule = f"{local}@{domain}={db}"
        out.append(rule)
    return out


def _networks(value: Any) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for item in _str_list(value):
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"not an IP network: {item!r}") from None
    return nets


def _enum(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        for c in choices:
            if isinstance(value, str) and value.lower() == c.lower():
                return c
        raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
    return parse


TLS_AUTH_LEVEL = _enum("EncryptionOnly", "CertificateValidation", "DomainValidation")


def join_hostport(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:2525``): what ``parse_hostport`` reads
    back, what ``config show`` prints and what the code splits at its last colon."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _optional_hostport(value: Any) -> str:
    if value == "":
        return ""
    return join_hostport(*parse_hostport(value, default_port=25))


def _smart_hosts(value: Any) -> str:
    """One ``host[:port]`` or several (a list, or joined by commas or blanks as Postfix's relayhost
    takes them): ``host:port`` entries joined by commas, the queue's next hop as routing names it."""
    if value == "" or value == []:
        return ""
    items = re.split(r"[,\s]+", value.strip()) if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) and v.strip() for v in items):
        raise ValueError(f"expected 'host:port' or a list of them, got {value!r}")
    hosts: list[str] = []
    for item in items:
        host = _optional_hostport(item.strip())
        if host in hosts:
            raise ValueError(f"{host} is listed twice")
        hosts.append(host)
    return ",".join(hosts)


def _hostport_str(value: Any) -> str:
    return join_hostport(*parse_hostport(value))


def _bindings(value: Any) -> list[str]:
    """One 'address:port' or a list of them (Exchange's Bindings): ``["0.0.0.0:25", "[::]:25"]``."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise ValueError(f"expected 'host:port' or a list of them, got {value!r}")
    out: list[str] = []
    for item in items:
        text = _hostport_str(item)
        if text in out:
            raise ValueError(f"{text} is listed twice")
        out.append(text)
    return out


def _optional_bindings(value: Any) -> list[str]:
    if value == "" or value == []:
        return []
    return _bindings(value)


def _optional_listen(value: Any) -> str:
    if value == "":
        return ""
    return _hostport_str(value)


def _dns_servers(value: Any) -> list[str]:
    servers = []
    for item in _str_list(value):
        try:
            try:
                host, port = str(ipaddress.ip_address(item.strip())), 53  # a bare IPv6 address too
            except ValueError:
                host, port = parse_hostport(item, default_port=53)
                ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{item!r} is not a DNS server address ('192.0.2.53', '192.0.2.53:5353', "
                             "'[2001:db8::53]:53')") from None
        servers.append(join_hostport(host, port))
    return servers


def _metrics_listen(value: Any) -> str:
    # A bare port binds loopback: metrics are served beyond it only where configured so.
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = f"127.0.0.1:{value.strip()}"
    return _optional_listen(value)


def _credentials(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError("expected a table of user = \"password\" strings")
    return dict(value)


def _size_or_unlimited(value: Any) -> int:
    # Exchange's "unlimited" for a size: 0 here (no limit).
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return 0
    return parse_size(value)


def _duplicate_window(value: Any) -> float:
    # Exchange: at most 49 days; a larger value falls back to 24 hours.
    seconds = parse_duration(value)
    return 86400.0 if seconds > 49 * 86400 else seconds


# --------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class Key:
    section: str
    name: str
    default: Any
    parse: Callable[[Any], Any]
    meaning: str
    exchange: str = ""
    kind: str = ""
    limits: tuple[float, float] | None = None  # (min, max), both allowed; every numeric key has one

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def range_text(self) -> str:
        """``1s..12h``, ``0..15``; empty for a key that is not a number."""
        if self.limits is None:
            return ""
        low, high = self.limits
        return f"{format_value(self, low)}..{format_value(self, high)}"


DUR, SIZE = "duration", "size"
SEC, MIN, HOUR, DAY = 1.0, 60.0, 3600.0, 86400.0
KB, MB, GB = 1024, 1024**2, 1024**3
INT32_MAX = 2**31 - 1  # Exchange's "unlimited" integers are Int32

KEYS: tuple[Key, ...] = (
    # node
    Key("node", "name", "", _host_name, "this node's FQDN, used in EHLO, Received, tracking logs and by peers"),
    Key("node", "site", "default-site", _str, "the site (Active Directory site) this node belongs to"),
    Key("node", "data_dir", "./data", _str,
        "folder for the queue database, mailbox store and tracking logs (relative to the config file)"),
    Key("node", "log_level", "info", _enum("debug", "info", "warning", "error"), "operational log level"),
    Key("node", "log_format", "text", _enum("text", "json"), "operational log lines: readable text or JSON"),
    Key("node", "tls_certificate_check_interval", 60.0, parse_duration,
        "how often a receive connector looks whether its TLS certificate or key file changed (at a "
        "connection's start), to use a renewed one without a restart; 0s = never", "", DUR, limits=(0, 1 * DAY)),
    # transport receive connector (boundary peers) and cluster membership
    Key("transport", "listen", "", _optional_listen,
        "address:port of the transport receive connector for boundary peers; empty = none"),
    Key("transport", "tls_certificate", "", _str,
        "PEM certificate for STARTTLS on the transport connector; when set, peers must use TLS"),
    Key("transport", "tls_key", "", _str, "PEM private key for transport.tls_certificate"),
    Key("transport", "tls_ca", "", _str,
        "PEM CA bundle that signed the peers' transport certificates; when set, a peer's certificate is "
        "verified before the cluster secret is sent"),
    Key("transport", "exchange_acceptance_reply", False, _bool,
        "answer a message taken as primary on the transport connector as Exchange does (250 2.6.0 <message-id> "
        "[InternalId=..., Hostname=...] Queued mail for delivery) instead of 250 2.0.0 Ok: queued as <id>"),
    Key("transport", "chunking_enabled", True, _bool,
        "offer CHUNKING (BDAT) on the transport connector; peers send shadow copies with BDAT where it is "
        "offered, else with DATA", "ChunkingEnabled"),
    Key("cluster", "secret", "", _str,
        "the cluster credential: peers authenticate with AUTH PLAIN (user = their FQDN, password = this)"),
    Key("cluster", "secret_file", "", _str,
        "a file holding the cluster secret (its first line; relative to the config file), e.g. a compose "
        "secret at /run/secrets/NAME; instead of cluster.secret"),
    # frontend receive connector
    Key("frontend", "listen", "127.0.0.1:2525", _bindings,
        "address:port of the frontend receive connector, or a list of them; 0.0.0.0 is every IPv4 address, [::] "
        "every IPv6 one (IPv6 only): ['0.0.0.0:25', '[::]:25'] for both", "Bindings"),
    Key("frontend", "max_message_size", 36 * MB, parse_size,
        "largest message accepted (bytes); larger gets 552 5.3.4 (an authenticated peer's message may be 64 KiB "
        "larger: the headers the boundary's nodes add)", "MaxMessageSize", SIZE, limits=(1 * KB, 2 * GB)),
    Key("frontend", "max_header_size", 256 * KB, parse_size,
        "largest header section accepted (bytes, up to the empty line that ends it); larger gets 552 5.3.4 (on the "
        "transport connector too, from any client but an authenticated peer)",
        "MaxHeaderSize", SIZE, limits=(1 * KB, 2 * GB)),
    Key("frontend", "max_recipients_per_message", 200, _int,
        "recipients accepted per message; more get 452 4.5.3", "MaxRecipientsPerMessage", limits=(1, 512000)),
    # RFC 5321 4.5.3.1.6: a text line is at most 1000 octets with its CRLF, 998 of text; a longer one
    # taken here would be refused by a next hop that follows it (after our 250: an NDR). The key
    # counts the text, as it always did: a config that sets it keeps its meaning.
    Key("frontend", "max_line_length", 998, _int,
        "longest line in commands and message data, in octets of text: its CRLF and a message line's "
        "leading dot doubled for transparency not counted (RFC 5321 4.5.3.1.6: 998, 1000 with the CRLF); "
        "longer gets 500 5.5.2", limits=(80, 64 * KB)),
    Key("frontend", "max_inbound_connection", 5000, _int,
        "concurrent connections to this connector", "MaxInboundConnection", limits=(1, INT32_MAX)),
    Key("frontend", "max_inbound_connection_per_source", 20, _int,
        "concurrent connections from one IP address", "MaxInboundConnectionPerSource", limits=(1, 10000)),
    Key("frontend", "max_hop_count", 60, _int,
        "Received headers a message may come with; one more is refused as a loop (554 5.4.14) (from an "
        "authenticated peer one more per node of the boundary: each adds its own)", "MaxHopCount",
        limits=(1, 500)),
    Key("frontend", "connection_timeout", 600.0, parse_duration,
        "absolute limit on a session's length; at least connection_inactivity_timeout", "ConnectionTimeout",
        DUR, limits=(1 * SEC, 1 * DAY)),
    Key("frontend", "connection_inactivity_timeout", 300.0, parse_duration,
        "idle time after which a session is closed", "ConnectionInactivityTimeout", DUR, limits=(1 * SEC, 1 * DAY)),
    Key("frontend", "tls_certificate", "", _str, "PEM certificate chain; when set, STARTTLS is offered"),
    Key("frontend", "tls_key", "", _str, "PEM private key for tls_certificate"),
    Key("frontend", "require_tls", False, _bool, "refuse mail transactions before STARTTLS", "RequireTLS"),
    Key("frontend", "implicit_tls_listen", [], _optional_bindings,
        "address:port (or a list) where the frontend speaks TLS from the first byte, no STARTTLS (RFC 8314's "
        "implicit TLS, submissions on port 465: ['0.0.0.0:465']); same limits, AUTH and relay rules; needs "
        "tls_certificate; empty = none"),
    Key("frontend", "chunking_enabled", True, _bool,
        "offer CHUNKING (BDAT, RFC 3030) on the frontend receive connector", "ChunkingEnabled"),
    Key("frontend", "max_acknowledgement_delay", 30.0, parse_duration,
        "2010 mode: the longest the 250 is held for a sender that cannot keep a shadow, waiting for the message "
        "to reach its next hops", "MaxAcknowledgementDelay", DUR, limits=(1 * SEC, 10 * MIN)),
    Key("frontend", "workers", "auto", _workers,
        "receive processes sharing the frontend's port (SO_REUSEPORT) and the queue database; auto = one per "
        "usable core; connection limits count the sessions of all of them, the command rate is split between them", limits=(1, 256)),
    Key("frontend", "auth_users", {}, _credentials,
        "user = \"password\" pairs for AUTH PLAIN/LOGIN (offered only after STARTTLS); "
        "authenticated clients may relay; empty: AUTH is not offered (503 5.5.1)"),
    # routing
    Key("routing", "accepted_domains", [], _domains,
        "domains whose recipients are delivered to the local mailbox store ('*.example.test' allowed); an "
        "internationalized one in either spelling ('bücher.test' is kept as its A-label 'xn--bcher-kva.test', "
        "IDNA 2008): recipients in both spellings are in it",
        "AcceptedDomain"),
    Key("routing", "trusted_networks", [], _networks,
        "client networks allowed to relay to any domain without AUTH (CIDR list); empty = no relay"),
    Key("routing", "smart_host", "", _smart_hosts,
        "next hop for every non-accepted domain ('host:port'), or several (a list): each session starts at one "
        "of them at random and goes on to the next where one does not answer; empty = MX lookup. A change applies "
        "to the mail already queued at the next start (docs/operations.md)", "SmartHosts"),
    Key("routing", "mailbox_database_rules", [], _database_rules,
        "'pattern=DATABASE' entries mapping recipients to mailbox databases ('alice@example.test=MDB02', "
        "'*@sales.example.test=MDB03'); the first match wins, else routing.mailbox_database; a U-label in a "
        "pattern's domain is matched as its A-label"),
    Key("routing", "mailbox_database", "local", _str,
        "mailbox database of the accepted domains' recipients no rule matches (the queue for local delivery is "
        "'mailbox:<name>'); with a [mailbox_databases] table, it and every rule's database must be listed there"),
    # delivery (send connector and queues)
    Key("delivery", "message_expiration_timeout", 2 * DAY, parse_duration,
        "how long a message may stay queued before it fails with a DSN", "MessageExpirationTimeout", DUR,
        limits=(1 * SEC, 90 * DAY)),
    Key("delivery", "transient_failure_retry_interval", 300.0, parse_duration,
        "wait between the first retries after a transient failure", "TransientFailureRetryInterval", DUR,
        limits=(1 * SEC, 12 * HOUR)),
    Key("delivery", "transient_failure_retry_count", 6, _int,
        "retries at transient_failure_retry_interval before the longer interval applies",
        "TransientFailureRetryCount", limits=(0, 15)),
    Key("delivery", "outbound_connection_failure_retry_interval", 600.0, parse_duration,
        "wait between later retries to a failing next hop", "OutboundConnectionFailureRetryInterval", DUR,
        limits=(1 * SEC, 20 * DAY)),
    Key("delivery", "send_connection_inactivity_timeout", 600.0, parse_duration,
        "send connector: idle time before an outbound session is dropped",
        "ConnectionInactivityTimeOut", DUR, limits=(1 * SEC, 1 * DAY)),
    Key("delivery", "connection_cache_time", 2.0, parse_duration,
        "send connector: how long a session to a next hop outside the boundary is kept open after its "
        "batch for the next batch to the same next hop (Postfix's smtp_connection_cache_time_limit); "
        "0 = QUIT after every batch", "", DUR, limits=(0.0, 5 * MIN)),
    Key("delivery", "send_connect_timeout", 30.0, parse_duration,
        "send connector: time allowed to open the TCP connection to a next hop (or a peer's transport "
        "connector); the greeting is then awaited as every reply is, up to "
        "send_connection_inactivity_timeout", "", DUR,
        limits=(1 * SEC, 10 * MIN)),
    Key("delivery", "stop_grace_time", 20.0, parse_duration,
        "on a clean stop (SIGTERM), how long a delivery in the middle of a transaction (its commands or "
        "data sent) may still take to get its reply and record the outcome; past it, it is cut and its "
        "message sent again after the restart (the next hop may then hold it twice); every other "
        "delivery stops at once. Keep it under the time the service manager waits (compose: 30 s)",
        "", DUR, limits=(0.0, 10 * MIN)),
    Key("delivery", "max_per_domain_outbound_connections", 20, _int,
        "concurrent outbound sessions per next hop (fewer for a while after the next hop greets one more with a "
        "4xx while ours are open: its own limit)", "MaxPerDomainOutboundConnections", limits=(1, INT32_MAX)),
    Key("delivery", "max_outbound_connections", 1000, _int,
        "concurrent outbound sessions in all", "MaxOutboundConnections", limits=(1, INT32_MAX)),
    Key("delivery", "max_messages_per_connection", 20, _int,
        "messages sent over one outbound session before it is closed (a next hop that closes sooner with `421`, "
        "or defers MAIL on it, gets the rest on a new session at once)", "MaxMessagesPerConnection",
        limits=(1, INT32_MAX)),
    Key("delivery", "queue_poll_interval", 0.5, parse_duration,
        "how often the queue database is scanned for due work and operator changes", "", DUR,
        limits=(0.01 * SEC, 1 * MIN)),
    Key("delivery", "queue_max_idle_time", 3 * MIN, parse_duration,
        "a delivery queue empty this long since its last attempt (or since it was made) is removed, and made "
        "again when mail for its next hop comes; a queue an operator suspended stays (a queue keeps the "
        "recipients of its Safety Net copies: it goes once they leave the Safety Net too)", "QueueMaxIdleTime",
        DUR, limits=(1 * SEC, 30 * DAY)),
    Key("delivery", "mx_port", 25, _int, "port used for next hops found by MX lookup", limits=(1, 65535)),
    Key("delivery", "external_dns_servers", [], _dns_servers,
        "DNS servers asked for the MX records and addresses of next hops without a smart host ('address' or "
        "'address:port'); empty = the machine's resolver (/etc/resolv.conf)", "ExternalDNSServers"),
    Key("delivery", "delay_notification_timeout", 4 * HOUR, parse_duration,
        "a message still not delivered this long after it was received gets one delay DSN (RFC 3464 "
        "action delayed) to its sender, also across a shadow's takeover (its shadows are told); 0 = never", "DelayNotificationTimeout", DUR, limits=(0.0, 30 * DAY)),
    Key("delivery", "poison_message_detection_enabled", True, _bool,
        "move a message whose handling failed with an internal error poison_threshold times (a crash "
        "of the node while it converted the message or built its DSN counts) to the Poison queue", "PoisonMessageDetectionEnabled"),
    Key("delivery", "poison_threshold", 2, _int,
        "internal failures of one message before it is held in the Poison queue (never retried, "
        "expired or bounced on its own; message resume / remove)", "PoisonThreshold", limits=(1, 10)),
    # mailbox store
    Key("mailbox", "duplicate_detection_window", 3600.0, _duplicate_window,
        "DeliveredTo tracking window; at most 49 days, a larger value falls back to 24 hours",
        "Track Duplicates (in hours)", DUR, limits=(0.0, 49 * DAY)),
    # shadow redundancy
    Key("shadow_redundancy", "shadow_redundancy_enabled", True, _bool,
        "make a shadow copy on a peer before acknowledging", "ShadowRedundancyEnabled"),
    Key("shadow_redundancy", "version", "2013", _enum("2013", "2010"),
        "2013: shadow copies made before the 250 (XSHADOWREQUEST); 2010: the transport connector offers "
        "XSHADOW only, a sender that cannot keep a shadow gets a delayed acknowledgement, and a primary is "
        "declared failed after shadow_heartbeat_retry_count heartbeat time-outs"),
    Key("shadow_redundancy", "promotion_enabled", False, _bool,
        "2010: where delayed acknowledgement is bypassed (target queue in Retry, Suspended or over 100 "
        "messages), relay the message to another node of the site first (shadow redundancy promotion, 2010 "
        "SP1) instead of acknowledging at once", "ShadowRedundancyPromotionEnabled"),
    Key("shadow_redundancy", "shadow_heartbeat_timeout_interval", 900.0, parse_duration,
        "2010: a primary not heard from for this long is polled; each failed poll is one time-out",
        "ShadowHeartbeatTimeoutInterval", DUR, limits=(0.1 * SEC, 1 * DAY)),
    Key("shadow_redundancy", "shadow_heartbeat_retry_count", 12, _int,
        "2010: time-outs in a row after which a primary is declared failed and its shadows promoted (RTM: 3)",
        "ShadowHeartbeatRetryCount", limits=(1, 255)),
    Key("shadow_redundancy", "shadow_message_preference_setting", "PreferRemote",
        _enum("PreferRemote", "LocalOnly", "RemoteOnly"),
        "where shadows are placed", "ShadowMessagePreferenceSetting"),
    Key("shadow_redundancy", "max_retries_for_remote_site_shadow", 4, _int,
        "attempts to shadow to another site", "MaxRetriesForRemoteSiteShadow", limits=(0, 255)),
    Key("shadow_redundancy", "max_retries_for_local_site_shadow", 2, _int,
        "attempts to shadow within the site", "MaxRetriesForLocalSiteShadow", limits=(0, 255)),
    Key("shadow_redundancy", "reject_message_on_shadow_failure", False, _bool,
        "answer 451 4.4.0 when no shadow can be made (needs [[peers]])", "RejectMessageOnShadowFailure"),
    Key("shadow_redundancy", "shadow_copies", 1, _int,
        "shadow copies made before the 250, each on its own peer (1: Exchange's two copies in all; "
        "2 or more survives the primary and a shadow failing together); raised, the mail already queued gets "
        "the missing copies after the restart; lowered, the copies already made keep their ranks (rank 1 "
        "still adopts the others)",
        "", limits=(1, 9)),
    Key("shadow_redundancy", "min_shadow_copies", 1, _int,
        "fewer shadows than this is a shadow failure (reject_message_on_shadow_failure decides); from "
        "this up to shadow_copies the message is accepted, the missing copies logged and made later",
        "", limits=(1, 9)),
    Key("shadow_redundancy", "shadow_rank_delay", 5 * MIN, parse_duration,
        "N-way: the shadow of rank k takes ownership of a lost primary's message only after "
        "shadow_resubmit_time_span plus k - 1 of these (rank 1 first; it adopts the others); "
        "at least one shadow_heartbeat_frequency", "", DUR, limits=(1 * SEC, 1 * DAY)),
    Key("shadow_redundancy", "shadow_copy_timeout", 30.0, parse_duration,
        "the longest a shadow copy may hold up the sender's 250 (all peers tried); then as if no shadow "
        "could be made", "", DUR, limits=(1 * SEC, 10 * MIN)),
    Key("shadow_redundancy", "shadow_heartbeat_frequency", 120.0, parse_duration,
        "how often a shadow polls its primary with XQDISCARD", "ShadowHeartbeatFrequency", DUR,
        limits=(0.1 * SEC, 1 * DAY)),
    Key("shadow_redundancy", "shadow_resubmit_time_span", 3 * HOUR, parse_duration,
        "failed heartbeats for this long promote the shadows; at least one shadow_heartbeat_frequency",
        "ShadowResubmitTimeSpan", DUR, limits=(1 * SEC, 1 * DAY)),
    Key("shadow_redundancy", "shadow_message_auto_discard_interval", 2 * DAY, parse_duration,
        "discard events nobody asked for are dropped after this; at least one shadow_heartbeat_frequency",
        "ShadowMessageAutoDiscardInterval", DUR, limits=(5 * SEC, 90 * DAY)),
    # safety net
    Key("safety_net", "safety_net_hold_time", 2 * DAY, parse_duration,
        "how long processed messages are kept for resubmission", "SafetyNetHoldTime", DUR,
        limits=(15 * SEC, 24855 * DAY)),
    Key("safety_net", "primary_safety_net_unreachable_time", 12 * HOUR, parse_duration,
        "after this, resubmit requests go to the Shadow Safety Nets", "", DUR, limits=(1 * SEC, 30 * DAY)),
    # message tracking
    Key("tracking", "message_tracking_log_enabled", True, _bool,
        "write MSGTRK message tracking logs", "MessageTrackingLogEnabled"),
    Key("tracking", "format", "auto", _enum("auto", "exchange2016", "exchange2010"),
        "MSGTRK row format: exchange2016 (30 fields) or Exchange 2010's 26 (no network-message-id); auto = "
        "exchange2010 with shadow_redundancy.version 2010, else exchange2016"),
    Key("tracking", "message_tracking_log_path", "", _str,
        "folder of the MSGTRK files; empty = <data_dir>/msgtrk", "MessageTrackingLogPath"),
    Key("tracking", "message_tracking_log_max_file_size", 10 * MB, parse_size,
        "roll to a new file past this size", "MessageTrackingLogMaxFileSize", SIZE, limits=(1, 4 * GB)),
    Key("tracking", "message_tracking_log_subject_logging_enabled", True, _bool,
        "write each message's Subject in the message-subject field (false: the field stays empty)",
        "MessageTrackingLogSubjectLoggingEnabled"),
    Key("tracking", "message_tracking_log_max_age", 30 * DAY, parse_duration,
        "files last written longer ago than this are removed (checked every housekeeping round); 0s = never "
        "by age", "MessageTrackingLogMaxAge", DUR, limits=(0, 24855 * DAY)),
    Key("tracking", "message_tracking_log_max_directory_size", 1000 * MB, _size_or_unlimited,
        "the oldest files are removed while the folder's MSGTRK files hold more than this; 0 or 'unlimited' = "
        "no limit; at least message_tracking_log_max_file_size", "MessageTrackingLogMaxDirectorySize", SIZE,
        limits=(0, 1024 * GB)),
    # Prometheus metrics
    Key("metrics", "listen", "", _metrics_listen,
        "address:port of the Prometheus /metrics endpoint ('9101' alone = 127.0.0.1:9101); empty = off"),
    Key("metrics", "max_queue_series", 50, _int,
        "queues with their own 'queue' label in the per-queue gauges (the fullest ones; one per next hop, "
        "so one per domain with MX routing); the rest are summed up under queue=\"other\"", limits=(1, 10000)),
    # frontend command-rate limit (docs/security.md)
    Key("frontend", "max_command_rate", 0, _int,
        "SMTP commands per second accepted from one IP address over all its sessions of a receive connector "
        "(on the transport connector: sessions not authenticated as a peer) (bursts up to twice that); beyond "
        "it 421 4.7.0 and the session is closed; 0 = no limit", limits=(0, 100000)),
)

SECTIONS = tuple(dict.fromkeys(k.section for k in KEYS))
_BY_SECTION: dict[str, dict[str, Key]] = {s: {k.name: k for k in KEYS if k.section == s} for s in SECTIONS}
_HIDDEN_IN_REPR = {"secret", "auth_users"}


# --------------------------------------------------------------------------- typed sections

def _refuse_assignment(cls: type) -> type:
    """Every assignment and deletion raises FrozenInstanceError, new names included (a frozen dataclass
    with slots raises TypeError for those before Python 3.12)."""
    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to {type(self).__name__}.{name}: read-only")

    def __delattr__(self: Any, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete {type(self).__name__}.{name}: read-only")

    cls.__setattr__ = __setattr__
    cls.__delattr__ = __delattr__
    return cls


def _section_type(section: str) -> type:
    """A frozen dataclass with one field per key of ``section``, e.g. DeliverySettings."""
    fields = [(k.name, type(k.default), field(repr=k.name not in _HIDDEN_IN_REPR))
              for k in _BY_SECTION[section].values()]
    name = "".join(part.capitalize() for part in section.split("_")) + "Settings"
    return _refuse_assignment(dataclasses.make_dataclass(
        name, fields, frozen=True, slots=True,
        namespace={"__module__": __name__, "__doc__": f"The effective [{section}] table (read-only)."}))


SECTION_TYPES: dict[str, type] = {s: _section_type(s) for s in SECTIONS}
NodeSettings = SECTION_TYPES["node"]
TransportSettings = SECTION_TYPES["transport"]
ClusterSettings = SECTION_TYPES["cluster"]
FrontendSettings = SECTION_TYPES["frontend"]
RoutingSettings = SECTION_TYPES["routing"]
DeliverySettings = SECTION_TYPES["delivery"]
MailboxSettings = SECTION_TYPES["mailbox"]
ShadowRedundancySettings = SECTION_TYPES["shadow_redundancy"]
SafetyNetSettings = SECTION_TYPES["safety_net"]
TrackingSettings = SECTION_TYPES["tracking"]
MetricsSettings = SECTION_TYPES["metrics"]


@dataclass(frozen=True)
class PeerConfig:
    name: str
    site: str
    transport: str  # host:port of the peer's transport connector


@dataclass(frozen=True)
class SendConnectorConfig:
    """``[[send_connectors]]``: mail for the domains of its address spaces goes to its smart hosts
    (``host:port`` joined by commas, as ``routing.smart_host``) or, with none, to their MX hosts."""
    name: str
    address_spaces: tuple[str, ...]
    smart_hosts: str = ""
    require_tls: bool = False  # STARTTLS required of its next hops (Exchange's RequireTLS)
    tls_auth_level: str = "EncryptionOnly"  # or CertificateValidation, DomainValidation (TlsAuthLevel)
    tls_ca: str = ""  # CA bundle for the validation (PEM); empty: the system's

    def tls_options(self) -> dict[str, Any]:
        """STARTTLS options (smtp/wire.py) for its next hops: opportunistic unless required."""
        if not self.require_tls:
            return {"start_tls": None, "validate_certs": False}
        level = self.tls_auth_level
        return {"start_tls": True, "validate_certs": level != "EncryptionOnly",
                "check_hostname": level == "DomainValidation", "cert_bundle": self.tls_ca or None}


# --------------------------------------------------------------------------- loaded config

@_refuse_assignment
@dataclass(frozen=True, slots=True)
class Config:
    """Effective configuration: ``cfg.frontend.max_message_size`` etc., plus ``cfg.path``. Read-only."""

    node: NodeSettings
    transport: TransportSettings
    cluster: ClusterSettings
    frontend: FrontendSettings
    routing: RoutingSettings
    delivery: DeliverySettings
    mailbox: MailboxSettings
    shadow_redundancy: ShadowRedundancySettings
    safety_net: SafetyNetSettings
    tracking: TrackingSettings
    metrics: MetricsSettings
    peers: tuple[PeerConfig, ...] = ()
    mailbox_databases: dict[str, str] = field(default_factory=dict)
    send_connectors: tuple[SendConnectorConfig, ...] = ()
    path: Path | None = None
    base_dir: Path = field(default_factory=Path.cwd)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def data_dir(self) -> Path:
        p = Path(self.node.data_dir)
        return p if p.is_absolute() else (self.base_dir / p)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "queue.db"

    @property
    def tracking_dir(self) -> Path:
        p = self.tracking.message_tracking_log_path
        if not p:
            return self.data_dir / "msgtrk"
        pp = Path(p)
        return pp if pp.is_absolute() else (self.base_dir / pp)

    @property
    def mailbox_dir(self) -> Path:
        return self.data_dir / "mailboxes"

    def effective(self) -> list[tuple[Key, Any]]:
        return [(k, getattr(getattr(self, k.section), k.name)) for k in KEYS]

    def with_overrides(self, overrides: dict[str, dict[str, Any]]) -> Config:
        """A copy with some keys changed, validated like a file:
        ``cfg.with_overrides({"node": {"data_dir": d}})``."""
        raw = {name: dict(table) if isinstance(table, dict) else table for name, table in self.raw.items()}
        for section, table in overrides.items():
            raw[section] = {**raw.get(section, {}), **table}
        source = str(self.path) if self.path else "<config>"
        return dataclasses.replace(load_dict(raw, source=source, base_dir=self.base_dir), path=self.path)


def _did_you_mean(name: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(name), known, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _unknown_key_hint(section: str, name: str) -> str:
    hint = _did_you_mean(name, list(_BY_SECTION[section]))
    if not hint:
        elsewhere = [k.dotted for k in KEYS if k.name == name]
        hint = f"; did you mean '{elsewhere[0]}'?" if elsewhere else ""
    return hint


def _check_range(key: Key, value: Any, source: str) -> None:
    if key.limits is None or isinstance(value, str):  # a word (auto) is checked by the key's parser
        return
    low, high = key.limits
    if not low <= value <= high:
        raise ConfigError(f"{source}: {key.dotted}: {format_value(key, value)} is out of range ({key.range_text})")


def _parse_section(raw: dict, section: str, source: str) -> dict[str, Any]:
    """The values of one section: parsed, in range, defaults for the missing keys."""
    table = raw.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{section}] must be a table")
    keys = _BY_SECTION[section]
    for name in table:
        if name not in keys:
            raise ConfigError(f"{source}: {section}.{name}: unknown key{_unknown_key_hint(section, name)}")
    values = {}
    for name, key in keys.items():
        if name not in table:
            values[name] = key.parse(key.default) if key.default != "" else key.default
            continue
        try:
            values[name] = key.parse(table[name])
        except ValueError as exc:
            raise ConfigError(f"{source}: {key.dotted}: {exc}") from None
        _check_range(key, values[name], source)
    return values


def load_dict(raw: dict, source: str = "<config>", base_dir: Path | None = None,
              extra_sections: tuple[str, ...] = ("peers", "mailbox_databases", "send_connectors")) -> Config:
    """Validate a parsed TOML document; ConfigError names the first bad key."""
    for name in raw:
        if name not in _BY_SECTION and name not in extra_sections:
            hint = _did_you_mean(name, SECTIONS + tuple(extra_sections)) or f" (known: {', '.join(SECTIONS)})"
            raise ConfigError(f"{source}: unknown section [{name}]{hint}")
    base = base_dir or Path.cwd()
    values = {section: _parse_section(raw, section, source) for section in SECTIONS}
    if not values["node"]["name"]:
        values["node"]["name"] = socket.getfqdn() or "localhost"
    peers = _peers(raw.get("peers", []), source, values["node"]["name"])
    mailbox_databases = _mailbox_databases(raw.get("mailbox_databases", {}), source)
    send_connectors = _send_connectors(raw.get("send_connectors", []), source, base)
    _resolve_tls_files(values, base, source)
    _read_secret_file(values["cluster"], base, source)
    cfg = Config(**{s: SECTION_TYPES[s](**v) for s, v in values.items()}, peers=tuple(peers),
                 mailbox_databases=mailbox_databases, send_connectors=tuple(send_connectors), path=None,
                 base_dir=base, raw=raw)
    _cross_checks(cfg, source)
    return cfg


def _tables(value: Any, source: str, name: str, fields: tuple[str, ...], wanted: str) -> list[tuple[str, dict]]:
    """The tables of an array of tables (``[[name]]``), each with where it is for an error; a
    value that is no such array, an item that is no table, or an unknown key is an error."""
    if not isinstance(value, list):
        raise ConfigError(f"{source}: {name}: expected [[{name}]] tables")
    out = []
    for i, item in enumerate(value):
        where = f"{source}: {name}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected a table with {wanted}")
        unknown = sorted(set(item) - set(fields))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key{_did_you_mean(unknown[0], fields)}")
        out.append((where, item))
    return out


def _peers(value: Any, source: str, me: str) -> list[PeerConfig]:
    """``[[peers]]`` tables: name (FQDN), site, transport (host:port)."""
    fields = ("name", "site", "transport")
    out: list[PeerConfig] = []
    for where, item in _tables(value, source, "peers", fields, "name, site and transport"):
        for key in fields:
            if not isinstance(item.get(key), str) or not item[key].strip():
                raise ConfigError(f"{where}.{key}: required, a non-empty string")
        try:
            host, port = parse_hostport(item["transport"])
        except ValueError as exc:
            raise ConfigError(f"{where}.transport: {exc}") from None
        try:
            name = _host_name(item["name"]).lower()
        except ValueError as exc:
            raise ConfigError(f"{where}.name: {exc}") from None
        if name == me.lower():
            raise ConfigError(f"{where}.name: {name} is this node itself")
        if any(p.name == name for p in out):
            raise ConfigError(f"{where}.name: {name} is listed twice")
        out.append(PeerConfig(name, item["site"].strip(), join_hostport(host, port)))
    return out


def _send_connectors(value: Any, source: str, base_dir: Path) -> list[SendConnectorConfig]:
    """``[[send_connectors]]`` tables: name, address_spaces (domains, ``*.domain``, ``*``),
    smart_hosts, require_tls, tls_auth_level, tls_ca (relative to the config file)."""
    fields = ("name", "address_spaces", "smart_hosts", "require_tls", "tls_auth_level", "tls_ca")
    out: list[SendConnectorConfig] = []
    for where, item in _tables(value, source, "send_connectors", fields, "name and address_spaces"):
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}.name: required, a non-empty string")
        if any(c.name == name.strip() for c in out):
            raise ConfigError(f"{where}.name: {name.strip()} is listed twice")
        spaces = item.get("address_spaces")
        if not isinstance(spaces, list) or not spaces:
            raise ConfigError(f"{where}.address_spaces: required, a list of domains ('partner.example', "
                              "'*.partner.example', '*')")
        try:
            domains = _domains([s for s in spaces if s != "*"])
        except ValueError as exc:
            raise ConfigError(f"{where}.address_spaces: {exc}") from None
        try:
            hosts = _smart_hosts(item.get("smart_hosts", ""))
        except ValueError as exc:
            raise ConfigError(f"{where}.smart_hosts: {exc}") from None
        tls = {}
        for key, parse in (("require_tls", _bool), ("tls_auth_level", TLS_AUTH_LEVEL), ("tls_ca", _str)):
            if key in item:
                try:
                    tls[key] = parse(item[key])
                except ValueError as exc:
                    raise ConfigError(f"{where}.{key}: {exc}") from None
        if tls.get("tls_ca"):
            ca = Path(tls["tls_ca"]) if Path(tls["tls_ca"]).is_absolute() else base_dir / tls["tls_ca"]
            if not ca.is_file():
                raise ConfigError(f"{where}.tls_ca: no such file: {ca}")
            _check_ca_bundle(ca, f"{where}.tls_ca")
            tls["tls_ca"] = str(ca)
        if (tls.get("tls_ca") or tls.get("tls_auth_level", "EncryptionOnly") != "EncryptionOnly") \
                and not tls.get("require_tls"):
            raise ConfigError(f"{where}.require_tls: tls_auth_level and tls_ca apply where TLS is required; "
                              "set require_tls = true")
        made = SendConnectorConfig(name.strip(), tuple(domains + ["*"] * ("*" in spaces)), hosts, **tls)
        same = next((c for c in out if hosts and c.smart_hosts == hosts), None)
        if same is not None and same.tls_options() != made.tls_options():
            raise ConfigError(f"{where}.smart_hosts: the same as send connector {same.name}'s, with other TLS "
                              "settings: mail for the same smart hosts shares one queue and one TLS policy")
        out.append(made)
    return out


def _mailbox_databases(value: Any, source: str) -> dict[str, str]:
    """``[mailbox_databases]``: DATABASE = "node FQDN" (the node holding it)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [mailbox_databases] must be a table of DATABASE = \"node FQDN\"")
    out = {}
    for db, node in value.items():
        if not isinstance(node, str) or not node.strip():
            raise ConfigError(f"{source}: mailbox_databases.{db}: expected the FQDN of the node holding it")
        out[db] = node.strip().lower()
    return out


def _is_own_listener(cfg: Config, address: str) -> str | None:
    """The key of this node's listener that ``address`` (host:port) reaches, or None. Only what
    is certain: the same address as written, or a loopback address (``localhost`` too) on the
    port of a listener bound to loopback or to every address."""
    import ipaddress

    host, port = parse_hostport(address)
    host = host.strip("[]").lower()

    def loopback(h: str) -> bool:
        if h == "localhost":
            return True
        try:
            return ipaddress.ip_address(h).is_loopback
        except ValueError:
            return False

    def wildcard(h: str) -> bool:
        try:
            return ipaddress.ip_address(h).is_unspecified
        except ValueError:
            return False

    listeners = [("frontend.listen", a) for a in cfg.frontend.listen] + \
        [("frontend.implicit_tls_listen", a) for a in cfg.frontend.implicit_tls_listen] + \
        ([("transport.listen", cfg.transport.listen)] if cfg.transport.listen else [])
    for key, listen in listeners:
        own_host, own_port = parse_hostport(listen)
        own_host = own_host.strip("[]").lower()
        if own_port != port:
            continue
        same = own_host == host
        to_every_address = wildcard(own_host) and loopback(host)
        localhost = host == "localhost" and loopback(own_host)
        if same or to_every_address or localhost:
            return key
    return None


def _no_next_hop_is_this_node(cfg: Config, source: str) -> None:
    """A smart host or a peer that is this node's own listener: every message would come back
    to it and loop until its hop count fails it (Postfix: "mail for ... loops back to myself")."""
    hops = [("routing.smart_host", h) for h in cfg.routing.smart_host.split(",") if h]
    hops += [(f"send_connectors.{c.name}.smart_hosts", h) for c in cfg.send_connectors
             for h in c.smart_hosts.split(",") if h]
    hops += [(f"peers.{p.name}.transport", p.transport) for p in cfg.peers]
    for key, hop in hops:
        own = _is_own_listener(cfg, hop)
        if own:
            raise ConfigError(f"{source}: {key}: {hop} is this node's own {own}: mail sent there would "
                              "loop back to this node")
    seen: dict[str, str] = {}
    for p in cfg.peers:
        if p.transport.lower() in seen:
            raise ConfigError(f"{source}: peers.{p.name}.transport: {p.transport} is also peer "
                              f"{seen[p.transport.lower()]}'s transport: one node, one name")
        seen[p.transport.lower()] = p.name


def _listeners_apart(cfg: Config, source: str) -> None:
    """No two listeners of different keys on one address and port (a wildcard of a family covers
    that family's addresses): the second bind failed at start, after the first had been opened."""
    import ipaddress

    def family(host: str) -> tuple[int, bool] | None:
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return None  # a name: compared as written
        return ip.version, ip.is_unspecified

    seen: list[tuple[str, str, int]] = []
    keys = [("frontend.listen", cfg.frontend.listen), ("frontend.implicit_tls_listen", cfg.frontend.implicit_tls_listen),
            ("transport.listen", [cfg.transport.listen] if cfg.transport.listen else []),
            ("metrics.listen", [cfg.metrics.listen] if cfg.metrics.listen else [])]
    for key, addresses in keys:
        for address in addresses:
            host, port = parse_hostport(address)
            for other_key, other_host, other_port in seen:
                if other_key == key or other_port != port:
                    continue
                a, b = family(host), family(other_host)
                same = host.strip("[]").lower() == other_host.strip("[]").lower() or (
                    a is not None and b is not None and a[0] == b[0] and (a[1] or b[1]))
                if same:
                    raise ConfigError(f"{source}: {key}: {address} is also where {other_key} listens "
                                      f"({other_host}:{other_port}): one address and port, one listener")
            seen.append((key, host, port))


def _resolve_tls_files(values: dict[str, dict[str, Any]], base_dir: Path, source: str) -> None:
    """A connector's tls_certificate and tls_key: both or neither, existing files, made absolute (tls_ca too)."""
    for section, names in (("transport", ("tls_certificate", "tls_key", "tls_ca")),
                           ("frontend", ("tls_certificate", "tls_key"))):
        table = values[section]
        if bool(table["tls_certificate"]) != bool(table["tls_key"]):
            raise ConfigError(f"{source}: {section}.tls_key: tls_certificate and tls_key must be set together")
        for name in names:
            if table[name]:
                p = Path(table[name]) if Path(table[name]).is_absolute() else base_dir / table[name]
                if not p.is_file():
                    raise ConfigError(f"{source}: {section}.{name}: "
                                      f"{'not a regular file' if p.exists() else 'no such file'}: {p}")
                if name == "tls_ca":
                    _check_ca_bundle(p, f"{source}: {section}.tls_ca")
                table[name] = str(p)


def _check_ca_bundle(path: Path, where: str) -> None:
    """A CA bundle must hold PEM certificates: a garbage file would only fail each TLS session later."""
    import ssl
    try:
        ssl.create_default_context().load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise ConfigError(f"{where}: {path} holds no PEM certificate ({exc.reason or exc})") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None


def _read_secret_file(cluster: dict[str, Any], base_dir: Path, source: str) -> None:
    """cluster.secret_file: its first line becomes cluster.secret (the two keys exclude each other)."""
    if not cluster["secret_file"]:
        return
    if cluster["secret"]:
        raise ConfigError(f"{source}: cluster.secret_file: set either cluster.secret or cluster.secret_file")
    p = Path(cluster["secret_file"])
    p = p if p.is_absolute() else base_dir / p
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{source}: cluster.secret_file: no such file: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cluster.secret_file: cannot read {p}: {getattr(exc, 'strerror', exc)}") from None
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ConfigError(f"{source}: cluster.secret_file: {p} is empty")
    cluster["secret_file"] = str(p)
    cluster["secret"] = secret


def _databases_are_listed(cfg: Config, source: str) -> None:
    """With ``[mailbox_databases]``, every database routing names must be listed there: route()
    takes an unlisted one for this node's, so on a cluster each node would keep its own copy of
    it (e.g. MDB01's owner taken out of the table, its mail split across the remaining nodes)."""
    if not cfg.mailbox_databases:
        return  # no table: the database is this node's local store
    named = [("routing.mailbox_database", cfg.routing.mailbox_database)]
    named += [("routing.mailbox_database_rules", rule.partition("=")[2].strip())
              for rule in cfg.routing.mailbox_database_rules]
    for key, db in named:
        if db not in cfg.mailbox_databases:
            raise ConfigError(f"{source}: {key}: mailbox database {db} is not in [mailbox_databases] "
                              "(name the node that holds it there)")


def _cross_checks(cfg: Config, source: str) -> None:
    """Values that are each in range but make no sense together; the message names both keys."""
    for rule in cfg.routing.mailbox_database_rules:
        pattern, eq, db = rule.partition("=")
        if not eq or not pattern.strip() or not db.strip():
            raise ConfigError(f"{source}: routing.mailbox_database_rules: expected 'pattern=DATABASE', got {rule!r}")
    known = {cfg.node.name.lower()} | {p.name for p in cfg.peers}
    for db, node in cfg.mailbox_databases.items():
        if node not in known:
            raise ConfigError(f"{source}: mailbox_databases.{db}: {node} is neither this node nor a configured peer")
    _databases_are_listed(cfg, source)
    if cfg.peers and not cfg.cluster.secret:
        raise ConfigError(f"{source}: cluster.secret: required when [[peers]] are configured")
    if cfg.peers and not cfg.transport.listen:
        raise ConfigError(f"{source}: transport.listen: required when [[peers]] are configured")
    if cfg.transport.tls_ca and not cfg.transport.tls_certificate:
        raise ConfigError(f"{source}: transport.tls_ca: needs transport.tls_certificate (peers use TLS)")
    fe = cfg.frontend
    if fe.require_tls and not fe.tls_certificate:
        raise ConfigError(f"{source}: frontend.require_tls: needs tls_certificate and tls_key")
    if fe.implicit_tls_listen and not fe.tls_certificate:
        raise ConfigError(f"{source}: frontend.implicit_tls_listen: needs frontend.tls_certificate and tls_key")
    both = set(fe.listen) & set(fe.implicit_tls_listen)
    if both:
        raise ConfigError(f"{source}: frontend.implicit_tls_listen: {', '.join(sorted(both))} is also in "
                          "frontend.listen (one binding speaks TLS from the start or offers STARTTLS, not both)")
    _listeners_apart(cfg, source)
    _no_next_hop_is_this_node(cfg, source)
    if fe.auth_users and not fe.tls_certificate:
        raise ConfigError(f"{source}: frontend.auth_users: AUTH is offered only after STARTTLS; "
                          "set tls_certificate and tls_key")
    # Set-ReceiveConnector: ConnectionTimeout is the longer of the two (an idle limit past it never fires).
    _require_longer(cfg, "frontend.connection_timeout", "frontend.connection_inactivity_timeout", source,
                    "an idle limit longer than the session limit never applies", relation="is shorter than")
    # A shadow asks its primary at most once per heartbeat: it gives up on the primary after
    # ShadowResubmitTimeSpan of failed heartbeats, and the primary drops unasked-for discard events after
    # ShadowMessageAutoDiscardInterval. Either one shorter than a heartbeat is over before the first poll.
    _require_longer(cfg, "shadow_redundancy.shadow_resubmit_time_span",
                    "shadow_redundancy.shadow_heartbeat_frequency", source,
                    "a primary would be given up before its first heartbeat")
    sr = cfg.shadow_redundancy
    if sr.shadow_redundancy_enabled and sr.reject_message_on_shadow_failure and sr.version != "2010" \
            and not cfg.peers:
        # Exchange: "use $true only if you have multiple Mailbox servers".
        raise ConfigError(f"{source}: shadow_redundancy.reject_message_on_shadow_failure: true with no [[peers]]: "
                          "no shadow copy can be made, so every message would be refused (configure the peers, "
                          "or set it false)")
    if sr.min_shadow_copies > sr.shadow_copies:
        raise ConfigError(f"{source}: shadow_redundancy.min_shadow_copies: {sr.min_shadow_copies} is more than "
                          f"shadow_redundancy.shadow_copies ({sr.shadow_copies})")
    if sr.shadow_copies > 1 and sr.version == "2010":
        raise ConfigError(f"{source}: shadow_redundancy.shadow_copies: {sr.shadow_copies} is not possible with "
                          "shadow_redundancy.version = \"2010\" (Exchange 2010 keeps one shadow: the sending "
                          "server's; set shadow_copies = 1 or version = \"2013\")")
    if sr.shadow_copies > 1 and cfg.peers and len(cfg.peers) < sr.shadow_copies:
        raise ConfigError(f"{source}: shadow_redundancy.shadow_copies: {sr.shadow_copies} shadows need as many "
                          f"[[peers]], {len(cfg.peers)} configured")
    if sr.shadow_copies > 1:
        # Rank 1 must have a heartbeat round to notice the loss, promote and adopt the others.
        _require_longer(cfg, "shadow_redundancy.shadow_rank_delay", "shadow_redundancy.shadow_heartbeat_frequency",
                        source, "the next rank would promote before rank 1 could adopt it")
    tracking = cfg.tracking
    if 0 < tracking.message_tracking_log_max_directory_size < tracking.message_tracking_log_max_file_size:
        # Set-TransportService refuses it too.
        raise ConfigError(f"{source}: tracking.message_tracking_log_max_directory_size: "
                          f"{format_size(tracking.message_tracking_log_max_directory_size)} is less than "
                          f"tracking.message_tracking_log_max_file_size "
                          f"({format_size(tracking.message_tracking_log_max_file_size)}): the folder could not "
                          "hold one full file")
    _require_longer(cfg, "shadow_redundancy.shadow_message_auto_discard_interval",
                    "shadow_redundancy.shadow_heartbeat_frequency", source,
                    "discard events would be dropped before the shadow's first poll")


def _require_longer(cfg: Config, longer: str, shorter: str, source: str, why: str,
                    relation: str = "is shorter than one") -> None:
    """Duration ``longer`` >= duration ``shorter``, else one line naming both keys and their values."""
    values = []
    for dotted in (longer, shorter):
        section, name = dotted.split(".")
        values.append(getattr(getattr(cfg, section), name))
    if values[0] < values[1]:
        raise ConfigError(f"{source}: {longer}: {format_duration(values[0])} {relation} {shorter} "
                          f"({format_duration(values[1])}): {why}")


def load(path: str | Path) -> Config:
    """Read and validate a TOML file; ConfigError (one line) on any problem."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: TOML syntax error: {exc}") from None
    return dataclasses.replace(load_dict(raw, source=str(p), base_dir=p.resolve().parent), path=p)


def default_for_data_dir(data_dir: str | Path) -> Config:
    """A config with defaults whose data_dir is given (for CLI commands run with --data-dir)."""
    return load_dict({"node": {"data_dir": str(Path(data_dir).resolve())}}, source="--data-dir")


def format_value(key: Key, value: Any) -> str:
    if key.name == "secret":
        return "*** (set)" if value else '"" (not set)'
    if key.kind == DUR:
        return format_duration(value)
    if key.kind == SIZE:
        return format_size(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = ***" for k in value) + "}"
    return str(value)


def table_entries(cfg: Config) -> list[tuple[str, str, str, str]]:
    """The effective values of the array and free-form tables ``effective()`` does not hold
    (``[[peers]]``, ``[mailbox_databases]``, ``[[send_connectors]]``), each as (dotted name, value,
    Exchange name, meaning), in the form the node uses them (a U-label address space as its
    A-label, a peer's name in lower case); nothing for a table not configured. No secrets live in
    these tables (the cluster secret is ``cluster.secret``, shown masked by ``format_value``)."""
    out = []
    for peer in cfg.peers:
        out += [(f"peers.{peer.name}.site", peer.site, "Site", "the site of this boundary peer"),
                (f"peers.{peer.name}.transport", peer.transport, "",
                 "host:port of this boundary peer's transport connector")]
    for db, node in cfg.mailbox_databases.items():
        out.append((f"mailbox_databases.{db}", node, "Server", "the node that holds this mailbox database"))
    for c in cfg.send_connectors:
        where = f"send_connectors.{c.name}"
        out += [(f"{where}.address_spaces", "[" + ", ".join(c.address_spaces) + "]", "AddressSpaces",
                 "the domains whose mail this send connector takes (A-labels; '*': every domain)"),
                (f"{where}.smart_hosts", c.smart_hosts, "SmartHosts",
                 "its next hops ('host:port', comma-separated); empty = the domains' MX hosts"),
                (f"{where}.require_tls", "true" if c.require_tls else "false", "RequireTLS",
                 "STARTTLS required of its next hops"),
                (f"{where}.tls_auth_level", c.tls_auth_level, "TlsAuthLevel",
                 "what is checked of a next hop's certificate where TLS is required"),
                (f"{where}.tls_ca", c.tls_ca, "", "CA bundle for that check (PEM); empty = the system's")]
    return out


def format_duration(seconds: float) -> str:
    if seconds and seconds % 86400 == 0:
        return f"{int(seconds // 86400)}d"
    if seconds and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def format_size(size: int) -> str:
    for unit, factor in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


def markdown_reference() -> str:
    """The configuration reference table (README.md holds a copy; a test keeps them equal)."""
    rows = ["| key | default | range | Exchange name | meaning |", "|---|---|---|---|---|"]
    for k in KEYS:
        default = k.parse(k.default) if k.default != "" else ""
        if k.dotted == "node.name":
            shown = "the host's FQDN"
        elif default == "" or k.name == "secret":
            shown = '""'
        else:
            shown = format_value(k, default)
        allowed = f"`{k.range_text}`" if k.limits else ""
        rows.append(f"| `{k.dotted}` | `{shown}` | {allowed} | {k.exchange} | {k.meaning.replace('|', '/')} |")
    return "\n".join(rows)


def peer_tls_options(cfg: Config) -> dict[str, Any]:
    """STARTTLS options (smtp/wire.py) for sessions to peers' transport connectors."""
    tr = cfg.transport
    if not tr.tls_certificate:
        return {"start_tls": False, "validate_certs": False}
    if tr.tls_ca:
        return {"start_tls": True, "validate_certs": True, "cert_bundle": tr.tls_ca}
    return {"start_tls": True, "validate_certs": False}
