"""Webhook destinations a setting names: allow-list entries and port sets.

Read by the settings (each value is checked when ``OutboxSettings`` is built) and by the
worker's SSRF guard (:mod:`sqla_outbox.worker.destination_guard`), which matches every
delivery against them. Pure functions of text; nothing here resolves or connects.

**An allow-list entry** (``webhook_allowed_hosts``) lets a non-public destination through
the guard, on the ports it names, optionally for some tenants only::

    hooks.internal:443            a host name (matched exactly against the URL's host)
    127.0.0.1:8850                an IP address (matched against the resolved addresses)
    10.1.2.0/24:8000-8099         a network, a port range
    [fd00::1]:443  [fd00::/64]:443  IPv6, in brackets
    3+7@hooks.internal:443        only for deliveries of tenants 3 and 7

The port is required: an entry admits a host on the ports it names and no other (an
internal host that serves webhooks on one port may serve a secret on the next).

**A port set** (``webhook_public_ports``): ports and ranges (``443``, ``8000-8099``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_HOST_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_][a-z0-9_-]{0,62})*\.?")
_PORTS = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")
_TENANT = re.compile(r"-?\d{1,19}")

ENTRY_SHAPE = "[tenant+tenant@]host:port or host:port-port (IPv6 in brackets)"
"""What an allow-list entry looks like, for messages and docs."""


@dataclasses.dataclass(frozen=True)
class Ports:
    """A TCP port or an inclusive range of them.

    Attributes:
        low / high: 1..65535, ``low <= high`` (one port: both equal).
    """

    low: int
    high: int

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.low <= port <= self.high

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


def parse_ports(text: str) -> Ports:
    """``"443"`` or ``"8000-8099"`` as :class:`Ports`.

    Raises:
        ValueError: Not a port or range of ports 1..65535 (TCP port numbers; 0 is not a
            port a connection can use), or a range whose end is below its start.
    """
    match = _PORTS.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a port (443) or a range of ports (8000-8099)")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if not (1 <= low <= 65535 and 1 <= high <= 65535) or high < low:
        raise ValueError(f"{text!r}: ports are 1..65535, a range from low to high")
    return Ports(low, high)


@dataclasses.dataclass(frozen=True)
class AllowEntry:
    """One ``webhook_allowed_hosts`` entry, parsed.

    Attributes:
        text: The entry as written (what the trail names as ``allowed_by``).
        host: A host name, lowercase, or None when the entry is an address or network.
        network: The address (a /32 or /128 network) or network, or None for a host name.
        ports: The ports it admits.
        tenants: The tenants whose deliveries it admits; None: every tenant.
    """

    text: str
    host: str | None
    network: Network | None
    ports: Ports
    tenants: frozenset[int] | None

    def admits(self, *, host: str, address: IPAddress, port: int, tenant_id: int | None) -> bool:
        """Whether a delivery of ``tenant_id`` to ``host`` (the URL's host, lowercase),
        connecting to ``address`` on ``port``, is let through by this entry."""
        if port not in self.ports:
            return False
        if self.tenants is not None and tenant_id not in self.tenants:
            return False
        if self.host is not None:
            return host == self.host
        assert self.network is not None
        return address.version == self.network.version and address in self.network


def parse_allow_entry(text: str) -> AllowEntry:
    """Parse one allow-list entry (see the module docstring for the forms).

    Raises:
        ValueError: Not one of the forms: no port, a bad port or range, a bad tenant id,
            a host that is neither a name, an address nor a network, an IPv6 address
            without brackets.
    """
    raw = text.strip()
    tenants: frozenset[int] | None = None
    where = raw
    if "@" in raw:
        scope, where = raw.split("@", 1)
        ids = scope.split("+")
        if not all(_TENANT.fullmatch(i) for i in ids):
            raise ValueError(f"{text!r}: tenants are integer ids joined by '+' before '@' (3+7@host:port)")
        tenants = frozenset(int(i) for i in ids)
    if where.startswith("["):
        host_part, bracket, rest = where[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ValueError(f"{text!r}: an IPv6 entry is [address]:port or [network]:port")
        port_part = rest[1:]
    else:
        host_part, colon, port_part = where.rpartition(":")
        if not colon or not host_part:
            raise ValueError(f"{text!r}: name the port (host:443, or a range host:8000-8099)")
        if ":" in host_part:
            raise ValueError(f"{text!r}: write an IPv6 address in brackets ([fd00::1]:443)")
    try:
        ports = parse_ports(port_part)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    host_part = host_part.strip().lower()
    try:
        network: Network | None = ipaddress.ip_network(host_part, strict=False)
    except ValueError:
        network = None
    if network is None and not _HOST_NAME.fullmatch(host_part):
        raise ValueError(f"{text!r}: {host_part!r} is not a host name, an IP address or a network")
    return AllowEntry(raw, None if network is not None else host_part.rstrip("."), network, ports, tenants)


def allow_entries_problem(entries: tuple[str, ...]) -> str | None:
    """``webhook_allowed_hosts``: the first entry that does not parse, and why; None if all do."""
    for entry in entries:
        try:
            parse_allow_entry(entry)
        except ValueError as exc:
            return f"each entry must be {ENTRY_SHAPE}: {exc}"
    return None


def ports_problem(entries: tuple[str, ...]) -> str | None:
    """``webhook_public_ports``: the first entry that is not a port or range; None if all are."""
    for entry in entries:
        try:
            parse_ports(entry)
        except ValueError as exc:
            return str(exc)
    return None


def proxy_url_problem(url: str) -> str | None:
    """``webhook_proxy_url``: ``http://host:port`` or ``https://host:port`` (an HTTP proxy
    that tunnels with CONNECT), user and password optional; nothing else."""
    match = re.fullmatch(r"(https?)://(?:[^@/\s]+@)?([^@/:\s]+|\[[0-9a-fA-F:.]+\]):(\d{1,5})/?", url)
    if match is None or not 1 <= int(match.group(3)) <= 65535:
        return "must be an http://host:port or https://host:port URL of an HTTP proxy (CONNECT)"
    return None
