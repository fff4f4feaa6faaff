"""The offline Python API, in vLLM's shape::

    from twinserve import LLM, SamplingParams
    llm = LLM()                                  # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from twinserve.core.request_output import RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.llm_engine import EngineArgs, LLMEngine

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """Generates for a batch of prompts with continuous batching; outputs come back in input
    order. Engine knobs are ``EngineArgs`` fields (vLLM's names)."""

    def __init__(self, model: str | None = None, *, scheduling_policy: str = "fcfs",
                 **engine_kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(known))}")
        self.engine = LLMEngine(EngineArgs(model=model, scheduling_policy=scheduling_policy,
                                           **engine_kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None, tenant: str | Sequence[str] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        return self._run(batch, [None] * len(batch), sampling_params, priority, tenant, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             priority: Sequence[int] | None = None, tenant: str | Sequence[str] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [tok.apply_chat_template(list(c), add_generation_prompt=True)
                 for c in conversations]
        # The template already holds the special tokens: encode without adding more.
        batch: list[Prompt] = [tok.encode(t) for t in texts]
        return self._run(batch, texts, sampling_params, priority, tenant, use_tqdm)

    def _run(self, batch: list[Prompt], texts: list[str | None],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             priority: Sequence[int] | None, tenant: str | Sequence[str] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        n = len(batch)
        params = _per_prompt("sampling_params", sampling_params or SamplingParams(), n)
        prios = _per_prompt("priority", 0 if priority is None else priority, n)
        tenants = _per_prompt("tenant", tenant or "default", n)
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, p, prio, ten in zip(batch, params, prios, tenants):
                ids.append(engine.add_request(prompt, p, priority=prio, tenant=ten))
            return self._drain(ids, texts, use_tqdm)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise

    def _drain(self, ids: list[str], texts: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        results = [final[rid] for rid in ids]
        for out, text in zip(results, texts):
            if text is not None:
                out.prompt = text
        return results


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    batch = list(prompts)
    if not batch:
        raise ValueError("prompts must not be empty.")
    return batch


def _per_prompt(name: str, value: Any, n: int) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts.")
        return list(value)
    return [value] * n
