"""The SSRF guard of webhook deliveries: resolve once, check the address, connect to it.

A webhook URL is written by a tenant, so a delivery must never reach the worker's own
network: loopback, private ranges, link-local (cloud metadata at 169.254.169.254),
multicast, reserved and other non-public addresses are refused (Standard Webhooks,
"Server side request forgery"; OWASP SSRF Prevention Cheat Sheet).

The check is made on the address the connection actually uses, so a name that resolves
to a public address for the check and to a private one for the connection (DNS
rebinding) cannot slip through:

1. :func:`resolve_destination` resolves the URL's host once (``getaddrinfo``) and picks
   the first resolved address that is public (or allowed, below); none → refused.
2. The delivery sends the request to a URL whose host is that IP literal
   (:attr:`Destination.pinned_url`): httpx/httpcore connect to it without resolving
   anything again. The ``Host`` header carries the URL's host (:attr:`Destination.
   host_header`) and, for ``https``, the ``sni_hostname`` request extension (httpx,
   "Request extensions") gives TLS the name for SNI and certificate verification, so the
   receiver sees a normal request for its own name.

Addresses are classified with :mod:`ipaddress`, and the IPv4 address embedded in an
IPv4-mapped (``::ffff:a.b.c.d``), 6to4 (``2002::/16``), Teredo (``2001::/32``) or NAT64
(``64:ff9b::/96``) IPv6 address is checked as well: each of those reaches an IPv4 host.

3. A public address is reached only on the ports ``webhook_public_ports`` lists (default
   80, 443, 8080, 8443): a tenant's URL cannot aim a delivery at whatever else a public
   host serves.

``webhook_allowed_hosts`` (a setting) lets listed destinations through for tests and
internal receivers (:mod:`sqla_outbox.destinations` has the grammar): an entry names a
host name, matched exactly (case-insensitive) against the URL's host, or an IP address or
network, matched against resolved addresses; always with the port or port range it
admits, and optionally the tenants it admits. The connection is still made to the
address that was resolved and checked, and :attr:`Destination.allowed_by` says which
entry let it through (the delivery then keeps no excerpt of the answer).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import socket
from collections.abc import Callable, Iterable

import httpx

from sqla_outbox import destinations, errors

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

Resolver = Callable[[str, int], list[str]]
"""``(host, port) -> addresses`` (IP address strings, in preference order)."""

_SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598 (carrier-grade NAT)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052 well-known prefix
_PRIVATE = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)


@dataclasses.dataclass(frozen=True)
class Destination:
    """Where one delivery attempt connects.

    Attributes:
        url: The endpoint URL as configured.
        scheme: ``http`` or ``https``.
        host: The URL's host, IDNA-encoded (ASCII), lowercase.
        port: The port connected to.
        address: The resolved and checked address the connection uses.
        allowed_by: The ``webhook_allowed_hosts`` entry that let the destination through
            (as written), else None (a public address on a public port).
    """

    url: str
    scheme: str
    host: str
    port: int
    address: IPAddress
    allowed_by: str | None = None

    @property
    def pinned_url(self) -> str:
        """The URL with its host replaced by :attr:`address` (what the client connects to)."""
        return str(httpx.URL(self.url).copy_with(host=str(self.address)))

    @property
    def host_header(self) -> str:
        """``Host`` header value: the URL's host, and its port when not the scheme's default."""
        default = 443 if self.scheme == "https" else 80
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return shown if self.port == default else f"{shown}:{self.port}"

    @property
    def origin(self) -> str:
        """``scheme://host:port``: what logs and the trail show (never the path or query,
        which may carry a token)."""
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{shown}:{self.port}"


def refusal_reason(address: IPAddress) -> str | None:
    """Why a delivery may not connect to ``address``; None when it is a public address.

    Returns:
        ``unspecified``, ``loopback``, ``link-local``, ``multicast``, ``private``,
        ``shared address space``, ``reserved``, ``site-local`` or ``not globally routable``
        (documentation and benchmarking ranges, ``0.0.0.0/8``, ...), as classified by
        :mod:`ipaddress` (IANA special-purpose address registries), with the embedded IPv4
        address of a mapped, 6to4, Teredo or NAT64 address checked the same way.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            inner = refusal_reason(embedded)
            return None if inner is None else f"{inner} (embedded {embedded})"
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if any(address in network for network in _PRIVATE):
        return "private"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED_ADDRESS_SPACE:
        return "shared address space"
    if address.is_reserved:
        return "reserved"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "site-local"
    if address.is_private or not address.is_global:
        return "not globally routable"
    return None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]  # (server, client): the client is where packets go
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def system_resolver(host: str, port: int) -> list[str]:
    """Resolve ``host`` with the system resolver (``getaddrinfo``, TCP), addresses in the
    order it returns them, duplicates removed.

    Raises:
        OSError: ``socket.gaierror`` when the name does not resolve.
    """
    found: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = str(sockaddr[0])
        if address not in found:
            found.append(address)
    return found


resolver: Resolver = system_resolver
"""The resolution deliveries use. A test hook: tests point names at chosen addresses
(``monkeypatch.setattr(destination_guard, "resolver", ...)``) without touching /etc/hosts
or DNS; production code leaves it alone."""


DEFAULT_PUBLIC_PORTS = ("80", "443", "8080", "8443")
"""``webhook_public_ports``'s default: the ports web servers and webhook receivers use."""


def resolve_destination(
    url: str,
    *,
    allowed_hosts: Iterable[str] = (),
    public_ports: Iterable[str] = DEFAULT_PUBLIC_PORTS,
    tenant_id: int | None = None,
    resolve: Resolver | None = None,
) -> Destination:
    """Resolve and check where a delivery to ``url`` may connect.

    Args:
        url: The endpoint URL.
        allowed_hosts: ``webhook_allowed_hosts`` entries (host or network, ports, tenants:
            :mod:`sqla_outbox.destinations`).
        public_ports: ``webhook_public_ports``: the ports allowed on public addresses.
        tenant_id: The delivery's tenant (an entry scoped to tenants admits only theirs).
        resolve: Name resolution; default :data:`resolver` (the system's).

    Returns:
        The :class:`Destination`: the first resolved address an allow-list entry admits
        on this port for this tenant, or that is public with the port among
        ``public_ports``.

    Raises:
        WebhookRefused: ``destination-refused``: not an ``http``/``https`` URL, no host,
            or no resolved address may be used (the message names each address with its
            class, or the port that is not allowed).
        WebhookFailed: ``dns``: the name does not resolve (may be temporary).
        ValueError: An ``allowed_hosts`` or ``public_ports`` entry does not parse (the
            settings check them first).
    """
    try:
        parsed = httpx.URL(url)
        scheme, host, port = parsed.scheme, parsed.raw_host.decode("ascii").lower(), parsed.port
    except (httpx.InvalidURL, UnicodeError, ValueError) as exc:
        raise errors.WebhookRefused("destination-refused", f"the URL cannot be parsed ({exc})") from None
    if scheme not in ("http", "https"):
        raise errors.WebhookRefused(
            "destination-refused", f"scheme {scheme or '(none)'!r} is not http or https"
        )
    if not host:
        raise errors.WebhookRefused("destination-refused", "the URL has no host")
    port = port or (443 if scheme == "https" else 80)
    entries = _allow_list(tuple(allowed_hosts))
    ports = _port_set(tuple(public_ports))
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        candidates = [str(literal)]
    else:
        try:
            candidates = (resolve or resolver)(host, port)
        except OSError as exc:
            raise errors.WebhookFailed("dns", f"{host} does not resolve ({exc})") from None
    refusals = []
    for text in candidates:
        try:
            address = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        allowed_by = next(
            (e.text for e in entries if e.admits(host=host, address=address, port=port, tenant_id=tenant_id)),
            None,
        )
        if allowed_by is not None:
            return Destination(url, scheme, host, port, address, allowed_by)
        reason = refusal_reason(address)
        if reason is None and any(port in allowed for allowed in ports):
            return Destination(url, scheme, host, port, address)
        refusals.append(f"{address} ({reason or f'public, but port {port} is not in webhook_public_ports'})")
    if not refusals:
        raise errors.WebhookFailed("dns", f"{host} resolved to no usable address")
    where = "is" if literal is not None else "resolves to"
    raise errors.WebhookRefused(
        "destination-refused",
        f"{host} {where} {', '.join(refusals)}: not a destination deliveries may reach "
        f"(an internal receiver needs a webhook_allowed_hosts entry naming its host and port {port})",
    )


@functools.lru_cache(maxsize=32)
def _allow_list(entries: tuple[str, ...]) -> tuple[destinations.AllowEntry, ...]:
    return tuple(destinations.parse_allow_entry(entry) for entry in entries)


@functools.lru_cache(maxsize=32)
def _port_set(entries: tuple[str, ...]) -> tuple[destinations.Ports, ...]:
    return tuple(destinations.parse_ports(entry) for entry in entries)
