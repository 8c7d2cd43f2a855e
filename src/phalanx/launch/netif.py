"""Which local network interface carries the traffic to the master address.

gloo picks its interface by resolving the host name, which on many machines lands on an address
the peers cannot reach. The launcher pins ``GLOO_SOCKET_IFNAME`` to the interface that routes to
the master instead; ``phalanx doctor`` reports the same answer.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

__all__ = ["interface_for", "interface_owning", "ipv4_interfaces", "local_ip_for"]

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
