"""Which local network interface carries the traffic to the master address, and gloo's pin.

gloo picks its interface by resolving this machine's host name: where the name does not resolve
(common on clusters) it falls back to loopback, and where it resolves to ``127.0.1.1`` it binds
loopback too, so ranks on other machines cannot connect. :func:`gloo_interface` is the one
decision of which interface to pin as ``GLOO_SOCKET_IFNAME`` instead: the one owning
``--local-addr``, else the one that routes to the master; never over a value the user set.
``phalanx run`` pins it in its workers' environment, ``phalanx.init_process_group`` in its own
process when another launcher (torchrun, SLURM, by hand) did not, and ``phalanx doctor`` reports
the same answer.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

__all__ = [
    "GLOO_IFNAME",
    "gloo_interface",
    "interface_for",
    "interface_owning",
    "ipv4_interfaces",
    "local_ip_for",
]

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
"""The variable gloo reads (when each of its groups is made) for the interfaces to use."""

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8


def local_ip_for(master_addr: str, port: int = 9) -> str | None:
    """The local source address the kernel would use to reach ``master_addr`` (no packet sent)."""
    try:
        infos = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)  # UDP connect only selects a route
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return None


def _ioctl(name: str, request: int) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None


def _ipv4_of(name: str) -> str | None:
    raw = _ioctl(name, _SIOCGIFADDR)
    return None if raw is None else socket.inet_ntoa(raw[20:24])


def _is_loopback(name: str) -> bool:
    raw = _ioctl(name, _SIOCGIFFLAGS)
    return raw is not None and bool(struct.unpack("H", raw[16:18])[0] & _IFF_LOOPBACK)


def _ipv6_interface(ip: str) -> str | None:
    """Find the interface owning an IPv6 address through /proc/net/if_inet6."""
    wanted = ipaddress.IPv6Address(ip.split("%")[0]).exploded.replace(":", "")
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[0] == wanted:
                    return fields[5]
    except OSError:
        return None
    return None


def _interface_of(ip: str) -> str | None:
    if ":" in ip:
        return _ipv6_interface(ip)
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if _ipv4_of(name) == ip:
            return name
    # 127.0.0.2 and friends are not the primary address of lo but are routed through it.
    if ipaddress.IPv4Address(ip).is_loopback:
        return next((name for name in names if _is_loopback(name)), None)
    return None


def interface_for(master_addr: str) -> tuple[str, str] | None:
    """Name and local IP of the interface that routes to ``master_addr``.

    Returns:
        ``(interface name, local ip)``, e.g. ``("lo", "127.0.0.1")``, or None when the host does
        not resolve, no route leads to it, or the address belongs to no interface.
    """
    ip = local_ip_for(master_addr)
    if ip is None:
        return None
    name = _interface_of(ip)
    return None if name is None else (name, ip)


def interface_owning(host: str) -> tuple[str, str] | None:
    """Name and IP of the local interface that owns ``host``'s address (None: not this machine)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for *_, sockaddr in infos:
        ip = str(sockaddr[0])
        name = _interface_of(ip)
        if name is not None:
            return name, ip
    return None


def ipv4_interfaces() -> list[tuple[str, str]]:
    """``(name, IPv4 address)`` of every interface that has one, in kernel order."""
    out = []
    for _, name in socket.if_nameindex():
        ip = _ipv4_of(name)
        if ip is not None:
            out.append((name, ip))
    return out


def gloo_interface(
    environ: Mapping[str, str], master_addr: str | None, local_addr: str | None = None
) -> str | None:
    """The interface to pin as ``GLOO_SOCKET_IFNAME``; None leaves it as it is.

    Args:
        environ: The environment gloo will run in: a ``GLOO_SOCKET_IFNAME`` there (even
            empty) is the user's choice and wins (None).
        master_addr: The host every rank reaches (the store's); None or "" when there is none
            (``file://``, a single process): None.
        local_addr: This machine's address as the user gave it (``--local-addr``): the
            interface that owns it wins over the route to the master.

    Returns:
        The interface's name, or None when the user chose, or nothing was found (the master
        does not resolve, no route leads to it): then gloo decides as it always does.
    """
    if GLOO_IFNAME in environ:
        return None
    if local_addr:
        found = interface_owning(local_addr)
    elif master_addr:
        found = interface_for(master_addr)
    else:
        return None
    return None if found is None else found[0]
