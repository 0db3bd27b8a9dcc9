"""What the analytics job knows about the MSGTRK format and its events (pure Python, no Spark).

Field lists come from ``transportd.tracking`` (one definition of the format). A file's field
names are those of its ``#Fields:`` header; a file without one is read by the count of each
row: 26 fields is Exchange 2010, 27 is 2013, 30 is 2016/2019. The event classes below decide
when a copy of a message is taken or released on a node and when a recipient is done; they
are documented in docs/analytics.md.
"""

from __future__ import annotations

from transportd.tracking import FIELDS_2010, FIELDS_2013, FIELDS_2016

__all__ = [
    "CLIENT_SIDE_EVENTS",
    "COPY_RELEASE_EVENTS",
    "DELIVERY_EVENTS",
    "ENTRY_EVENTS",
    "FAILED_EVENTS",
    "FIELDS_2010",
    "FIELDS_2013",
    "FIELDS_2016",
    "FIELDS_BY_COUNT",
    "GENERIC_FOLDERS",
    "LEGACY_CLIENT_SIDE_EVENTS",
    "MAILBOX_SOURCE",
    "MAX_FIELDS",
    "MODERATION_DECISION_EVENTS",
    "RELEASE_EVENTS",
    "REVERSED_CHANGE_EVENTS",
    "SEND_EVENTS",
    "SEND_FOLLOW_SECONDS",
    "STATES",
    "SUCCESS_EVENTS",
    "TAKE_EVENTS",
    "column_name",
]

FIELDS_BY_COUNT: dict[int, tuple[str, ...]] = {
    len(FIELDS_2010): FIELDS_2010,
    len(FIELDS_2013): FIELDS_2013,
    len(FIELDS_2016): FIELDS_2016,
}
"""Headerless files: the number of fields in a row decides the format."""

MAX_FIELDS = 32
"""Tokens parsed per row: every known format fits (a #Fields header may name at most this many)."""

ENTRY_EVENTS = ("RECEIVE", "DSN")
"""A message enters the logs: received over SMTP (or a local submission), or a DSN generated."""

TAKE_EVENTS = ("RECEIVE", "HARECEIVE", "RESUBMIT", "DSN")
"""The node now holds a copy (primary, shadow, promoted or resubmitted, generated). Not a RESUBMIT
with source ``MAILBOX_SOURCE``: Exchange's mailbox submission writes it (a message resubmitted
from a mailbox, as SUBMIT is one submitted), and the transport server's RECEIVE follows."""

MAILBOX_SOURCE = "STOREDRIVER"
"""The source of rows written by a mailbox's submission or delivery (Exchange's store driver)."""

RELEASE_EVENTS = (
    "HADISCARD", "DELIVER", "DUPLICATEDELIVER", "SENDEXTERNAL", "FAIL", "DROP", "BADMAIL",
)
"""The node no longer holds the copy it took. SEND is one only where the sender keeps no copy:
transportd's sender keeps the message as a shadow (hop-by-hop, docs/PROTOCOL.md section 3) until
the next hop's discard, logged as HADISCARD on the sender, where shadow redundancy is on (a node
that wrote no HAREDIRECT, HAREDIRECTFAIL, HARECEIVE or HADISCARD runs without it and keeps
nothing); Exchange 2013 and later move a sent
message into Safety Net once the next hop acknowledges it (no HADISCARD follows on the sender), as
does Exchange 2010 for a next hop outside the logs given (a 2010 hub keeps a shadow only for a
next hop that speaks XSHADOW: another server of the organisation). The ``writer`` of a SEND row
(from its file's ``#Software:`` header and format) decides. REDIRECT is not one either: Exchange
writes it when a recipient is redirected to an alternate recipient, and the message stays where
it is."""

COPY_RELEASE_EVENTS = ("HADISCARD", "BADMAIL")
"""Releases of the whole copy whatever its recipients. The other release events are about the
recipients they name: a node that delivered or failed some of the recipients it took still holds
the message for the others (queued, or handed on by SEND and kept until the next hop's
discard). On a node whose transportd SEND kept a fork, its HADISCARD is the next hop's discard of
that fork: it ends the SENDs' recipients only (``job._per_node``)."""

RESUBMITTED_DISCARD = "Resubmitted"
"""The source-context (first item) of a HADISCARD that is no release: the shadow copy was
resubmitted on the same node (RESUBMIT REDUNDANCY follows), which still holds the message."""

SUCCESS_EVENTS = ("DELIVER", "SENDEXTERNAL", "DUPLICATEDELIVER", "INITMESSAGECREATED")
"""A recipient is done: stored in a mailbox, accepted outside the boundary, already stored, or
(Exchange's INITMESSAGECREATED) handed to moderation: the message went to the arbitration
mailbox for approval, and Exchange acknowledges the moderated recipient as done without a DSN
(an approval resubmits the message: a RECEIVE with source APPROVAL follows)."""

MODERATION_DECISION_EVENTS = ("MODERATORAPPROVE", "MODERATORREJECT", "MODERATORSALLNDR", "MODERATIONEXPIRE")
"""Exchange's moderation decisions: written about the approval request (its message-id, no
network-message-id, internal-message-id 0, the original's Message-Id in ``reference``), not
about a copy in transport: rows about no message."""

FAILED_EVENTS = ("FAIL", "DROP", "BADMAIL")
"""A recipient is done, unsuccessfully: permanent failure or expiry, removed by an operator, or
(Exchange's BADMAIL) a message from the Pickup or Replay directory that can be neither delivered
nor returned."""

RECIPIENT_CHANGE_EVENTS = ("EXPAND", "RESOLVE", "REDIRECT", "DUPLICATEREDIRECT")
"""Exchange's rows that put recipients in the place of others (a distribution group expanded to
its members, an address resolved to the mailbox's primary one, a recipient redirected to an
alternate, or to one that is already a recipient). EXPAND and RESOLVE: recipient-address holds
the new recipients, related-recipient-address the ones they replace; REDIRECT and
DUPLICATEREDIRECT the other way round (``REVERSED_CHANGE_EVENTS``). transportd writes none of
them; a reader follows them, or a message delivered to a group's members reads as the group
never delivered."""

REVERSED_CHANGE_EVENTS = ("REDIRECT", "DUPLICATEREDIRECT")
"""Recipient changes written with the recipient redirected in recipient-address and the alternate
in related-recipient-address. A row naming the same address in both (deliver and forward: the
recipient keeps its copy), or no alternate (a redirection to another connector), replaces
nobody."""

SEND_EVENTS = ("SEND", "SENDEXTERNAL")
"""Events written by the sending server about a hand-over: Exchange names the sending (local)
server in client-hostname and the next hop in server-hostname (docs/TRACKING_LOG.md)."""

CLIENT_SIDE_EVENTS = (
    *SEND_EVENTS, "FAIL", "DEFER", "DROP", "PROCESS", "AGENTINFO", "SUPPRESSED", "THROTTLE",
    "SUBMIT", "SUBMITDEFER", "SUBMITFAIL", "RESUBMITDEFER", "RESUBMITFAIL", "NOTIFYMAPI", "NOTIFYSHADOW",
)
"""Events for which Exchange writes the local server in client-hostname when it writes it at all:
a FAIL or DEFER written by the SMTP send has the remote host that refused or deferred in
server-hostname; the mailbox submission events (SUBMIT, NOTIFYMAPI, ...) have the transport
server they submit to there. So does a RESUBMIT with source STOREDRIVER (a mailbox resubmission)
and a RECEIVE with source AGENT (a recipient added by an agent). When client-hostname is empty
(ours, and Exchange's rows written by the categorizer), the local server is server-hostname."""

LEGACY_CLIENT_SIDE_EVENTS = ("DELIVER", "DUPLICATEDELIVER")
"""In Exchange 2010's (and 2007's) format only: the Hub Transport server's store driver delivers
to a mailbox server and writes itself in client-hostname, the mailbox server (the destination) in
server-hostname. From Exchange 2013 on the mailbox server's own delivery service writes them,
itself in server-hostname."""

DELIVERY_EVENTS = ("SEND", "SENDEXTERNAL", "DELIVER")
"""Every hand-over of a message, listed per message in ``messages/``."""

STATES = (
    "delivered", "failed", "in flight protected", "in flight unprotected", "left the logs", "lost",
    "incomplete",
)
"""Final states, one per message; ``left the logs`` is a message not done whose journey went on
with a SEND to a server whose logs were not given; ``incomplete`` is a message whose entry
(RECEIVE, HARECEIVE or DSN) is not in the logs given (only later hops were read)."""

SEND_FOLLOW_SECONDS = 1.0
"""A SEND is followed in the logs when another node read writes a RECEIVE of the message no
earlier than this before it (clocks of two servers may differ a little); a SEND this close to
the end of the logs is taken as followed (the next hop's row may not be written yet)."""

GENERIC_FOLDERS = ("msgtrk", "messagetracking", "logs", "log", "tracking", "transportroles", "v8", "v14", "v15",
                   "exchange server", "exchange%20server", "microsoft", "program files", "program%20files")
"""When server-hostname is empty the node is the file's folder, or the nearest folder above it
whose name is not one of these generic ones (data/cluster/node1/msgtrk -> node1; Exchange's own
layout, EX6/V15/TransportRoles/Logs/MessageTracking -> EX6; a file's URI writes a blank as %20)."""


def column_name(field: str) -> str:
    """The DataFrame column for a MSGTRK field name (``network-message-id`` -> ``network_message_id``)."""
    return field.replace("-", "_")
