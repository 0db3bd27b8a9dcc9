"""Configuration: duration/size/host:port parsing, the key registry, the frozen typed Config, ranges,
unknown-name suggestions, cross-checks, the shipped files."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest

from transportd import config as cfgmod
from transportd.config import (
    KEYS, ConfigError, format_duration, format_size, format_value, load, load_dict, parse_duration,
    parse_hostport, parse_size,
)

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- parse_duration

@pytest.mark.parametrize("value, seconds", [
    (0, 0.0), (30, 30.0), (0.5, 0.5), (2.25, 2.25),
    ("90", 90.0), ("0.5", 0.5), ("90s", 90.0), ("5m", 300.0), ("2h", 7200.0), ("2d", 172800.0),
    ("1w", 604800.0), ("250ms", 0.25), ("1h30m", 5400.0), ("1h 30m", 5400.0), ("1d2h3m4s", 93784.0),
    ("1.5h", 5400.0), ("5M", 300.0), (" 5m ", 300.0),
    ("02:00:00", 7200.0), ("00:05:30", 330.0), ("2.00:00:00", 172800.0), ("1.02:03:04", 93784.0),
    ("00:00:01.5", 1.5),
])
def test_parse_duration_accepts(value, seconds) -> None:
    assert parse_duration(value) == pytest.approx(seconds)
    assert isinstance(parse_duration(value), float)


@pytest.mark.parametrize("value", [
    "", " ", "abc", "5x", "m5", "5m3", "1h30", "h", "-5", "-5m", "nan", "inf", "1:2", "02:00",
    "5 minutes", "1h,30m", True, False, None, [5], {"s": 5}, -1, float("nan"), float("inf"),
    "02:99:00", "00:00:60", "00:60:00", "1.24:00:00",  # a TimeSpan's minutes and seconds are under 60
    pytest.param(10 ** 400, id="huge-int"),
])
def test_parse_duration_rejects_with_value_error(value) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("seconds", [1, 59, 60, 90, 3600, 5400, 86400, 172800, 0.5])
def test_format_duration_round_trips(seconds) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


# --------------------------------------------------------------------------- parse_size

@pytest.mark.parametrize("value, size", [
    (0, 0), (1048576, 1048576), ("100", 100), ("100B", 100), ("10KB", 10240), ("10kb", 10240),
    ("36MB", 36 * 1024 ** 2), ("1GiB", 1024 ** 3), ("1 MiB", 1024 ** 2), ("1.5KB", 1536),
])
def test_parse_size_accepts(value, size) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize("value", [
    "", "abc", "10XB", "KB", "-1", "-1KB", "1e3", -1, 1.5, True, None, [1],
    pytest.param("9" * 400 + "GB", id="huge-string"),
])
def test_parse_size_rejects_with_value_error(value) -> None:
    with pytest.raises(ValueError):
        parse_size(value)


@pytest.mark.parametrize("size", [1, 1000, 1024, 10240, 36 * 1024 ** 2, 1024 ** 3])
def test_format_size_round_trips(size) -> None:
    assert parse_size(format_size(size)) == size


# --------------------------------------------------------------------------- parse_hostport

@pytest.mark.parametrize("value, expected", [
    ("127.0.0.1:2525", ("127.0.0.1", 2525)), (" mail.example.test:25 ", ("mail.example.test", 25)),
    ("[::1]:2525", ("::1", 2525)), ("localhost:65535", ("localhost", 65535)), ("h:1", ("h", 1)),
])
def test_parse_hostport_accepts(value, expected) -> None:
    assert parse_hostport(value) == expected


def test_parse_hostport_default_port() -> None:
    assert parse_hostport("smtp.example.test", default_port=25) == ("smtp.example.test", 25)
    assert parse_hostport("[::1]", default_port=587) == ("::1", 587)
    with pytest.raises(ValueError, match="with a port"):
        parse_hostport("smtp.example.test")


@pytest.mark.parametrize("name, kept", [
    ("node1.example.test", "node1.example.test"), ("MX-1.Example.TEST.", "MX-1.Example.TEST"), ("node1", "node1"),
    ("a" * 63 + ".test", "a" * 63 + ".test"), ("9node.example.test", "9node.example.test"),
])
def test_node_name_takes_host_names(name, kept) -> None:
    assert load_dict({"node": {"name": name}}).node.name == kept


@pytest.mark.parametrize("name", [
    "node 1.example.test", "node_1.example.test", "-node.example.test", "node-.example.test", "a..b.test",
    "a" * 64 + ".test", "ü.example.test", "node1.example.test:25", ".".join(["abcdefgh"] * 30),
])
def test_node_name_that_is_no_host_name_is_refused(name) -> None:
    """node.name is the EHLO name: a name no next hop could take is a configuration error."""
    with pytest.raises(ConfigError, match=r"^n\.toml: node\.name: .* is not a host name "):
        load_dict({"node": {"name": name}}, source="n.toml")


@pytest.mark.parametrize("value", [
    "", "   ", "host:0", "host:65536", "host:abc", "::1:25", "a b:25", "host:25:26", ":25", 2525, None,
])
def test_parse_hostport_rejects(value) -> None:
    with pytest.raises(ValueError):
        parse_hostport(value)


# --------------------------------------------------------------------------- registry

@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.dotted)
def test_every_key_has_a_default_that_parses(key) -> None:
    assert key.meaning
    parsed = key.parse(key.default)
    if key.kind == cfgmod.DUR:
        assert isinstance(parsed, float) and parsed >= 0
        assert key.parse(format_value(key, parsed)) == parsed
    if key.kind == cfgmod.SIZE:
        assert isinstance(parsed, int) and parsed > 0
        assert key.parse(format_value(key, parsed)) == parsed


def test_keys_are_unique_and_defaults_are_effective(tmp_path: Path) -> None:
    dotted = [k.dotted for k in KEYS]
    assert len(dotted) == len(set(dotted))
    cfg = load_dict({}, base_dir=tmp_path)
    for key, value in cfg.effective():
        expected = key.parse(key.default) if key.default != "" else key.default
        if key.dotted == "node.name":
            assert value  # filled from the host name
        else:
            assert value == expected, key.dotted
    assert cfg.frontend.max_message_size == 36 * 1024 ** 2
    assert cfg.delivery.message_expiration_timeout == 2 * 86400
    assert cfg.mailbox.duplicate_detection_window == 3600
    assert cfg.data_dir == tmp_path / "data"
    assert cfg.db_path == tmp_path / "data" / "queue.db"
    assert cfg.tracking_dir == tmp_path / "data" / "msgtrk"
    assert cfg.mailbox_dir == tmp_path / "data" / "mailboxes"


def test_defaults_are_not_shared_between_configs() -> None:
    a = load_dict({})
    b = load_dict({})
    a.routing.accepted_domains.append("x.test")
    a.frontend.auth_users["u"] = "p"
    assert b.routing.accepted_domains == [] and b.frontend.auth_users == {}
    assert load_dict({}).routing.accepted_domains == []


# --------------------------------------------------------------------------- load_dict errors

@pytest.mark.parametrize("raw, where", [
    ({"frontend": {"max_recipients_per_message": "many"}}, "frontend.max_recipients_per_message: expected an integer"),
    ({"frontend": {"max_recipients_per_message": 0}},
     "frontend.max_recipients_per_message: 0 is out of range (1..512000)"),
    ({"frontend": {"max_recipients_per_message": True}}, "frontend.max_recipients_per_message:"),
    ({"frontend": {"require_tls": "yes"}}, "frontend.require_tls: expected true or false"),
    ({"frontend": {"listen": "127.0.0.1"}}, "frontend.listen:"),
    ({"frontend": {"listen": []}}, "frontend.listen: expected 'host:port' or a list of them"),
    ({"routing": {"smart_host": ["a.test", "a.test:25"]}}, "routing.smart_host: a.test:25 is listed twice"),
    ({"routing": {"smart_host": ["a.test:99999"]}}, "routing.smart_host: port must be 1-65535"),
    ({"send_connectors": [{"name": "a"}]}, "send_connectors[0].address_spaces: required"),
    ({"send_connectors": [{"name": "a", "address_spaces": ["x.test"], "smarthost": "b"}]},
     "send_connectors[0].smarthost: unknown key; did you mean 'smart_hosts'?"),
    ({"send_connectors": [{"name": "a", "address_spaces": ["x.test"], "smart_hosts": "b:0"}]},
     "send_connectors[0].smart_hosts: port must be 1-65535"),
    ({"send_connectors": [{"name": "a", "address_spaces": ["x.test"], "tls_auth_level": "DomainValidation"}]},
     "send_connectors[0].require_tls: tls_auth_level and tls_ca apply where TLS is required"),
    ({"send_connectors": [{"name": "a", "address_spaces": ["x.test"], "require_tls": True, "tls_auth_level": "x"}]},
     "send_connectors[0].tls_auth_level: expected one of EncryptionOnly, CertificateValidation, DomainValidation"),
    ({"send_connectors": [{"name": "a", "address_spaces": ["x.test"], "smart_hosts": "r.test"},
                          {"name": "b", "address_spaces": ["y.test"], "smart_hosts": "r.test", "require_tls": True}]},
     "send_connectors[1].smart_hosts: the same as send connector a's, with other TLS settings"),
    ({"frontend": {"listen": ["127.0.0.1:25", "127.0.0.1:25"]}}, "frontend.listen: 127.0.0.1:25 is listed twice"),
    ({"delivery": {"external_dns_servers": ["dns.example.test"]}},
     "delivery.external_dns_servers: 'dns.example.test' is not a DNS server address"),
    ({"frontend": {"max_message_size": "big"}}, "frontend.max_message_size:"),
    ({"frontend": {"connection_timeout": "soon"}}, "frontend.connection_timeout:"),
    ({"frontend": {"connection_timeout": 0}}, "frontend.connection_timeout: 0s is out of range (1s..1d)"),
    ({"frontend": {"auth_users": {"u": 5}}}, "frontend.auth_users:"),
    ({"node": {"name": 5}}, "node.name: expected a string"),
    ({"node": {"log_level": "loud"}}, "node.log_level: expected one of debug, info, warning, error"),
    ({"node": {"log_format": "xml"}}, "node.log_format:"),
    ({"node": {"bogus": 1}}, "node.bogus: unknown key"),
    ({"frontend": {"max_message_sise": 1}},
     "frontend.max_message_sise: unknown key; did you mean 'max_message_size'?"),
    ({"bogus": {"x": 1}}, "unknown section [bogus]"),
    ({"node": "x"}, "[node] must be a table"),
    ({"routing": {"trusted_networks": ["10.0.0.0/33"]}}, "routing.trusted_networks: not an IP network: '10.0.0.0/33'"),
    ({"routing": {"trusted_networks": ["not-a-net"]}}, "routing.trusted_networks:"),
    ({"routing": {"trusted_networks": "127.0.0.1/32"}}, "routing.trusted_networks: expected a list of strings"),
    ({"routing": {"accepted_domains": ["exa mple.test"]}}, "routing.accepted_domains: not a domain name"),
    ({"routing": {"accepted_domains": ["ex*ample.test"]}}, "routing.accepted_domains:"),
    ({"routing": {"smart_host": "h:0"}}, "routing.smart_host:"),
    ({"delivery": {"transient_failure_retry_count": -1}},
     "delivery.transient_failure_retry_count: -1 is out of range (0..15)"),
    ({"delivery": {"queue_poll_interval": 0}}, "delivery.queue_poll_interval: 0s is out of range (0.01s..1m)"),
    ({"delivery": {"message_expiration_timeout": 10 ** 400}}, "delivery.message_expiration_timeout:"),
    ({"shadow_redundancy": {"shadow_message_preference_setting": "Anywhere"}},
     "shadow_redundancy.shadow_message_preference_setting: expected one of PreferRemote"),
    ({"shadow_redundancy": {"shadow_heartbeat_frequency": 0}}, "shadow_redundancy.shadow_heartbeat_frequency:"),
    ({"tracking": {"message_tracking_log_max_file_size": "9" * 400 + "GB"}},
     "tracking.message_tracking_log_max_file_size:"),
])
def test_load_dict_errors_name_the_key(raw, where) -> None:
    with pytest.raises(ConfigError) as info:
        load_dict(raw, source="node.toml")
    msg = str(info.value)
    assert msg.startswith("node.toml: ")
    assert where in msg
    assert "\n" not in msg


def test_enum_is_case_insensitive_and_canonical() -> None:
    cfg = load_dict({"node": {"log_level": "DEBUG"},
                     "shadow_redundancy": {"shadow_message_preference_setting": "localonly"}})
    assert cfg.node.log_level == "debug"
    assert cfg.shadow_redundancy.shadow_message_preference_setting == "LocalOnly"


def test_values_are_normalised() -> None:
    cfg = load_dict({
        "routing": {"accepted_domains": ["Example.TEST.", "*.Sub.Example.test"],
                    "trusted_networks": ["10.1.2.3/8", "::1/128"], "smart_host": "relay.test"},
        "frontend": {"listen": "[::1]:2525", "max_message_size": "10MB"},
        "delivery": {"message_expiration_timeout": "1.00:00:00"},
    })
    assert cfg.routing.accepted_domains == ["example.test", "*.sub.example.test"]
    assert cfg.routing.trusted_networks == [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")]
    assert cfg.routing.smart_host == "relay.test:25"
    # Several smart hosts: a list, or Postfix's relayhost way (commas or blanks); the queue's next hop.
    for several in (["relay1.test", "[::1]:2525"], "relay1.test, [::1]:2525", "relay1.test [::1]:2525"):
        assert load_dict({"routing": {"smart_host": several}}).routing.smart_host == "relay1.test:25,[::1]:2525"
    assert cfg.frontend.listen == ["[::1]:2525"]  # what config show prints reads back
    assert cfgmod.parse_hostport(cfg.frontend.listen[0]) == ("::1", 2525)
    assert cfg.frontend.max_message_size == 10 * 1024 ** 2
    assert cfg.delivery.message_expiration_timeout == 86400.0


def test_peers_are_parsed_and_checked() -> None:
    raw = {"node": {"name": "node1.t"}, "transport": {"listen": "127.0.0.11:2526"}, "cluster": {"secret": "s"},
           "peers": [{"name": "Node2.T", "site": "site-b", "transport": "127.0.0.12:2526"}]}
    cfg = load_dict(raw)
    assert [(p.name, p.site, p.transport) for p in cfg.peers] == [("node2.t", "site-b", "127.0.0.12:2526")]
    with pytest.raises(ConfigError, match=r"peers: expected \[\[peers\]\] tables"):
        load_dict({"peers": {"node2": "127.0.0.1:2526"}})
    with pytest.raises(ConfigError, match=r"cluster.secret"):
        load_dict({**raw, "cluster": {}})
    with pytest.raises(ConfigError, match=r"peers\[0\].site"):
        load_dict({**raw, "peers": [{"name": "n2.t", "transport": "127.0.0.1:1"}]})
    with pytest.raises(ConfigError, match=r"is this node itself"):
        load_dict({**raw, "peers": [{"name": "node1.t", "site": "a", "transport": "127.0.0.1:1"}]})
    with pytest.raises(ConfigError, match=r"peers\[0\].name: 'bad name' is not a host name"):
        load_dict({**raw, "peers": [{"name": "bad name", "site": "a", "transport": "127.0.0.1:1"}]})
    with pytest.raises(ConfigError, match=r"peers.node2.t.transport: 127.0.0.11:2526 is this node's own "
                                          r"transport.listen"):
        load_dict({**raw, "peers": [{"name": "node2.t", "site": "a", "transport": "127.0.0.11:2526"}]})
    with pytest.raises(ConfigError, match=r"peers.node3.t.transport: 127.0.0.12:2526 is also peer node2.t's"):
        load_dict({**raw, "peers": raw["peers"] + [{"name": "node3.t", "site": "a", "transport": "127.0.0.12:2526"}]})


def test_a_mailbox_database_routing_names_must_be_in_mailbox_databases() -> None:
    """route() takes a database with no owner for this node's: with its owner taken out of
    [mailbox_databases] (a node drained away), every remaining node would deliver its mail into
    its own store. So a database routing names must be listed, once there is a table at all."""
    raw = {"node": {"name": "node2.t"}, "transport": {"listen": "127.0.0.12:2526"}, "cluster": {"secret": "s"},
           "peers": [{"name": "node3.t", "site": "site-b", "transport": "127.0.0.13:2526"}],
           "routing": {"accepted_domains": ["example.test"], "mailbox_database": "MDB01"},
           "mailbox_databases": {"MDB02": "node2.t", "MDB03": "node3.t"}}
    with pytest.raises(ConfigError, match=r"routing.mailbox_database: mailbox database MDB01 is not in "
                                          r"\[mailbox_databases\]"):
        load_dict(raw)
    with pytest.raises(ConfigError, match=r"routing.mailbox_database_rules: mailbox database MDB09 is not in "
                                          r"\[mailbox_databases\]"):
        load_dict({**raw, "routing": {**raw["routing"], "mailbox_database": "MDB02",
                                      "mailbox_database_rules": ["dave@example.test=MDB09"]}})
    # Handed to another node: listed again, fine.
    cfg = load_dict({**raw, "mailbox_databases": {**raw["mailbox_databases"], "MDB01": "node2.t"}})
    assert cfg.mailbox_databases["MDB01"] == "node2.t"
    # No table at all: the database is this node's own local store, as before.
    assert load_dict({"routing": {"mailbox_database": "MDB07",
                                  "mailbox_database_rules": ["*@b.test=MDB08"]}}).routing.mailbox_database == "MDB07"


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*/*.toml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_cluster_configs_name_listed_mailbox_databases(path: Path) -> None:
    import tomllib
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    raw["cluster"] = {"secret": "s"}  # compose's comes from a file that only exists in the container
    cfg = load_dict(raw)
    assert cfg.routing.mailbox_database in cfg.mailbox_databases


@pytest.mark.parametrize("listen, smart_host, loops", [
    ("127.0.0.186:2710", "127.0.0.186:2710", True),
    ("127.0.0.1:2710", "localhost:2710", True),
    ("0.0.0.0:2710", "127.0.0.5:2710", True),      # every address: loopback reaches it
    ("0.0.0.0:2710", "10.0.0.5:2710", False),      # perhaps another machine: not certain
    ("127.0.0.186:2710", "127.0.0.186:2711", False),
    ("127.0.0.2:2710", "127.0.0.1:2710", False),
])
def test_a_smart_host_that_is_this_nodes_own_listener_is_refused(listen, smart_host, loops) -> None:
    """Mail sent to its own frontend would come back and loop until the hop count failed it (a
    message became 122 queued copies and a looping DSN); Postfix says "loops back to myself"."""
    raw = {"frontend": {"listen": listen}, "routing": {"smart_host": smart_host}}
    if not loops:
        assert load_dict(raw).routing.smart_host == smart_host
        return
    with pytest.raises(ConfigError, match=rf"routing.smart_host: {smart_host} is this node's own frontend.listen"):
        load_dict(raw)
    connector = {"name": "out", "address_spaces": ["*"], "smart_hosts": smart_host}
    with pytest.raises(ConfigError, match=r"send_connectors.out.smart_hosts: .* would loop back to this node"):
        load_dict({"frontend": {"listen": listen}, "send_connectors": [connector]})


def test_the_cluster_secret_can_come_from_a_file(tmp_path: Path) -> None:
    """cluster.secret_file (a compose secret at /run/secrets/...): its first line is the secret."""
    (tmp_path / "cluster-secret").write_text("from-a-file\nignored\n")
    raw = {"node": {"name": "node1.t"}, "transport": {"listen": "127.0.0.11:2526"},
           "cluster": {"secret_file": "cluster-secret"},
           "peers": [{"name": "node2.t", "site": "site-b", "transport": "127.0.0.12:2526"}]}
    cfg = load_dict(raw, base_dir=tmp_path)
    assert cfg.cluster.secret == "from-a-file"
    assert cfg.cluster.secret_file == str(tmp_path / "cluster-secret")
    assert "from-a-file" not in repr(cfg.cluster)
    with pytest.raises(ConfigError, match=r"cluster.secret_file: set either"):
        load_dict({**raw, "cluster": {"secret": "s", "secret_file": "cluster-secret"}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"cluster.secret_file: no such file"):
        load_dict({**raw, "cluster": {"secret_file": "missing"}}, base_dir=tmp_path)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"cluster.secret_file: .* is empty"):
        load_dict({**raw, "cluster": {"secret_file": "empty"}}, base_dir=tmp_path)


@pytest.mark.parametrize("value, expected", [
    ("1h", 3600.0), ("49d", 49 * 86400.0), ("49.00:00:00", 49 * 86400.0),
    ("50d", 86400.0), (49 * 86400 + 1, 86400.0), ("365d", 86400.0), (0, 0.0),
])
def test_duplicate_detection_window_over_49_days_falls_back_to_a_day(value, expected) -> None:
    cfg = load_dict({"mailbox": {"duplicate_detection_window": value}})
    assert cfg.mailbox.duplicate_detection_window == expected


# --------------------------------------------------------------------------- TLS cross-checks

def test_tls_certificate_without_key(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match=r"frontend\.tls_key: tls_certificate and tls_key must be set together"):
        load_dict({"frontend": {"tls_certificate": str(cert)}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"frontend\.tls_key:"):
        load_dict({"frontend": {"tls_key": str(cert)}}, base_dir=tmp_path)


def test_tls_files_resolve_against_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("c")
    (tmp_path / "key.pem").write_text("k")
    cfg = load_dict({"frontend": {"tls_certificate": "cert.pem", "tls_key": "key.pem", "require_tls": True}},
                    base_dir=tmp_path)
    assert cfg.frontend.tls_certificate == str(tmp_path / "cert.pem")
    assert cfg.frontend.tls_key == str(tmp_path / "key.pem")
    with pytest.raises(ConfigError, match=r"frontend\.tls_key: no such file"):
        load_dict({"frontend": {"tls_certificate": "cert.pem", "tls_key": "missing.pem"}}, base_dir=tmp_path)


def test_tls_files_that_are_not_what_the_key_names_are_refused_naming_it(tmp_path: Path) -> None:
    """A folder given as a file said "no such file"; a CA bundle of garbage was taken, to fail every
    TLS session to the peers later."""
    (tmp_path / "cert.pem").write_text("c")
    (tmp_path / "keys").mkdir()
    with pytest.raises(ConfigError, match=r"frontend\.tls_key: not a regular file: .*keys"):
        load_dict({"frontend": {"tls_certificate": "cert.pem", "tls_key": "keys"}}, base_dir=tmp_path)
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"transport\.tls_ca: .*ca\.pem holds no PEM certificate"):
        load_dict({"transport": {"tls_ca": "ca.pem"}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"send_connectors\[0\]\.tls_ca: .*holds no PEM certificate"):
        load_dict({"send_connectors": [{"name": "out", "address_spaces": ["*"], "smart_hosts": "127.0.0.1:25",
                                        "require_tls": True, "tls_ca": "ca.pem"}]}, base_dir=tmp_path)


@pytest.mark.parametrize(("values", "needle"), [
    ({"transport": {"listen": "127.0.0.1:2525"}}, "transport.listen: 127.0.0.1:2525 is also where frontend.listen"),
    ({"metrics": {"listen": "2525"}}, "metrics.listen: 127.0.0.1:2525 is also where frontend.listen"),
    ({"frontend": {"listen": "0.0.0.0:2600"}, "transport": {"listen": "127.0.0.5:2600"}},
     "transport.listen: 127.0.0.5:2600 is also where frontend.listen listens (0.0.0.0:2600)"),
])
def test_two_listeners_on_one_address_and_port_are_refused_naming_both(values, needle) -> None:
    """They failed at start ("address already in use") after the first listener had been opened."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_dict(values)
    load_dict({"frontend": {"listen": "[::1]:2600"}, "transport": {"listen": "127.0.0.5:2600"}})  # two families


def test_require_tls_and_auth_need_a_certificate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"frontend\.require_tls:"):
        load_dict({"frontend": {"require_tls": True}})
    with pytest.raises(ConfigError, match=r"frontend\.auth_users:"):
        load_dict({"frontend": {"auth_users": {"u": "p"}}})
    with pytest.raises(ConfigError, match=r"frontend\.implicit_tls_listen: needs frontend\.tls_certificate"):
        load_dict({"frontend": {"implicit_tls_listen": "0.0.0.0:465"}})
    (tmp_path / "cert.pem").write_text("c")
    (tmp_path / "key.pem").write_text("k")
    tls = {"tls_certificate": "cert.pem", "tls_key": "key.pem"}
    with pytest.raises(ConfigError, match=r"frontend\.implicit_tls_listen: 127\.0\.0\.1:2525 is also in frontend\.listen"):
        load_dict({"frontend": {**tls, "implicit_tls_listen": ["127.0.0.1:2525"]}}, base_dir=tmp_path)
    cfg = load_dict({"frontend": {**tls, "implicit_tls_listen": "0.0.0.0:465"}}, base_dir=tmp_path)
    assert cfg.frontend.implicit_tls_listen == ["0.0.0.0:465"]
    assert load_dict({}).frontend.implicit_tls_listen == []


# --------------------------------------------------------------------------- files

def test_relative_data_dir_resolves_against_the_config_folder(tmp_path: Path, monkeypatch) -> None:
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (conf_dir / "node.toml").write_text(
        '[node]\ndata_dir = "../var/data"\n[tracking]\nmessage_tracking_log_path = "logs/trk"\n')
    monkeypatch.chdir(elsewhere)
    cfg = load(Path("..") / "etc" / "node.toml")
    assert cfg.data_dir.resolve() == (tmp_path / "var" / "data").resolve()
    assert cfg.db_path.resolve() == (tmp_path / "var" / "data" / "queue.db").resolve()
    assert cfg.tracking_dir.resolve() == (conf_dir / "logs" / "trk").resolve()
    assert cfg.path == Path("..") / "etc" / "node.toml"


def test_absolute_data_dir_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "abs"
    (tmp_path / "n.toml").write_text(f'[node]\ndata_dir = "{target}"\n')
    assert load(tmp_path / "n.toml").data_dir == target


def test_load_file_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[node\nname = 1\n")
    with pytest.raises(ConfigError, match="TOML syntax error"):
        load(bad)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[node]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(latin)
    typed = tmp_path / "typed.toml"
    typed.write_text('[frontend]\nmax_message_size = "huge"\n')
    with pytest.raises(ConfigError) as info:
        load(typed)
    assert str(info.value).startswith(f"{typed}: frontend.max_message_size:")


def test_shipped_single_node_config_loads() -> None:
    path = REPO / "config" / "single-node.toml"
    cfg = load(path)
    assert cfg.frontend.listen == ["127.0.0.1:2525"]
    assert parse_hostport(cfg.frontend.listen[0]) == ("127.0.0.1", 2525)
    assert cfg.routing.accepted_domains == ["example.test"]
    assert cfg.routing.smart_host == "127.0.0.1:2500"
    assert cfg.routing.trusted_networks == [ipaddress.ip_network("127.0.0.1/32")]
    assert cfg.node.name == "node1.transportd.test"
    assert cfg.shadow_redundancy.shadow_redundancy_enabled is False
    assert cfg.data_dir.resolve() == (REPO / "data" / "single-node").resolve()
    assert cfg.frontend.max_message_size == 36 * 1024 ** 2
    assert cfg.delivery.transient_failure_retry_interval == 300.0


def test_default_for_data_dir(tmp_path: Path) -> None:
    cfg = cfgmod.default_for_data_dir(tmp_path / "d")
    assert cfg.data_dir == (tmp_path / "d").resolve()
    assert cfg.db_path == (tmp_path / "d").resolve() / "queue.db"


def test_format_value_hides_passwords() -> None:
    key = next(k for k in KEYS if k.dotted == "frontend.auth_users")
    assert "secret" not in format_value(key, {"user": "secret"})
    assert format_value(next(k for k in KEYS if k.dotted == "frontend.require_tls"), False) == "false"


def test_readme_config_reference_is_current() -> None:
    """README.md's table is what `transportd config reference` prints: a new key cannot go undocumented."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert cfgmod.markdown_reference() in readme


# --------------------------------------------------------------------------- typed, frozen Config

def test_config_is_built_from_one_frozen_dataclass_per_section() -> None:
    cfg = load_dict({})
    assert [f.name for f in dataclasses.fields(cfg)][:len(cfgmod.SECTIONS)] == list(cfgmod.SECTIONS)
    for section in cfgmod.SECTIONS:
        settings = getattr(cfg, section)
        assert type(settings) is cfgmod.SECTION_TYPES[section]
        assert dataclasses.is_dataclass(settings) and type(settings).__dataclass_params__.frozen
        assert [f.name for f in dataclasses.fields(settings)] == [k.name for k in KEYS if k.section == section]
    assert type(cfg.delivery) is cfgmod.DeliverySettings and type(cfg.node) is cfgmod.NodeSettings
    assert type(cfg.shadow_redundancy).__name__ == "ShadowRedundancySettings"
    assert cfg.delivery.transient_failure_retry_interval == 300.0
    assert cfg.peers == () and cfg.mailbox_databases == {} and cfg.path is None


@pytest.mark.parametrize("read", [
    lambda cfg: cfg.delivery.transient_failure_retry_intervall,
    lambda cfg: cfg.delivery.retry_interval,
    lambda cfg: cfg.deliveries,
    lambda cfg: cfg.shadow_redundancy.heartbeat_frequency,
    lambda cfg: cfg.node.fqdn,
], ids=["typo", "short-name", "section-typo", "wrong-name", "no-such-key"])
def test_a_misspelt_attribute_raises_attribute_error(read) -> None:
    with pytest.raises(AttributeError):
        read(load_dict({}))


@pytest.mark.parametrize("write", [
    lambda cfg: setattr(cfg.delivery, "transient_failure_retry_interval", 1.0),
    lambda cfg: setattr(cfg.node, "data_dir", "/elsewhere"),
    lambda cfg: setattr(cfg.routing, "accepted_domains", None),
    lambda cfg: setattr(cfg, "delivery", None),
    lambda cfg: setattr(cfg, "peers", ()),
    lambda cfg: setattr(cfg, "path", Path("x.toml")),
    lambda cfg: setattr(cfg.delivery, "transient_failure_retry_intervall", 1.0),
    lambda cfg: setattr(cfg, "anything_new", 1),
], ids=["key", "data-dir", "list-key", "section", "peers", "path", "new-key", "new-attribute"])
def test_assigning_to_a_config_raises(write) -> None:
    cfg = load_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        write(cfg)
    assert cfg.delivery.transient_failure_retry_interval == 300.0 and cfg.node.data_dir == "./data"


def test_secrets_are_not_in_the_repr(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("c")
    (tmp_path / "k.pem").write_text("k")
    cfg = load_dict({"cluster": {"secret": "s3cr3t-value"},
                     "frontend": {"tls_certificate": "c.pem", "tls_key": "k.pem", "auth_users": {"u": "pw-value"}}},
                    base_dir=tmp_path)
    assert "s3cr3t-value" not in repr(cfg) and "pw-value" not in repr(cfg)
    assert cfg.cluster.secret == "s3cr3t-value" and cfg.frontend.auth_users == {"u": "pw-value"}


def test_with_overrides_is_a_validated_copy(tmp_path: Path) -> None:
    path = tmp_path / "n.toml"
    path.write_text('[node]\nname = "n1.test"\n[delivery]\nqueue_poll_interval = 0.2\n')
    cfg = load(path)
    moved = cfg.with_overrides({"node": {"data_dir": str(tmp_path / "d")}})
    assert moved.data_dir == tmp_path / "d" and moved.path == path
    assert moved.node.name == "n1.test" and moved.delivery.queue_poll_interval == 0.2
    assert cfg.data_dir == tmp_path / "data"
    with pytest.raises(ConfigError, match=r"^.*n\.toml: delivery\.queue_poll_interval: 2m is out of range"):
        cfg.with_overrides({"delivery": {"queue_poll_interval": "2m"}})


def test_config_error_is_the_one_from_errors() -> None:
    from transportd import errors
    assert cfgmod.ConfigError is errors.ConfigError
    assert issubclass(ConfigError, errors.TransportdError)


# --------------------------------------------------------------------------- ranges

WORDS = {"auto"}  # a numeric key may also take a word (frontend.workers = auto)
NUMERIC = [k for k in KEYS if k.kind in (cfgmod.DUR, cfgmod.SIZE)
           or (isinstance(k.default, int) and not isinstance(k.default, bool))
           or k.parse is cfgmod._workers]
RANGED = [k for k in KEYS if k.limits is not None]


def test_every_numeric_key_has_a_range_holding_its_default() -> None:
    assert [k.dotted for k in NUMERIC] == [k.dotted for k in RANGED]
    for key in RANGED:
        low, high = key.limits
        assert low < high, key.dotted
        default = key.parse(key.default)
        assert default in WORDS or low <= default <= high, key.dotted


def _step(key: cfgmod.Key, bound: float) -> float:
    """The smallest step that leaves the range at ``bound``: one unit, or a millisecond of a timer."""
    return min(0.001, bound / 2 or 0.001) if key.kind == cfgmod.DUR else 1


# The other side of each cross-check, set so that a bound of this key is judged on its range alone.
COMPANIONS = {
    "frontend.connection_timeout": {"connection_inactivity_timeout": 1},
    "frontend.connection_inactivity_timeout": {"connection_timeout": "1d"},
    "shadow_redundancy.shadow_heartbeat_frequency": {"shadow_resubmit_time_span": "1d",
                                                     "shadow_message_auto_discard_interval": "90d"},
    "shadow_redundancy.shadow_resubmit_time_span": {"shadow_heartbeat_frequency": 0.1},
    "shadow_redundancy.shadow_message_auto_discard_interval": {"shadow_heartbeat_frequency": 0.1},
    "shadow_redundancy.min_shadow_copies": {"shadow_copies": 9},
    "tracking.message_tracking_log_max_file_size": {"message_tracking_log_max_directory_size": "unlimited"},
}


def _alone(key: cfgmod.Key, value: Any) -> dict:
    return {key.section: {**COMPANIONS.get(key.dotted, {}), key.name: value}}


@pytest.mark.parametrize("key", RANGED, ids=lambda k: k.dotted)
def test_range_boundaries(key) -> None:
    low, high = key.limits
    for value in (low, high):
        cfg = load_dict(_alone(key, value))
        assert getattr(getattr(cfg, key.section), key.name) == value, value
    outside = [high + _step(key, high)]
    if key.dotted == "mailbox.duplicate_detection_window":
        outside = []  # past 49 days Exchange falls back to 24 hours (test above)
    if low > 0:
        outside.append(low - _step(key, low))
    for value in outside:
        with pytest.raises(ConfigError) as info:
            load_dict(_alone(key, value), source="n.toml")
        shown = cfgmod.format_value(key, value)
        assert str(info.value) == f"n.toml: {key.dotted}: {shown} is out of range ({key.range_text})"
    if low == 0:  # below zero: refused while parsing, still naming the key
        with pytest.raises(ConfigError, match=rf"^n\.toml: {key.dotted}: "):
            load_dict(_alone(key, -1), source="n.toml")


@pytest.mark.parametrize("raw, message", [
    ({"delivery": {"transient_failure_retry_interval": "13h"}},
     "delivery.transient_failure_retry_interval: 13h is out of range (1s..12h)"),
    ({"delivery": {"transient_failure_retry_interval": "12:00:01"}},
     "delivery.transient_failure_retry_interval: 43201s is out of range (1s..12h)"),
    ({"delivery": {"transient_failure_retry_count": 16}},
     "delivery.transient_failure_retry_count: 16 is out of range (0..15)"),
    ({"delivery": {"outbound_connection_failure_retry_interval": "21d"}},
     "delivery.outbound_connection_failure_retry_interval: 21d is out of range (1s..20d)"),
    ({"delivery": {"message_expiration_timeout": "91d"}},
     "delivery.message_expiration_timeout: 91d is out of range (1s..90d)"),
    ({"delivery": {"delay_notification_timeout": "31d"}},
     "delivery.delay_notification_timeout: 31d is out of range (0s..30d)"),
    ({"shadow_redundancy": {"shadow_heartbeat_frequency": "2d"}},
     "shadow_redundancy.shadow_heartbeat_frequency: 2d is out of range (0.1s..1d)"),
    ({"shadow_redundancy": {"shadow_message_auto_discard_interval": "4s"}},
     "shadow_redundancy.shadow_message_auto_discard_interval: 4s is out of range (5s..90d)"),
    ({"safety_net": {"safety_net_hold_time": "14s"}},
     "safety_net.safety_net_hold_time: 14s is out of range (15s..24855d)"),
    ({"shadow_redundancy": {"max_retries_for_local_site_shadow": 256}},
     "shadow_redundancy.max_retries_for_local_site_shadow: 256 is out of range (0..255)"),
    ({"frontend": {"max_message_size": "3GB"}}, "frontend.max_message_size: 3GB is out of range (1KB..2GB)"),
    ({"frontend": {"max_hop_count": 501}}, "frontend.max_hop_count: 501 is out of range (1..500)"),
    ({"delivery": {"poison_threshold": 11}}, "delivery.poison_threshold: 11 is out of range (1..10)"),
])
def test_out_of_range_is_one_line_naming_key_value_and_range(raw, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_dict(raw, source="node.toml")
    assert str(info.value) == f"node.toml: {message}"


def test_reject_on_shadow_failure_without_peers_is_refused() -> None:
    """RejectMessageOnShadowFailure with no peer to copy to would refuse every message (Exchange:
    "use $true only if you have multiple Mailbox servers"): one line naming the key. Off, or with
    shadow redundancy off, or in 2010 mode (no copy before the 250), it loads."""
    with pytest.raises(ConfigError) as info:
        load_dict({"shadow_redundancy": {"reject_message_on_shadow_failure": True}}, source="node.toml")
    assert str(info.value).startswith("node.toml: shadow_redundancy.reject_message_on_shadow_failure: true with "
                                      "no [[peers]]: no shadow copy can be made, so every message would be refused")
    for ok in ({"shadow_redundancy_enabled": False}, {"version": "2010"}):
        load_dict({"shadow_redundancy": {"reject_message_on_shadow_failure": True, **ok}})


def test_several_shadow_copies_are_refused_in_exchange_2010_mode() -> None:
    """Exchange 2010 keeps one shadow, the sending server's: N copies need the 2013 protocol."""
    with pytest.raises(ConfigError) as info:
        load_dict({"shadow_redundancy": {"version": "2010", "shadow_copies": 2}}, source="node.toml")
    assert str(info.value).startswith("node.toml: shadow_redundancy.shadow_copies: 2 is not possible with "
                                      'shadow_redundancy.version = "2010"')
    assert load_dict({"shadow_redundancy": {"version": "2010", "shadow_copies": 1}}).shadow_redundancy.version == "2010"


def test_timers_go_down_to_what_test_clusters_use() -> None:
    cfg = load_dict({"shadow_redundancy": {"shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": 2,
                                           "shadow_copy_timeout": 2},
                     "delivery": {"queue_poll_interval": 0.05, "transient_failure_retry_interval": 1,
                                  "outbound_connection_failure_retry_interval": 1, "send_connect_timeout": 2,
                                  "message_expiration_timeout": 3, "delay_notification_timeout": 2},
                     "frontend": {"connection_timeout": 2, "connection_inactivity_timeout": 1.0,
                                  "max_message_size": 2000},
                     "safety_net": {"primary_safety_net_unreachable_time": 4},
                     "mailbox": {"duplicate_detection_window": 1}})
    assert cfg.shadow_redundancy.shadow_heartbeat_frequency == 0.5
    assert cfg.delivery.queue_poll_interval == 0.05
    assert cfg.delivery.message_expiration_timeout == 3.0


def test_markdown_reference_shows_the_ranges() -> None:
    lines = cfgmod.markdown_reference().splitlines()
    assert lines[0] == "| key | default | range | Exchange name | meaning |"
    row = next(ln for ln in lines if ln.startswith("| `delivery.transient_failure_retry_interval` "))
    assert row.split(" | ")[1:4] == ["`5m`", "`1s..12h`", "TransientFailureRetryInterval"]
    row = next(ln for ln in lines if ln.startswith("| `node.site` "))
    assert row.split(" | ")[2] == ""
    assert len(lines) == len(KEYS) + 2


# --------------------------------------------------------------------------- unknown names

@pytest.mark.parametrize("raw, message", [
    ({"delivery": {"transient_failure_retry_intervall": 5}},
     "delivery.transient_failure_retry_intervall: unknown key; did you mean 'transient_failure_retry_interval'?"),
    ({"frontend": {"max_mesage_size": "1MB"}},
     "frontend.max_mesage_size: unknown key; did you mean 'max_message_size'?"),
    ({"delivery": {"shadow_heartbeat_frequency": 5}},
     "delivery.shadow_heartbeat_frequency: unknown key; did you mean 'shadow_redundancy.shadow_heartbeat_frequency'?"),
    ({"delivery": {"retry_sometimes": 3}}, "delivery.retry_sometimes: unknown key"),
    ({"deliveries": {"x": 1}}, "unknown section [deliveries]; did you mean 'delivery'?"),
    ({"shadow_redundancey": {}}, "unknown section [shadow_redundancey]; did you mean 'shadow_redundancy'?"),
    ({"safetynet": {}}, "unknown section [safetynet]; did you mean 'safety_net'?"),
    ({"peer": []}, "unknown section [peer]; did you mean 'peers'?"),
    ({"bogus": {"x": 1}}, "unknown section [bogus] (known: " + ", ".join(cfgmod.SECTIONS) + ")"),
])
def test_unknown_names_are_refused_with_the_closest_known_one(raw, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_dict(raw, source="node.toml")
    assert str(info.value) == f"node.toml: {message}"


def test_a_misspelt_peer_key_gets_a_suggestion() -> None:
    raw = {"transport": {"listen": "127.0.0.11:2526"}, "cluster": {"secret": "s"},
           "peers": [{"nmae": "n2.t", "site": "a", "transport": "127.0.0.12:2526"}]}
    with pytest.raises(ConfigError, match=r"^n\.toml: peers\[0\]\.nmae: unknown key; did you mean 'name'\?$"):
        load_dict(raw, source="n.toml")


# --------------------------------------------------------------------------- cross-checks

@pytest.mark.parametrize("raw, message", [
    ({"frontend": {"connection_timeout": "5m", "connection_inactivity_timeout": "301s"}},
     "frontend.connection_timeout: 5m is shorter than frontend.connection_inactivity_timeout (301s)"),
    ({"frontend": {"connection_timeout": "1m"}},
     "frontend.connection_timeout: 1m is shorter than frontend.connection_inactivity_timeout (5m)"),
    ({"shadow_redundancy": {"shadow_heartbeat_frequency": "1m", "shadow_resubmit_time_span": "30s"}},
     ("shadow_redundancy.shadow_resubmit_time_span: 30s is shorter than one "
      "shadow_redundancy.shadow_heartbeat_frequency (1m)")),
    ({"shadow_redundancy": {"shadow_heartbeat_frequency": "1h", "shadow_message_auto_discard_interval": "10m"}},
     ("shadow_redundancy.shadow_message_auto_discard_interval: 10m is shorter than one "
      "shadow_redundancy.shadow_heartbeat_frequency (1h)")),
    ({"tracking": {"message_tracking_log_max_directory_size": "5MB"}},
     ("tracking.message_tracking_log_max_directory_size: 5MB is less than "
      "tracking.message_tracking_log_max_file_size (10MB)")),
])
def test_values_that_contradict_each_other_are_refused_naming_both(raw, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_dict(raw, source="node.toml")
    msg = str(info.value)
    assert msg.startswith(f"node.toml: {message}: ") and "\n" not in msg


@pytest.mark.parametrize("raw", [
    {"frontend": {"connection_timeout": 3, "connection_inactivity_timeout": 2}},
    {"frontend": {"connection_timeout": "5m", "connection_inactivity_timeout": "5m"}},
    {"shadow_redundancy": {"shadow_heartbeat_frequency": "1m", "shadow_resubmit_time_span": "1m",
                           "shadow_message_auto_discard_interval": "1m"}},
    {"shadow_redundancy": {"shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": 3}},
    {"delivery": {"message_expiration_timeout": 3, "delay_notification_timeout": "4h"},
     "safety_net": {"safety_net_hold_time": "15s"}},
    {"tracking": {"message_tracking_log_max_file_size": "1MB", "message_tracking_log_max_directory_size": "1MB"}},
    {"tracking": {"message_tracking_log_max_file_size": "4GB", "message_tracking_log_max_directory_size": 0}},
], ids=["timeouts", "equal-timeouts", "equal-shadow-timers", "test-cluster", "expiry-before-delay-dsn",
        "tracking-folder-one-file", "tracking-folder-unlimited"])
def test_values_that_fit_together_are_accepted(raw) -> None:
    load_dict(raw)


def test_tracking_folder_size_takes_exchanges_unlimited() -> None:
    """MessageTrackingLogMaxDirectorySize's "unlimited" (any case) is no limit (0); the defaults are
    Exchange's: 30 days, 1000 MB."""
    cfg = load_dict({"tracking": {"message_tracking_log_max_directory_size": "Unlimited"}})
    assert cfg.tracking.message_tracking_log_max_directory_size == 0
    default = load_dict({}).tracking
    assert (default.message_tracking_log_max_age, default.message_tracking_log_max_directory_size) == (
        30 * 86400.0, 1000 * 1024 ** 2)
    with pytest.raises(ConfigError, match=r"^n\.toml: tracking\.message_tracking_log_max_directory_size: "):
        load_dict({"tracking": {"message_tracking_log_max_directory_size": "lots"}}, source="n.toml")


# --------------------------------------------------------------------------- every shipped config

@pytest.mark.parametrize("path", sorted((REPO / "config").rglob("*.toml")),
                         ids=lambda p: str(p.relative_to(REPO / "config")))
def test_every_example_config_loads(path: Path, tmp_path: Path, monkeypatch) -> None:
    # The compose configs read the cluster secret from /run/secrets/ (a compose secret in the container).
    secret = tmp_path / "cluster-secret"
    secret.write_text("test-secret\n")
    read = cfgmod._read_secret_file

    def read_mounted(cluster: dict, base_dir: Path, source: str) -> None:
        if cluster["secret_file"].startswith("/run/secrets/") and not Path(cluster["secret_file"]).exists():
            cluster["secret_file"] = str(secret)
            read(cluster, base_dir, source)
            assert cluster["secret"] == "test-secret"
            return
        read(cluster, base_dir, source)
    monkeypatch.setattr(cfgmod, "_read_secret_file", read_mounted)
    cfg = load(path)
    assert cfg.path == path and cfg.node.name
    for key, value in cfg.effective():
        if key.limits and not (isinstance(value, str) and value in WORDS):
            assert key.limits[0] <= value <= key.limits[1], key.dotted


def test_example_configs_cover_single_node_cluster_and_compose() -> None:
    found = {p.relative_to(REPO / "config").parts[0] for p in (REPO / "config").rglob("*.toml")}
    assert {"single-node.toml", "cluster", "compose"} <= found


def test_every_setting_the_code_reads_is_a_key() -> None:
    """A typo in ``cfg.<section>.<key>`` anywhere in the package (or its benchmarks) is found here,
    before a node runs the line that reads it (the settings are built from the key registry)."""
    import ast

    repo = Path(__file__).resolve().parent.parent
    sections = {s: set(cfgmod._BY_SECTION[s]) for s in cfgmod.SECTIONS}
    config_names = {"cfg", "config", "conf"}
    aliases = {"sr": "shadow_redundancy", "fe": "frontend", "tr": "transport", "dl": "delivery"}

    def name_of(expr: ast.expr) -> str | None:
        return expr.attr if isinstance(expr, ast.Attribute) else getattr(expr, "id", None)

    wrong, seen = [], 0
    for path in [*(repo / "transportd").rglob("*.py"), *(repo / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Attribute) and node.value.attr in sections \
                    and name_of(node.value.value) in config_names:
                section = node.value.attr  # cfg.delivery.x, self.cfg.delivery.x
            elif name_of(node.value) in aliases:
                section = aliases[name_of(node.value)]  # sr = cfg.shadow_redundancy; sr.x
            else:
                continue
            seen += 1
            if node.attr not in sections[section]:
                wrong.append(f"{path.relative_to(repo)}:{node.lineno}: {section}.{node.attr}")
    assert seen > 100, "the scan found the settings the code reads"
    assert not wrong, "settings read that are no key: " + ", ".join(wrong)
