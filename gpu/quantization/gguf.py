"""Run a GGUF file as it is (``quantization="gguf"``): every projection keeps its blocks (Q8_0,
Q4_0, Q4_1, Q4_K, Q6_K; F32/F16/BF16 tensors stay dense in fp32), the token embedding and LM head
too (rows dequantized per lookup, the LM-head product by the kernels). llama.cpp's Q/K row
permutation is undone by reordering whole rows, so the blocks are untouched; the values are
those ``gguf_convert`` writes to the fp32 directory, bit for bit."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from twinserve.core.model_config import ModelConfig
from twinserve.gpu.gguf_convert import hf_name, permuted_heads, unpermute
from twinserve.gpu.linear import LinearBase
from twinserve.gpu.quantization.formats import GGUF_FORMATS
from twinserve.gpu.quantization.quant_linear import QuantizedLinearMethod
from twinserve.gpu.quantization.quant_tensor import QuantTensor
from twinserve.gpu.quantization.quantized_model import QuantizedCausalLM

DENSE_TYPES = ("F32", "F16", "BF16")


def gguf_quant_tensor(tensor: gguf.ReaderTensor) -> QuantTensor:
    """One GGUF matrix as a ``QuantTensor`` (copied out of the file's memory map)."""
    kind = tensor.tensor_type.name
    in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first
    if kind in GGUF_FORMATS:
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        return QuantTensor(GGUF_FORMATS[kind], data.reshape(-1, data.shape[-1]), in_features)
    if kind in DENSE_TYPES:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        return QuantTensor(None, torch.from_numpy(array.reshape(-1, in_features)), in_features)
    raise ValueError(f"GGUF tensor {tensor.name!r} is {kind}; twinserve runs "
                     f"{', '.join([*GGUF_FORMATS, *DENSE_TYPES])} tensors.")


def load_gguf_model(gguf_file: Path, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device, max_positions: int) -> QuantizedCausalLM:
    if device.type != "cpu":
        raise ValueError("quantization='gguf' runs on the CPU backend only (device='cpu').")
    reader = gguf.GGUFReader(str(gguf_file))
    model = QuantizedCausalLM(config, max_positions, dtype, device)
    heads = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads}
    targets = config.arch.weight_map(config)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name == "model.embed_tokens.weight":
            model.set_embedding(gguf_quant_tensor(tensor))
            continue
        if name == "lm_head.weight":
            model.set_lm_head(gguf_quant_tensor(tensor))
            continue
        if name not in targets:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({name}) is not in the "
                             f"{config.architecture} weight map.")
        target = targets[name]
        module_name, _, _ = target.param.rpartition(".")
        owner = model.get_submodule(module_name)
        if isinstance(owner, LinearBase):
            part = gguf_quant_tensor(tensor)
            count = permuted_heads(tensor.name, heads)
            if count is not None:
                order = unpermute(np.arange(part.rows)[:, None], count)[:, 0]
                part = part.select_rows(torch.from_numpy(np.ascontiguousarray(order)))
            QuantizedLinearMethod.load_part(owner, part, target.shard_id)
        else:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            params[target.param].data.copy_(torch.from_numpy(array).reshape(target.shape))
            loaded.add(target.param)
    if model.quant_embed is None or model.quant_head is None:
        raise ValueError(f"{gguf_file}: token_embd.weight (or output.weight) is missing.")
    model.finish_linears()
    missing = sorted(name for name, p in model.named_parameters()
                     if name not in loaded and p.numel() and not name.endswith(".bias"))
    if missing:
        raise ValueError(f"{gguf_file}: no tensor for {', '.join(missing)}.")
    model.requires_grad_(False)
    return model.eval()
