"""The port a multi-node trial's rendezvous is announced at stays this planner's until torchrun's
store listens on it: no other process can take it in between, and the real c10d store can."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from autofit.trials.cluster import reserved_port


def test_a_reserved_port_is_refused_to_others_and_taken_by_the_c10d_store():
    with reserved_port() as port:
        other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with other, pytest.raises(OSError, match="in use"):
            other.bind(("", port))
        for libuv in (True, False):  # both of TCPStore's server back ends
            timeout = datetime.timedelta(seconds=10)
            server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout,
                                   use_libuv=libuv)  # fmt: skip
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
            server.set("joined", "1")
            assert client.get("joined") == b"1"
            del client, server
