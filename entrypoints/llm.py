"""The offline Python API, in vLLM's shape::

    from twinserve import LLM, SamplingParams
    llm = LLM()                                  # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from twinserve.core.engine_args import EngineArgs
from twinserve.core.lora import LoRARequest
from twinserve.core.pooling_params import PoolingParams
from twinserve.core.request_output import EmbeddingRequestOutput, RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.pd_front import PDDeployment
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.routers import router_class

Prompt = str | list[int]
PromptDict = dict[str, Any]  # vLLM's TextPrompt {"prompt": ...} / TokensPrompt {"prompt_token_ids"}
PromptLike = Prompt | PromptDict
Messages = list[dict[str, Any]]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Generates for a batch of prompts with continuous batching; outputs come back in input
    order. Engine knobs are ``EngineArgs`` fields (vLLM's names)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """``engine_args`` are ``EngineArgs`` fields (vLLM's names, e.g. ``max_num_seqs``,
        ``scheduling_policy``, ``speculative_config={"method": "ngram",
        "num_speculative_tokens": 4}``: a ``SpeculativeConfig``, its keys or their JSON); an
        unknown one, or one twinserve does not implement, raises ValueError naming it.
        ``LLM(**yaml.safe_load(open("engine.yaml")))`` takes the keys of a ``--config`` file.
        ``prefill_instances=X, decode_instances=Y``: disaggregated prefill/decode over X + Y
        engine processes (``entrypoints/pd_front.py``); ``prefill_args``, ``decode_args``: each
        pool's engine-argument overrides (a mapping or JSON text, ``core/pool_args.py``)."""
        pd = PDDeployment.of(*(engine_args.pop(k, None) for k in
                               ("prefill_instances", "decode_instances", "prefill_args",
                                "decode_args")))
        args = EngineArgs.from_mapping(engine_args, "LLM", model=model)
        self.engine = _make_engine(args, pd)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = _make_engine(args)
        return llm

    def shutdown(self) -> None:
        """Ends the engine's processes (data-parallel replicas, tensor-parallel workers); also
        done at exit."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None, tenant: str | Sequence[str] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """``prompts``: a string, a list of token ids, vLLM's ``{"prompt": text}`` or
        ``{"prompt_token_ids": [...]}``, or a list of any of those. ``lora_request``: one
        adapter for every prompt, or one (or None: the base model) per prompt."""
        batch, texts = _as_batch(prompts)
        return self._run(batch, texts, sampling_params, priority, tenant, lora_request, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             priority: Sequence[int] | None = None, tenant: str | Sequence[str] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             split_special_tokens: bool = True) -> list[RequestOutput]:
        """Applies the chat template (the model's, or ``chat_template``) to each conversation,
        then generates. ``tools`` (OpenAI's function tools) go to the template as HF's
        ``apply_chat_template(tools=...)`` passes them; the output is text (parse tool calls
        with a parser of ``twinserve.entrypoints.tool_parsers``). Special-token text inside the
        messages' contents stays text (HF's ``split_special_tokens``; False for trusted callers
        whose contents hold control tokens on purpose)."""
        from twinserve.entrypoints.chat_template import ChatTemplateOptions, encode_chat
        from twinserve.entrypoints.chat_tools import check_history, parse_tools
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template.")
        conversations = cast(Sequence[Messages], [messages] if messages and isinstance(
            messages[0], dict) else messages)
        definitions = [t.definition for t in parse_tools(tools)] or None
        options = ChatTemplateOptions(chat_template, chat_template_kwargs,
                                      add_generation_prompt, continue_final_message,
                                      definitions)
        batch: list[Prompt] = []
        texts: list[str | None] = []
        for conversation in conversations:
            check_history(list(conversation))
            # The template already holds the special tokens: encode without adding more.
            prompt = encode_chat(tok, list(conversation), options,
                                 split_special_tokens=split_special_tokens)
            batch.append(prompt.token_ids)
            texts.append(prompt.text)
        return self._run(batch, texts, sampling_params, priority, tenant, lora_request, use_tqdm)

    def embed(self, prompts: PromptLike | Sequence[PromptLike],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's embed task on this decoder model: each prompt's last-token final hidden
        state, L2-normalised (``outputs.embedding``). Runs through the engine (scheduler and
        KV cache, prefill only)."""
        batch, texts = _as_batch(prompts)
        pooling = _per_prompt("pooling_params", pooling_params, len(batch))
        pooling = [PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens) if p is None
                   else p for p in pooling]
        if any(not isinstance(p, PoolingParams) for p in pooling):
            raise ValueError("pooling_params must be a PoolingParams or a list of them.")
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        return self._run(batch, texts, params, None, None, lora_request, use_tqdm,
                         pooling)  # type: ignore[return-value]

    def _run(self, batch: list[Prompt], texts: list[str | None],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             priority: Sequence[int] | None, tenant: str | Sequence[str] | None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
             use_tqdm: bool,
             pooling: list[PoolingParams] | None = None) -> list[RequestOutput]:
        n = len(batch)
        _check_sampling_params(sampling_params)
        params = _per_prompt("sampling_params", sampling_params or SamplingParams(), n)
        prios = _per_prompt("priority", 0 if priority is None else priority, n)
        tenants = _per_prompt("tenant", tenant or "default", n)
        loras = _per_prompt("lora_request", lora_request, n)
        engine = self.engine
        ids: list[str] = []
        try:
            for i, (prompt, p, prio, ten, lora) in enumerate(
                    zip(batch, params, prios, tenants, loras)):
                ids.append(engine.add_request(prompt, p, priority=prio, tenant=ten,
                                              lora_request=lora,
                                              pooling_params=pooling[i] if pooling else None))
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


def _make_engine(args: EngineArgs, pd: PDDeployment | None = None) -> Any:
    """One engine, or with ``data_parallel_size`` > 1 the replicas behind a routing front, or
    with ``pd`` prefill and decode instances behind the disaggregated front."""
    if pd is not None:
        from twinserve.entrypoints.dp_llm_engine import DataParallelEngine
        return DataParallelEngine(args, usage_context="llm", pd=pd)
    if args.data_parallel_size > 1:
        from twinserve.entrypoints.dp_llm_engine import DataParallelEngine
        return DataParallelEngine(args, usage_context="llm")
    router_class(args.router)  # (one replica routes nothing; a misspelt name is still refused)
    return LLMEngine(args, usage_context="llm")


def _as_batch(prompts: Any) -> tuple[list[Prompt], list[str | None]]:
    """The prompts to add (text or token ids) and, per prompt, the text its output reports
    (None: the engine's own)."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a string, a list of token ids, a prompt dict "
                         f"({' or '.join(PROMPT_KEYS)}) or a list of those, got {prompts!r}.")
    if not prompts:
        raise ValueError("prompts must not be empty.")
    batch: list[Prompt] = []
    texts: list[str | None] = []
    for i, prompt in enumerate(prompts):
        one, text = _one_prompt(prompt, i)
        batch.append(one)
        texts.append(text)
    return batch, texts


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and \
        all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(prompt: Any, index: int) -> tuple[Prompt, str | None]:
    if isinstance(prompt, str):
        return prompt, None
    if _is_token_ids(prompt):
        return list(prompt), None
    if not isinstance(prompt, dict):
        raise ValueError(f"prompts[{index}] must be a string, a list of token ids or a prompt "
                         f"dict, got {prompt!r}.")
    unsupported = sorted(set(prompt) - set(PROMPT_KEYS))
    if unsupported:
        raise ValueError(f"prompts[{index}]: {', '.join(map(str, unsupported))} not supported by "
                         f"twinserve (a prompt dict holds only {' and/or '.join(PROMPT_KEYS)}).")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompts[{index}]['prompt'] must be a string, got {text!r}.")
    if "prompt_token_ids" in prompt:
        token_ids = prompt["prompt_token_ids"]
        if not _is_token_ids(token_ids):
            raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a non-empty list of "
                             f"integers, got {token_ids!r}.")
        return list(token_ids), text  # the text, if given, is what the output reports
    if text is None:
        raise ValueError(f"prompts[{index}]: a prompt dict needs {' or '.join(PROMPT_KEYS)}.")
    return text, None


def _check_sampling_params(value: Any) -> None:
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if item is None or isinstance(item, SamplingParams):
            continue
        hint = f": pass SamplingParams(**{item!r})" if isinstance(item, dict) else ""
        raise ValueError("sampling_params must be a SamplingParams or a list of them (one per "
                         f"prompt), got {type(item).__name__}{hint}.")


def _per_prompt(name: str, value: Any, n: int) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts.")
        return list(value)
    return [value] * n
