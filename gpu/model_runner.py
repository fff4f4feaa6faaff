"""The real backend of the step seam: ``execute(SchedulerOutput) -> ModelRunnerOutput``.

Per step: swap-outs, swap-ins, block copies, then one forward pass over every scheduled token
(prefill chunks and decodes flattened together) and one batched sampling call.
"""

from __future__ import annotations

from pathlib import Path

import torch

from twinserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from twinserve.core.request import Request
from twinserve.gpu.batch import build_model_input
from twinserve.gpu.config import ModelConfig
from twinserve.gpu.kv_cache import GiB, KVCache, KVCacheSpec, host_memory_available, \
    num_blocks_for
from twinserve.gpu.model_loader import load_generation_config, load_model, resolve_dtype
from twinserve.gpu.sampler import sample
from twinserve.gpu.tokenizer import Tokenizer

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * GiB


class ModelRunner:
    """Holds the model, its KV cache, the tokenizer and per-request sampling generators."""

    def __init__(self, model: str | None = None, *, dtype: str | torch.dtype = "auto",
                 device: str = "cpu", block_size: int = 16, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, swap_space: float = 1.0,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enforce_eager: bool = False, seed: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
        if swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {swap_space}.")
        if model is None:
            from twinserve.gpu.default_model import default_model_path
            model = str(default_model_path())
        self.model_dir = Path(model)
        self.device = torch.device(device)
        self.block_size = block_size
        self.enforce_eager = enforce_eager
        self.config = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = min(self.config.max_position_embeddings,
                                 max_model_len or self.config.max_position_embeddings)
        self.vocab_size = self.config.vocab_size
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        self.model = load_model(self.model_dir, self.dtype, self.device, self.max_model_len)
        self.tokenizer = (Tokenizer.from_dir(self.model_dir)
                          if (self.model_dir / "tokenizer.json").is_file() else None)
        self.eos_token_id = self._eos_token_id()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        spec = KVCacheSpec(self.config.num_hidden_layers, block_size,
                           self.config.num_key_value_heads, self.config.head_dim, self.dtype)
        num_gpu = num_blocks_for(self._kv_budget(kv_cache_memory, gpu_memory_utilization,
                                                 max_num_batched_tokens), spec)
        self.kv_cache = KVCache(spec, num_gpu, num_blocks_for(swap_space * GiB, spec),
                                self.device)
        self.num_gpu_blocks = self.kv_cache.num_gpu_blocks
        self.num_cpu_blocks = self.kv_cache.num_cpu_blocks
        self._graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            from twinserve.gpu.cuda_graphs import DecodeGraphs
            self._graphs = DecodeGraphs(self.model, self.kv_cache.gpu, block_size,
                                        self.max_model_len)

    def _eos_token_id(self) -> int | None:
        eos = load_generation_config(self.model_dir).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None and self.config.eos_token_ids:
            eos = self.config.eos_token_ids[0]
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def _kv_budget(self, kv_cache_memory: int | None, utilization: float,
                   max_num_batched_tokens: int) -> int:
        if self.device.type != "cuda":
            budget = DEFAULT_CPU_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
            return min(int(budget), host_memory_available() // 2)
        if kv_cache_memory is not None:
            return int(kv_cache_memory)
        from twinserve.gpu.cuda_graphs import profile_peak_memory
        peak = profile_peak_memory(self.model, max_num_batched_tokens, self.block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * utilization) - peak

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        self.kv_cache.swap_out(scheduler_output.blocks_to_swap_out)
        self.kv_cache.swap_in(scheduler_output.blocks_to_swap_in)
        self.kv_cache.copy_blocks(scheduler_output.blocks_to_copy)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput()
        inputs = build_model_input(scheduled, self.block_size, self.max_model_len, self.device)
        if self._graphs is not None and self._graphs.can_run(inputs):
            hidden = self._graphs.run(inputs)
        else:
            self.model.backend.prepare(inputs.meta, self.block_size)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.gpu,
                                inputs.meta)
        if not inputs.sample_index:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        requests = [scheduled[i].request for i in inputs.sample_index]
        result = sample(logits, requests, [self._generator_for(r) for r in requests],
                        self.generator)
        out = ModelRunnerOutput()
        for request, token, logprobs in zip(requests, result.token_ids, result.logprobs):
            out.sampled_token_ids[request.request_id] = [token]
            if logprobs is not None:
                out.logprobs[request.request_id] = [logprobs]
        return out

    def _generator_for(self, request: Request) -> torch.Generator | None:
        """A seeded request's own generator (seed + child index for n > 1), made on first use."""
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed + request.index)
            self._generators[request.request_id] = gen
        return gen
