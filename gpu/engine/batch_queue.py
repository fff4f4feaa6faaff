"""The engine's step with vLLM's batch queue (``step_with_batch_queue``), under pipeline
parallelism: up to ``pp`` batches in flight, so that the driver's stage runs batch ``i + 1``
while the later stages finish batch ``i``.

    step():  schedule; a batch with tokens -> runner.submit (the driver's stage; logits posted)
             queue not full -> return (the next step schedules another batch first)
             else, or nothing new to schedule -> the oldest batch: runner.finish (its logits,
             sampled) -> update_from_output, output processing

The scheduler skips the requests of batches in flight (``core.batch_queue``), so the batches
hold different requests; a lone request still takes its steps one at a time. A step with no
tokens (only finished ids to forget or blocks to move) runs at once, as without the queue.
``core.batch_queue.BatchQueue.schedule`` spreads the running requests over the batches.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from twinserve.core.batch_queue import BatchQueue

if TYPE_CHECKING:
    from twinserve.core.request_output import EmbeddingRequestOutput, RequestOutput
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.worker.model_runner import PendingStep

QueuedStep = tuple["PendingStep", float]  # the runner's pending step, its perf_counter start


def step_with_batch_queue(engine: LLMEngine, queue: BatchQueue[QueuedStep]
                          ) -> list[RequestOutput | EmbeddingRequestOutput]:
    """One ``engine.step()`` with the batch queue: submits a new batch, finishes the oldest,
    or both (see the module doc)."""
    driver, runner = engine.driver, engine.runner
    if not queue.full and engine.scheduler.has_unfinished_requests():
        t0, start = time.perf_counter(), engine.now()
        out = queue.schedule(start)
        if out.scheduled:
            queue.push(out, (runner.submit(out), t0), start)
            if not queue.full:
                return []
        else:  # nothing new to run (its requests in flight, or no room): ids, block moves
            driver.execute(runner, out)
    if not len(queue):
        return []
    batch = queue.pop()
    pending, t0 = batch.handle
    result = runner.finish(pending)
    return engine.complete_step(batch.out, result, batch.start, engine.now(), t0)
