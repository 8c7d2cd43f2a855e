"""Cutting a broken group's connections: a peer blocked on this process reads EOF at once."""

from __future__ import annotations

import socket

from phalanx.recovery.sockets import GroupSockets, socket_fds


def test_cut_shuts_down_new_connections_but_not_listeners() -> None:
    before = socket_fds()
    listener = socket.create_server(("127.0.0.1", 0))
    ours, peer = socket.socketpair()
    try:
        noted = GroupSockets.opened_since(before)
        assert {listener.fileno(), ours.fileno(), peer.fileno()} <= set(noted.fds)
        assert noted.cut() == 2  # the pair's two ends; the listener stays up
        peer.settimeout(2.0)
        assert peer.recv(1) == b""  # EOF, not a wait
        with socket.create_connection(listener.getsockname(), timeout=2.0):
            listener.settimeout(2.0)
            listener.accept()[0].close()  # still listening
    finally:
        for s in (listener, ours, peer):
            s.close()


def test_a_reused_descriptor_is_not_cut() -> None:
    """A noted number now held by another socket (another inode) is left alone."""
    c, d = socket.socketpair()
    try:
        noted = GroupSockets({c.fileno(): "socket:[999999999]"})
        assert noted.cut() == 0
        d.settimeout(1.0)
        c.sendall(b"x")
        assert d.recv(1) == b"x"  # the socket still works
    finally:
        c.close()
        d.close()
