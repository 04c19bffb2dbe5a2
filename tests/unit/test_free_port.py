"""The ports test clusters are started on: never an ephemeral one an outgoing connection could take."""

from __future__ import annotations

import socket

from baton.cluster import ephemeral_range, free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    low, high = ephemeral_range()
    assert not any(low <= port <= high for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # nothing took it

