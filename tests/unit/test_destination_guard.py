"""The SSRF guard's decisions: every refused address class, names that resolve to them,
the allow-list, and the pinned request (IP literal + Host header)."""

from __future__ import annotations

import ipaddress

import pytest

from sqla_outbox import errors
from sqla_outbox.config import OutboxSettings
from sqla_outbox.worker import destination_guard as guard
from sqla_outbox.worker.webhook_delivery import _retry_after, keeps_excerpt

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"),
    ("::1", "loopback"),
    ("10.0.0.7", "private"),
    ("172.16.5.4", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("fd12:3456::1", "private"),
    ("169.254.169.254", "link-local"),  # cloud instance metadata
    ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("100.64.0.1", "shared address space"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"),
    ("fec0::1", "site-local"),
    ("192.0.2.10", "not globally routable"),  # documentation (TEST-NET-1)
    ("198.18.0.1", "not globally routable"),  # benchmarking
    ("0.1.2.3", "not globally routable"),
    ("2001:db8::1", "not globally routable"),
    ("::ffff:127.0.0.1", "loopback (embedded 127.0.0.1)"),
    ("::ffff:10.1.1.1", "private (embedded 10.1.1.1)"),
    ("2002:7f00:1::", "loopback (embedded 127.0.0.1)"),  # 6to4
    ("2002:a00:1::", "private (embedded 10.0.0.1)"),
    ("64:ff9b::a9fe:a9fe", "link-local (embedded 169.254.169.254)"),  # NAT64
    ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "private (embedded 10.0.0.1)"),  # Teredo client 10.0.0.1
]


@pytest.mark.parametrize(("address", "reason"), REFUSED)
def test_every_non_public_address_class_is_refused(address: str, reason: str) -> None:
    assert guard.refusal_reason(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.215.14", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert guard.refusal_reason(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(("address", "reason"), REFUSED)
def test_an_ip_literal_url_is_refused_with_its_class(address: str, reason: str) -> None:
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(errors.WebhookRefused) as refused:
        guard.resolve_destination(f"https://{host}/hook")
    assert refused.value.reason == "destination-refused"
    assert f"({reason})" in str(refused.value)


def resolver(table: dict[str, list[str]]) -> guard.Resolver:
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return table[host]

    return resolve


def test_a_name_resolving_to_a_private_address_is_refused() -> None:
    resolve = resolver({"hooks.tenant.example": ["10.0.0.7"]})
    with pytest.raises(errors.WebhookRefused) as refused:
        guard.resolve_destination("https://hooks.tenant.example/in", resolve=resolve)
    assert "hooks.tenant.example resolves to 10.0.0.7 (private)" in str(refused.value)


def test_localhost_is_refused_through_the_system_resolver() -> None:
    with pytest.raises(errors.WebhookRefused) as refused:
        guard.resolve_destination("http://localhost:8080/in")
    assert "loopback" in str(refused.value)


def test_the_first_public_address_is_the_one_connected_to() -> None:
    """A name with a private and a public address: the connection goes to the checked
    public one (never "whichever the client resolves later")."""
    resolve = resolver({"mixed.example": ["10.0.0.7", "93.184.215.14"]})
    destination = guard.resolve_destination("https://mixed.example:8443/in?token=s3cret", resolve=resolve)
    assert destination.address == ipaddress.ip_address("93.184.215.14")
    assert destination.pinned_url == "https://93.184.215.14:8443/in?token=s3cret"
    assert destination.host_header == "mixed.example:8443"
    assert destination.origin == "https://mixed.example:8443"  # no path or query: they may hold a token


def test_resolution_happens_once_so_a_rebinding_answer_is_never_used() -> None:
    answers = iter([["93.184.215.14"], ["127.0.0.1"]])
    calls: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return next(answers)

    destination = guard.resolve_destination("http://rebind.example/in", resolve=rebinding)
    assert calls == ["rebind.example"]
    assert destination.pinned_url == "http://93.184.215.14/in"


def test_allowed_hosts_let_listed_names_and_networks_through_on_their_ports() -> None:
    resolve = resolver({"receiver.internal": ["10.1.2.3"], "other.internal": ["10.9.9.9"]})
    by_name = guard.resolve_destination(
        "http://receiver.internal:9000/in", allowed_hosts=["receiver.internal:9000"], resolve=resolve
    )
    assert (str(by_name.address), by_name.allowed_by) == ("10.1.2.3", "receiver.internal:9000")
    by_network = guard.resolve_destination(
        "http://other.internal/in", allowed_hosts=["10.9.0.0/16:80-90"], resolve=resolve
    )
    assert by_network.allowed_by == "10.9.0.0/16:80-90"
    with pytest.raises(errors.WebhookRefused):
        guard.resolve_destination(
            "http://other.internal/in", allowed_hosts=["10.1.0.0/16:80"], resolve=resolve
        )
    loopback = guard.resolve_destination("http://127.0.0.1:5000/in", allowed_hosts=["127.0.0.1:5000"])
    assert loopback.pinned_url == "http://127.0.0.1:5000/in"


def test_an_allow_list_entry_admits_its_ports_only() -> None:
    """An internal host allowed on 8850 is not reachable on 8851 (another service)."""
    allowed = ["127.0.0.1:8850", "receiver.internal:8000-8099"]
    assert guard.resolve_destination("http://127.0.0.1:8850/in", allowed_hosts=allowed).port == 8850
    with pytest.raises(errors.WebhookRefused) as refused:
        guard.resolve_destination("http://127.0.0.1:8851/in", allowed_hosts=allowed)
    assert "127.0.0.1 (loopback)" in str(refused.value) and "port 8851" in str(refused.value)
    resolve = resolver({"receiver.internal": ["10.1.2.3"]})
    for port, passes in ((8000, True), (8099, True), (8100, False), (80, False)):
        url = f"http://receiver.internal:{port}/in"
        if passes:
            assert guard.resolve_destination(url, allowed_hosts=allowed, resolve=resolve).port == port
        else:
            with pytest.raises(errors.WebhookRefused):
                guard.resolve_destination(url, allowed_hosts=allowed, resolve=resolve)


def test_an_allow_list_entry_scoped_to_tenants_admits_only_their_deliveries() -> None:
    allowed = ["3+7@127.0.0.1:8850"]
    for tenant in (3, 7):
        destination = guard.resolve_destination(
            "http://127.0.0.1:8850/in", allowed_hosts=allowed, tenant_id=tenant
        )
        assert destination.allowed_by == "3+7@127.0.0.1:8850"
    for tenant in (4, None):
        with pytest.raises(errors.WebhookRefused):
            guard.resolve_destination("http://127.0.0.1:8850/in", allowed_hosts=allowed, tenant_id=tenant)


def test_public_addresses_are_reached_on_the_public_ports_only() -> None:
    resolve = resolver({"hooks.example": ["93.184.215.14"]})
    for port in (80, 443, 8080, 8443):
        url = f"https://hooks.example:{port}/in"
        assert guard.resolve_destination(url, resolve=resolve).allowed_by is None
    for port in (22, 25, 6379, 8851):
        with pytest.raises(errors.WebhookRefused) as refused:
            guard.resolve_destination(f"http://hooks.example:{port}/in", resolve=resolve)
        assert f"port {port} is not in webhook_public_ports" in str(refused.value)
    wider = guard.resolve_destination(
        "http://hooks.example:9443/in", public_ports=["443", "9000-9999"], resolve=resolve
    )
    assert wider.port == 9443
    # an allow-list entry may admit a public host on another port
    listed = guard.resolve_destination(
        "http://hooks.example:2222/in", allowed_hosts=["hooks.example:2222"], resolve=resolve
    )
    assert listed.allowed_by == "hooks.example:2222"


def test_the_excerpt_is_kept_for_public_destinations_only_by_default() -> None:
    resolve = resolver({"hooks.example": ["93.184.215.14"]})
    public = guard.resolve_destination("https://hooks.example/in", resolve=resolve)
    internal = guard.resolve_destination("http://127.0.0.1:8850/in", allowed_hosts=["127.0.0.1:8850"])
    assert [keeps_excerpt(d, "public") for d in (public, internal)] == [True, False]
    assert [keeps_excerpt(d, "never") for d in (public, internal)] == [False, False]
    assert [keeps_excerpt(d, "always") for d in (public, internal)] == [True, True]


@pytest.mark.parametrize(
    "entry",
    ["127.0.0.1", "hooks.internal", "fd00::1:443", "[fd00::1]", "h:0", "h:70000", "h:9-1", "x@h:1", "a b:1"],
)
def test_an_allow_list_entry_without_a_valid_port_is_refused_by_the_settings(entry: str) -> None:
    with pytest.raises(errors.ConfigurationError) as refused:
        OutboxSettings(webhook_allowed_hosts=(entry,))
    assert "SQLA_OUTBOX_WEBHOOK_ALLOWED_HOSTS" in str(refused.value)


@pytest.mark.parametrize(
    "url", ["ftp://example.com/x", "file:///etc/passwd", "gopher://example.com/", "javascript:alert(1)"]
)
def test_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(errors.WebhookRefused) as refused:
        guard.resolve_destination(url)
    assert "is not http or https" in str(refused.value) or "no host" in str(refused.value)


def test_a_name_that_does_not_resolve_is_transient() -> None:
    with pytest.raises(errors.WebhookFailed) as failed:
        guard.resolve_destination("https://nowhere.example/in", resolve=resolver({}))
    assert failed.value.reason == "dns"


def test_ipv6_destinations_are_bracketed() -> None:
    resolve = resolver({"v6.example": ["2606:4700:4700::1111"]})
    destination = guard.resolve_destination("https://v6.example/in", resolve=resolve)
    assert destination.pinned_url == "https://[2606:4700:4700::1111]/in"
    assert destination.host_header == "v6.example"


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert _retry_after("120") == 120.0
    assert _retry_after(None) is None
    assert _retry_after("soon") is None
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: at once
    later = _retry_after("Fri, 01 Jan 2100 00:00:00 GMT")
    assert later is not None and later > 10**9
