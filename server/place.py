"""Where a front process stands, as the supervisor places it, and the listening socket the supervisor
and every front bind one port with.

Light on purpose: the supervisor imports it, and never the fronts' or the engine's modules.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from minilm_embed.server.config import listen_address


@dataclass(frozen=True)
class SharedQueue:
    """The engine's queue as every front reads it, in shared memory only the engine writes: how many
    inputs wait, their tokens, and the recent seconds of compute per token (0.0 until a batch has
    run), from which a full queue's refusal says when to try again. Read without a lock: each is one
    aligned 8-byte value, and a front reading one a batch stale only refuses or admits a request a
    moment early, or says a retry time off by a batch."""

    values: Any  # 3 floats: the supervisor's multiprocessing RawArray("d", 3), a list in process

    @classmethod
    def shared(cls, context: Any) -> SharedQueue:
        return cls(context.RawArray("d", 3))

    @classmethod
    def local(cls) -> SharedQueue:
        return cls([0.0, 0.0, 0.0])

    @property
    def depth(self) -> int:
        return int(self.values[0])

    @property
    def s_per_input(self) -> float:
        """Seconds of compute per waiting input: the recent pace per token times their mean length."""
        return s_per_waiting_input(self.values[2], self.values[1], int(self.values[0]))

    def publish_depth(self, depth: int, tokens: int) -> None:
        self.values[1] = tokens
        self.values[0] = depth

    def publish_pace(self, s_per_token: float) -> None:
        self.values[2] = s_per_token


def s_per_waiting_input(s_per_token: float, tokens: float, inputs: int) -> float:
    """The compute time of an input of the queue's mean length at `s_per_token` (0.0: none waits, or
    no pace yet). Per token, not per input: a queue of long inputs after a run of short ones took
    ~120x the time per input the short ones had set (an acceptance pass: told 0.1 s, room after 12 s)."""
    return s_per_token * tokens / inputs if inputs > 0 else 0.0


@dataclass(frozen=True)
class Place:
    """Where a front process stands: its index, the address it serves, the engine it talks to."""

    index: int
    address: str
    http_address: str  # "" when HTTP is off
    engine_address: str
    engine_pid: int
    queue: SharedQueue  # the engine's, as it publishes it
    events: Connection  # to the supervisor
    beat: Any  # this front's heartbeat (a shared value: see heartbeat)


# How often a serving process's event loop writes its heartbeat; the supervisor looks as often.
HEARTBEAT_S = 1.0


# Sent to a child taken as frozen just before it is killed (app._dump_then_kill).
DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """On DUMP_SIGNAL, write every thread's Python stack to fd 2 (the log): faulthandler does it from C,
    without the GIL a deadlock may hold."""
    faulthandler.register(DUMP_SIGNAL, all_threads=True)


async def heartbeat(beat: Any) -> None:
    """Write time.monotonic() (one clock for every process on the host) into the shared `beat` every
    HEARTBEAT_S, from the event loop: the supervisor takes one that stops changing as frozen."""
    while True:
        beat.value = time.monotonic()
        await asyncio.sleep(HEARTBEAT_S)


def reuseport_socket(address: str) -> socket.socket:
    """A TCP socket bound to `host:port` with SO_REUSEPORT, so that every front can bind the port, and
    SO_REUSEADDR, as every server's listener has (gRPC's own do): the connections it accepts inherit
    it, and those the server closed first, left in TIME_WAIT for a minute, then do not keep a server
    started again on the port from binding it (check_ports refused it: "in use")."""
    where = listen_address(address)
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP;
    # without it a response's header and body writes met delayed ACKs (40 ms per HTTP call).
    sock = socket.socket(where.family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((where.host, where.port))
    except BaseException:
        sock.close()
        raise
    return sock
