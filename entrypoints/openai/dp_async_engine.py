"""The server's engine with ``--data-parallel-size N``: ``AsyncEngine``'s surface over the
data-parallel front (``entrypoints/dp_front.py``), so the HTTP layer serves N replicas as it
serves one.

``engine`` is a front-local ``LLMEngine`` that is never stepped: the HTTP layer reads the model's
facts from it (tokenizer, context length, vocabulary, the request surface's checks) exactly as
with one engine. Its runner is a ``FrontModel`` (``entrypoints/front_model.py``): the model's
configuration and tokenizer, no weights; the replicas do the work. A request a replica is
serving when it dies ends with ``ReplicaLost`` (an ``EngineDeadError``: a 503 in OpenAI's shape,
or an error event in a stream).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.request_output import RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.dp_front import DataParallelFront, ReplicaDied, ReplicaState
from twinserve.entrypoints.dp_llm_engine import on_cuda
from twinserve.entrypoints.front_model import front_model
from twinserve.entrypoints.openai.async_engine import (
    EngineDeadError,
    RequestStream,
    outputs_until_done,
)
from twinserve.entrypoints.openai.http_errors import APIError
from twinserve.entrypoints.pd_front import DisaggregatedFront, PDDeployment
from twinserve.gpu.engine.llm_engine import LLMEngine

FRONT_KV_BLOCKS = 4  # the front-local engine holds no request: its KV cache stays tiny


class ReplicaLost(EngineDeadError):
    """The replica serving the request died."""


class _LoopSink:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def put(self, item: Any) -> None:
        if isinstance(item, ReplicaDied):
            item = ReplicaLost(str(item))
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop closed (server stopping): nobody waits for this request


def front_engine(args: EngineArgs) -> LLMEngine:
    """The front-local engine the HTTP layer reads the model's facts from: its runner holds
    the model's configuration and tokenizer, never its weights."""
    local = args.replace(data_parallel_size=1, device="cpu", kv_cache_memory_bytes=None,
                         num_gpu_blocks_override=FRONT_KV_BLOCKS, tensor_parallel_size=1,
                         distributed_executor_backend=None, kv_transfer_config=None)
    engine = LLMEngine(local, runner=front_model(local, "server"),  # type: ignore[arg-type]
                       usage_context="server")
    engine.metrics.record_steps = False
    return engine


class DPAsyncEngine:
    """``pd``: prefill and decode instances behind the disaggregated front instead."""

    def __init__(self, args: EngineArgs, pd: PDDeployment | None = None) -> None:
        self.engine = front_engine(args)
        tok = self.engine.tokenizer
        tokenize = None if tok is None else (
            lambda text: tok.encode(text, add_special_tokens=True))
        self.front = (DataParallelFront(args, "server", on_cuda(args), tokenize) if pd is None
                      else DisaggregatedFront(args, pd, "server", on_cuda(args), tokenize))
        self._ids = itertools.count()

    @property
    def is_alive(self) -> bool:
        return self.front.is_alive

    def _submit(self, kind: str, request_id: str) -> None:
        """What ``RequestStream.close`` calls (``kind`` is ``abort``)."""
        if kind != "abort":
            raise ValueError(f"unknown command {kind!r}")
        self.front.abort(request_id)

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str,
               **kwargs: Any) -> RequestStream:
        if not self.is_alive:
            raise EngineDeadError(f"the data-parallel front is not running: {self.front.error}")
        queue: asyncio.Queue = asyncio.Queue()
        sink = _LoopSink(asyncio.get_running_loop(), queue)
        index = 0
        try:
            index = self.front.submit(request_id, prompt, params, kwargs, sink)
        except Exception as exc:  # a refusal at the front: the stream raises it when awaited
            queue.put_nowait(exc)
        return RequestStream(self, request_id, queue, index)  # type: ignore[arg-type]

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        async for out in outputs_until_done(self.submit(prompt, params, request_id, **kwargs)):
            yield out

    def abort(self, request_id: str) -> None:
        self.front.abort(request_id)

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future[Any]:
        """Engine calls (prefix-cache reset, LoRA loading) are not carried to the replicas:
        refused rather than run on the front-local engine, which serves nothing."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_exception(APIError(400, "This operation is not supported with "
                                        "--data-parallel-size > 1."))
        return fut

    def call_blocking(self, fn: Callable[[LLMEngine], Any], timeout_s: float | None = None) -> Any:
        raise ValueError("engine calls are not supported with --data-parallel-size > 1.")

    def replicas(self) -> list[ReplicaState]:
        return self.front.snapshot()

    def shutdown(self) -> None:
        self.front.shutdown()
        self.engine.shutdown()
