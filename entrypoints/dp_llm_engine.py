"""``LLM(data_parallel_size=N)``'s engine: the data-parallel front behind the part of
``LLMEngine``'s surface that ``LLM`` uses (``add_request``, ``abort_request``, ``step``,
``has_unfinished_requests``, ``tokenizer``), so ``LLM`` drives N replicas as it drives one.

``step`` returns what the replicas delivered since the last call, waiting for at least one
item; a refusal or a dead replica comes back from ``step`` as the exception it is (``LLM``
then aborts the rest of the batch), since a replica checks a request only once it takes it.
"""

from __future__ import annotations

import itertools
import queue
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.request_output import RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.dp_front import DataParallelFront
from twinserve.entrypoints.pd_front import DisaggregatedFront, PDDeployment
from twinserve.gpu.engine.tokenizer import Tokenizer
from twinserve.gpu.models.default_model import resolve_model_source

STEP_TIMEOUT_S = 600.0


class _QueueSink:
    __slots__ = ("queue",)

    def __init__(self, q: queue.SimpleQueue) -> None:
        self.queue = q

    def put(self, item: Any) -> None:
        self.queue.put(item)


def on_cuda(args: EngineArgs) -> bool:
    if args.device != "auto":
        return args.device == "cuda"
    import torch
    return torch.cuda.is_available()


def front_tokenizer(args: EngineArgs) -> Tokenizer | None:
    model_dir = resolve_model_source(args.model)[0]
    return Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None


class DataParallelEngine:
    def __init__(self, args: EngineArgs, usage_context: str = "llm",
                 pd: PDDeployment | None = None) -> None:
        self.args = args
        self.tokenizer = front_tokenizer(args)
        tokenize = None if self.tokenizer is None else (
            lambda text: self.tokenizer.encode(text, add_special_tokens=True))
        self.front = (DataParallelFront(args, usage_context, on_cuda(args), tokenize) if pd is None
                      else DisaggregatedFront(args, pd, usage_context, on_cuda(args), tokenize))
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._sink = _QueueSink(self._items)
        self._ids = itertools.count()
        self._unfinished: set[str] = set()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, **kwargs: Any) -> str:
        rid = request_id or f"req-{next(self._ids)}"
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        self.front.submit(rid, prompt, params or SamplingParams(), kwargs, self._sink)
        self._unfinished.add(rid)
        return rid

    def abort_request(self, request_id: str) -> None:
        self._unfinished.discard(request_id)
        self.front.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> list[RequestOutput]:
        items = [self._items.get(timeout=STEP_TIMEOUT_S)]
        while not self._items.empty():
            items.append(self._items.get_nowait())
        outputs: list[RequestOutput] = []
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                outputs.append(item)
                if item.finished:
                    self._unfinished.discard(item.request_id)
        return outputs

    def shutdown(self) -> None:
        self.front.shutdown()
