"""The workload: concurrent real SMTP clients sending uniquely numbered messages.

Each client is a thread with smtplib, talking to the frontends of random nodes
and recording every attempt (checker.Attempt): 250 with the queue id, a
rejection, or unknown when the session broke or timed out after DATA began.
Like a real MTA it retries 4xx and unknown outcomes (another node, a short
backoff) until it gets an answer or the retry deadline passes; 5xx is final.
Messages are paced so that the workload spans the nemesis' schedule.
"""

from __future__ import annotations

import random
import smtplib
import threading
import time
from dataclasses import dataclass

from transportd.devtools.chaos.checker import ACK, REFUSED, REJECTED, UNKNOWN, Attempt, Sent
from transportd.smtp.headers import rfc5322_date

LOCAL_DOMAIN = "example.test"       # mailbox database MDB01 on node1
EXTERNAL_DOMAIN = "elsewhere.test"  # routed to the smart host: the sink
# Internationalized messages (RFC 6531/6532): a UTF-8 sender, UTF-8 local parts, raw UTF-8 headers
# and body, sent with SMTPUTF8 and BODY=8BITMIME. The share is drawn from its own seeded stream,
# so the other messages' recipients are those of a run without them.
UTF8_SHARE = 0.15
SENDER, UTF8_SENDER = "client@chaos.test", "klïent@chaos.test"


def internationalized(recipients: list[str]) -> list[str]:
    """The same mailboxes' UTF-8 twins: üser3@example.test, rcpt-ñ7@elsewhere.test."""
    return [r.replace("user", "üser", 1) if r.endswith("@" + LOCAL_DOMAIN) else r.replace("rcpt", "rcpt-ñ", 1)
            for r in recipients]


def recipients_for(number: int, rng: random.Random) -> list[str]:
    """45 % a local mailbox, 45 % an external address, 10 % both (a bifurcated message)."""
    x = rng.random()
    local = f"user{number % 7}@{LOCAL_DOMAIN}"
    external = f"rcpt{number % 13}@{EXTERNAL_DOMAIN}"
    if x < 0.45:
        return [local]
    if x < 0.90:
        return [external]
    return [local, external]


def message_bytes(run: str, number: int, rcpts: list[str], size: int, date: str, utf8: bool = False) -> bytes:
    sender = f"Klïent Ünïcode <{UTF8_SENDER}>" if utf8 else f"<{SENDER}>"
    subject = f"chaos {run} #{number}" + (" — grüße, δοκιμή" if utf8 else "")
    head = (f"From: {sender}\r\nTo: {', '.join('<' + r + '>' for r in rcpts)}\r\n"
            f"Subject: {subject}\r\nMessage-ID: <chaos-{run}-{number}@chaos.test>\r\n"
            f"Date: {date}\r\nX-Chaos-Id: {run}-{number}\r\n"
            + ("MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n"
               "Content-Transfer-Encoding: 8bit\r\n" if utf8 else "") + "\r\n")
    line = (f"message {number} of chaos run {run} " + ("ünïcödé ✓ " if utf8 else "")).ljust(76, ".") + "\r\n"
    body = line * max(1, size // len(line.encode("utf-8")))
    return (head + body).encode("utf-8" if utf8 else "ascii")


@dataclass
class WorkloadSettings:
    messages: int
    clients: int
    rate: float                # messages started per second, all clients together
    timeout: float = 15.0      # per SMTP command
    per_connection: int = 10   # messages over one session before reconnecting elsewhere
    utf8_share: float = UTF8_SHARE  # internationalized messages (SMTPUTF8)


class Workload:
    def __init__(self, run: str, frontends: list[tuple[str, int]], settings: WorkloadSettings, seed: int):
        self.run = run
        self.frontends = frontends
        self.s = settings
        self.seed = seed
        rng = random.Random(seed ^ 0x5EED)
        utf8_rng = random.Random(seed ^ 0x0F8)
        self.history: dict[int, Sent] = {}
        self.sizes: dict[int, int] = {}
        for n in range(1, settings.messages + 1):
            rcpts = recipients_for(n, rng)
            utf8 = utf8_rng.random() < settings.utf8_share
            self.history[n] = Sent(n, internationalized(rcpts) if utf8 else rcpts, utf8=utf8)
            self.sizes[n] = rng.choice((600, 2_000, 8_000, 30_000))
        self.dates = {n: rfc5322_date(time.time()) for n in self.history}
        self._next = 1
        self._lock = threading.Lock()
        self.retry_until = float("inf")   # set by the harness once the nemesis has healed everything
        self.started_at = 0.0
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()

    def start(self) -> None:
        self.started_at = time.monotonic()
        for i in range(self.s.clients):
            t = threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    @property
    def sent_so_far(self) -> int:
        with self._lock:
            return self._next - 1

    def _take(self) -> int | None:
        with self._lock:
            if self._next > self.s.messages:
                return None
            n = self._next
            self._next += 1
        due = self.started_at + (n - 1) / self.s.rate
        delay = due - time.monotonic()
        if delay > 0:
            self.stop.wait(delay)
        return n

    def _client(self, index: int) -> None:
        # Which node each attempt goes to depends on the seed too (a run is replayed by its seed).
        rng = random.Random(f"{self.seed}:{index}:{self.s.messages}")
        conn: smtplib.SMTP | None = None
        used = 0
        while not self.stop.is_set():
            n = self._take()
            if n is None:
                break
            sent = self.history[n]
            data = message_bytes(self.run, n, sent.recipients, self.sizes[n], self.dates[n], utf8=sent.utf8)
            while not self.stop.is_set():
                if conn is None or used >= self.s.per_connection:
                    _quit(conn)
                    conn, used, node = None, 0, rng.choice(self.frontends)
                    try:
                        conn = smtplib.SMTP(node[0], node[1], timeout=self.s.timeout,
                                            local_hostname="client.chaos.test", source_address=("127.0.0.1", 0))
                        conn.ehlo()
                    except (OSError, smtplib.SMTPException) as exc:
                        sent.attempts.append(Attempt(REFUSED, f"{node[0]}", repr(exc)[:120], time.time()))
                        _quit(conn)
                        conn = None
                        if not self._backoff(rng):
                            break
                        continue
                outcome = self._send(conn, sent, data)
                used += 1
                if outcome in (UNKNOWN, REFUSED) or outcome.startswith("4"):
                    _quit(conn)
                    conn = None
                if outcome in (ACK, REJECTED):
                    break
                if not self._backoff(rng):
                    break
        _quit(conn)

    def _backoff(self, rng: random.Random) -> bool:
        """Wait before a retry; False when the retry deadline has passed."""
        if time.monotonic() > self.retry_until:
            return False
        self.stop.wait(rng.uniform(0.2, 1.0))
        return not self.stop.is_set()

    def _send(self, conn: smtplib.SMTP, sent: Sent, data: bytes) -> str:
        node = conn._host if hasattr(conn, "_host") else ""
        try:
            node = conn.sock.getpeername()[0] if conn.sock else node
            if sent.utf8:
                # smtplib's sendmail(..., mail_options=["SMTPUTF8", ...]) path: MAIL with SMTPUTF8
                # switches the session's commands to UTF-8 (SMTPNotSupportedError if not offered).
                code, msg = conn.mail(UTF8_SENDER, ["SMTPUTF8", "BODY=8BITMIME"])
            else:
                code, msg = conn.mail(SENDER)
            if code != 250:
                return self._rejected(sent, node, code, msg, before_data=True)
            for r in sent.recipients:
                code, msg = conn.rcpt(r)
                if code != 250:
                    conn.rset()
                    return self._rejected(sent, node, code, msg, before_data=True)
        except (OSError, smtplib.SMTPException, UnicodeError) as exc:
            # UnicodeError: a UTF-8 envelope on a session without SMTPUTF8 (the EHLO was refused,
            # so smtplib never switched to UTF-8): nothing was sent, no transaction possible.
            sent.attempts.append(Attempt(REFUSED, node, repr(exc)[:120], time.time()))
            return REFUSED
        try:
            code, msg = conn.data(data)
        except smtplib.SMTPDataError as exc:   # 354 not given
            return self._rejected(sent, node, exc.smtp_code, exc.smtp_error, before_data=True)
        except (TimeoutError, OSError, smtplib.SMTPException) as exc:
            sent.attempts.append(Attempt(UNKNOWN, node, repr(exc)[:120], time.time()))
            return UNKNOWN
        text = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
        if code == 250:
            sent.attempts.append(Attempt(ACK, node, text[:120], time.time()))
            return ACK
        return self._rejected(sent, node, code, msg, before_data=False)

    @staticmethod
    def _rejected(sent: Sent, node: str, code: int, msg: bytes | str, before_data: bool) -> str:
        text = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
        kind = REFUSED if before_data else REJECTED
        if 500 <= code < 600:
            kind = REJECTED
        sent.attempts.append(Attempt(kind, node, f"{code} {text}"[:120], time.time()))
        return REJECTED if 500 <= code < 600 else f"{code}"


def _quit(conn: smtplib.SMTP | None) -> None:
    if conn is None:
        return
    try:
        conn.quit()
    except (OSError, smtplib.SMTPException):
        try:
            conn.close()
        except OSError:
            pass
