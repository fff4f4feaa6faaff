"""The engine loop in its own thread, fed from asyncio.

HTTP handling never blocks a step and a step never blocks HTTP: requests and aborts go to the
engine thread through a thread-safe queue; each step's outputs come back to the event loop with
``call_soon_threadsafe``. Only the engine thread touches the engine, so the scheduler needs no
locks.

A request is submitted (``submit``), then accepted or refused by the engine between two steps
(``RequestStream.accepted``: ``ValueError`` for a request that can never run,
``EngineOverloaded`` for one the engine will not queue now), then streams its outputs. Closing
its stream before it finished aborts it, wherever it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from twinserve.core.errors import EngineOverloaded
from twinserve.core.request_output import RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import ADMISSION_RETRY_AFTER_S
from twinserve.gpu.engine.llm_engine import LLMEngine


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; the server answers 503/500 from then on."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """One submitted request: ``await accepted()``, then ``outputs()``; ``close()`` (idempotent)
    aborts it unless it finished."""

    __slots__ = ("_done", "_engine", "_outputs_started", "_pending", "_queue", "engine_index",
                 "request_id")

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue,
                 engine_index: int = 0) -> None:
        self._engine = engine
        self.request_id = request_id
        # the engine that serves it: a data-parallel replica's index (the metrics' ``engine``)
        self.engine_index = engine_index
        self._queue = queue
        self._pending: list[RequestOutput] = []
        self._done = False
        self._outputs_started = False

    async def accepted(self) -> None:
        """Returns once the engine queued the request; raises what it refused it with."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._done = True  # refused: nothing to abort
                raise item
            if item is None:
                return
            self._pending.append(item)  # an output before the acceptance marker: keep it

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes (call after ``accepted``)."""
        try:
            while self._pending:
                out = self._pending.pop(0)
                yield out
                if out.finished:
                    self._done = True
                    return
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                if item is None:
                    continue
                yield item
                if item.finished:
                    self._done = True
                    return
        finally:
            self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            if self._engine.is_alive:
                self._engine._submit("abort", self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput]], None] | None = None
                 ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # Adds handed to the engine thread and taken by it: each counter has one writer thread,
        # so their difference (adds in flight) is read without a lock.
        self._adds_submitted = 0
        self._adds_taken = 0
        self._thread = threading.Thread(target=self._run, name="twinserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def _submit(self, *command: Any) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        self._commands.put(command)
        self._wake.set()
        if self.error is not None:  # died meanwhile: nobody will drain the queue
            self._fail_pending_commands()

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str,
               **kwargs: Any) -> RequestStream:
        """Hands a request to the engine thread; the stream says whether it was accepted."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        refusal = self._queue_full()
        if refusal is not None:  # "not now" at once, without a turn of the engine thread
            stream.queue.put_nowait(refusal)
            return RequestStream(self, request_id, stream.queue)
        self._submit("add", request_id, prompt, params, kwargs, stream)
        self._adds_submitted += 1
        return RequestStream(self, request_id, stream.queue)

    def _queue_full(self) -> EngineOverloaded | None:
        """The scheduler's bound on waiting requests, counting the adds still in flight to the
        engine thread (in a burst, thousands arrive before it takes any): the engine thread
        only reads commands between steps. The scheduler's own check stays authoritative."""
        scheduler = self.engine.scheduler
        bound = scheduler.config.max_waiting_requests
        waiting = scheduler.num_queued + self._adds_submitted - self._adds_taken
        seats = scheduler.free_seats()
        if bound is None or waiting < bound + seats:
            return None
        return EngineOverloaded(
            f"the engine is overloaded: {waiting} requests are queued for {seats} free seats "
            f"(max_waiting_requests {bound}); retry later.", "max_waiting_requests",
            ADMISSION_RETRY_AFTER_S)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes. Raises ValueError (or
        EngineOverloaded) if the engine refuses it. Leaving early (client gone) aborts the
        request and frees its blocks."""
        async for out in outputs_until_done(self.submit(prompt, params, request_id, **kwargs)):
            yield out

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future[Any]:
        """Runs ``fn(engine)`` on the engine thread between steps (e.g. reset_prefix_cache)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._submit("call", fn, _Stream(loop, asyncio.Queue()), fut)
        return fut

    def call_blocking(self, fn: Callable[[LLMEngine], Any], timeout_s: float | None = None) -> Any:
        """``call`` for code outside an event loop (start-up): waits until ``fn(engine)`` ran
        on the engine thread and returns its result or raises its exception."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._submit("call_blocking", fn, fut)
        return fut.result(timeout_s)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._deliver(outputs)
                    if self._on_step is not None:
                        self._on_step(outputs)
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:  # the engine is dead: every waiter learns why
            self.error = exc
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"engine failed: {exc!r}"))
            self._streams.clear()
            self._fail_pending_commands()

    def _fail_pending_commands(self) -> None:
        """After the engine died: answers the queued adds and calls with EngineDeadError, so
        no waiter hangs (called by the dying engine thread and by late submitters)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            error = EngineDeadError(f"engine failed: {self.error!r}")
            if command[0] == "add":
                command[5].put(error)
            elif command[0] == "call":
                _, _, stream, fut = command
                stream.loop.call_soon_threadsafe(_resolve, fut, None, error)
            elif command[0] == "call_blocking":
                command[2].set_exception(error)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "call":
                _, fn, stream, fut = command
                try:
                    result = fn(self.engine)
                    stream.loop.call_soon_threadsafe(_resolve, fut, result, None)
                except Exception as exc:  # reported to the caller, the engine goes on
                    stream.loop.call_soon_threadsafe(_resolve, fut, None, exc)
            elif kind == "call_blocking":
                _, fn, blocking = command
                try:
                    blocking.set_result(fn(self.engine))
                except Exception as exc:
                    blocking.set_exception(exc)

    def _add(self, request_id: str, prompt: Any, params: SamplingParams, kwargs: dict,
             stream: _Stream) -> None:
        self._adds_taken += 1
        try:
            self.engine.add_request(prompt, params, request_id=request_id, **kwargs)
        except (ValueError, EngineOverloaded) as exc:  # refused: the engine holds nothing of it
            stream.put(exc)
            return
        self._streams[request_id] = stream
        stream.put(None)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their streams with one wake-up per event loop (not one per
        output: with 64 streams, per-output wake-ups kept the loop thread busy in the GIL)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


async def outputs_until_done(request: RequestStream) -> AsyncIterator[RequestOutput]:
    """A submitted request's outputs once it is accepted (raising what refused it); leaving
    early aborts it (the engine's and the data-parallel front's ``generate``)."""
    try:
        await request.accepted()
        async for out in request.outputs():
            yield out
    finally:
        request.close()
