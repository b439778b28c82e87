"""A front's budgets for work in flight: past one, a request is refused at once with RESOURCE_EXHAUSTED
naming the setting and the figures, before the work it would cost is done."""

from __future__ import annotations

import asyncio
import collections
import contextlib

from minilm_embed.server.errors import InvalidInput, Overloaded


class Budget:
    """`limit` units (characters, bytes) held at once in one front process, whatever the requests."""

    def __init__(self, limit: int, setting: str, what: str) -> None:
        self.limit = limit
        self.setting = setting  # the flag that sets it, named in refusals
        self.what = what  # e.g. "characters being tokenized"
        self.in_use = 0
        self.asked = 0  # units ever asked for, held or refused (front.reclaim_memory watches it)
        self.open = 0  # Holds not yet closed: requests still being answered
        self._freed = asyncio.Event()

    def reserve(self, amount: int) -> None:
        """Take `amount`, or refuse: it never fits (INVALID_ARGUMENT), or not now (RESOURCE_EXHAUSTED)."""
        self.asked += amount
        if amount > self.limit:
            raise InvalidInput(
                f"{amount} {self.what} for one request can never fit {self.setting}={self.limit}; "
                "split the request",
                "OVER_FRONT_LIMIT",
                setting=self.setting,
                limit=self.limit,
                value=amount,
            )
        if self.in_use + amount > self.limit:
            raise Overloaded(
                f"front busy: {self.in_use} {self.what}, {amount} more asked, {self.setting} is "
                f"{self.limit}; retry with backoff",
                "FRONT_BUSY",
                setting=self.setting,
                limit=self.limit,
                value=self.in_use,
                asked=amount,
            )
        self.in_use += amount

    async def wait_for(self, amount: int) -> Hold:
        """Take `amount` once it fits, however long that takes (a stream's reader, which meanwhile
        reads no further). Whatever its size it fits once nothing else is held."""
        self.asked += amount
        while self.in_use and self.in_use + amount > self.limit:
            self._freed.clear()
            await self._freed.wait()
        self.in_use += amount
        return Hold(self, amount)

    def release(self, amount: int) -> None:
        self.in_use -= amount
        assert self.in_use >= 0
        self._freed.set()

    def hold(self, amount: int) -> Hold:
        """`reserve`, as a Hold to release once (a with-block releases it at the latest)."""
        self.reserve(amount)
        return Hold(self, amount)


class Hold:
    """Part of a budget taken by one request: released once, early or at the end of a with-block.

    Open until the with-block ends (the request is answered), released or not: `Budget.open`.
    """

    def __init__(self, budget: Budget, amount: int) -> None:
        self.budget = budget
        self.amount = amount
        self._open = True
        self._kept: Hold | None = None
        budget.open += 1

    def keeping(self, kept: Hold) -> Hold:
        """This hold, with `kept` closed when it closes (not when it is released): a request's bytes
        held until it is answered, beside those held until it is tokenized."""
        self._kept = kept
        return self

    def grow(self, extra: int) -> None:
        """Take `extra` more (an HTTP body's bytes as they come), or refuse as `reserve` does; a hold
        it keeps grows too (before this one: what it took is given back when the request closes)."""
        if self._kept is not None:
            self._kept.grow(extra)
        self.budget.reserve(extra)
        self.amount += extra

    def release(self) -> None:
        if self.amount:
            self.budget.release(self.amount)
            self.amount = 0

    def __enter__(self) -> Hold:
        return self

    def close(self) -> None:
        """Release it if not yet released, and count the request answered (once)."""
        self.release()
        if self._open:
            self._open = False
            self.budget.open -= 1
        if self._kept is not None:
            self._kept.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def tokenizing_budget(limit: int) -> Budget:
    """Characters being tokenized at once: bounds the tokenizer's memory (its encodings take ~25
    bytes per character) and work in flight."""
    return Budget(limit, "max_tokenizing_chars", "characters being tokenized")


def request_bytes_budget(limit: int) -> Budget:
    """Bytes of requests being parsed and tokenized: bounds what that costs the event loop (~1 ms
    per MB) and the memory it holds (the bytes, the parsed message, its strings). Released once a
    request is tokenized: what waits for the engine after that is bounded by `held_bytes_budget`."""
    return Budget(limit, "max_request_bytes_in_flight", "bytes of requests being handled")


def held_bytes_budget(limit: int) -> Budget:
    """Bytes of requests not yet answered. A request's bytes, parsed message and strings live until
    its answer (grpc.aio holds the request for the handler's whole call), and the queue limit counts
    inputs, not bytes: one short input padded to 2 MiB (an unknown field) held 4.2 MiB of a front
    while it waited, so 4,096 of them would have taken 17 GB."""
    return Budget(limit, "max_request_bytes_held", "bytes of requests not yet answered")


class Places:
    """`limit` calls served at once, and up to `waiting_limit` more waiting in turn (first come, first
    served) for a place; past both, `take` is refused. A waiting call has read nothing yet."""

    def __init__(self, limit: int, waiting_limit: int) -> None:
        self.limit = limit
        self.waiting_limit = waiting_limit
        self.taken = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def full(self) -> bool:
        """No place now, and no room to wait for one."""
        return self.taken >= self.limit and len(self._waiters) >= self.waiting_limit

    async def take(self) -> None:
        """A place, at once or in turn. Cancelled while waiting, it takes none (a place handed to it
        in that instant goes on to the next in turn)."""
        if self.taken < self.limit and not self._waiters:
            self.taken += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.give_back()  # handed a place it will not use
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(turn)
            raise

    def give_back(self) -> None:
        """The place goes to the first call still waiting, else back to the free ones."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.taken -= 1
