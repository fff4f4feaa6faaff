"""Run a GGUF file as it is (``quantization="gguf"``): every projection keeps its blocks (Q8_0,
Q4_0, Q4_1, Q4_K, Q6_K; F32/F16/BF16 tensors stay dense in fp32), the token embedding and LM head
too (rows dequantized per lookup, the LM-head product by the kernels). llama.cpp's Q/K row
permutation is undone by reordering whole rows, so the blocks are untouched; the values are
those ``gguf_convert`` writes to the fp32 directory, bit for bit."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from twinserve.core.kernel_settings import KernelSettings
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.layers.linear import LinearBase
from twinserve.gpu.models.gguf_convert import hf_name, permuted_heads, unpermute
from twinserve.gpu.quantization.formats import GGUF_FORMATS
from twinserve.gpu.quantization.quant_linear import QuantizedLinearMethod
from twinserve.gpu.quantization.quant_tensor import QuantTensor
from twinserve.gpu.quantization.quantized_model import QuantizedCausalLM

DENSE_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes lie in the file (``shape`` innermost first, as GGUF lists it)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def tensor_index(gguf_file: Path) -> list[TensorEntry]:
    """The file's tensor table, cached per file version: ``gguf.GGUFReader`` parses every
    metadata field first (the 49k-token vocabulary: ~9 s of a 10 s load here), the table alone
    is read in milliseconds."""
    from twinserve.gpu.models.default_model import cache_root, file_key
    source = gguf_file.resolve()
    path = cache_root() / "models" / "gguf-index" / f"{source.stem}-{file_key(source)}.json"
    if path.is_file():
        return [TensorEntry(e["name"], e["kind"], tuple(e["shape"]), e["offset"], e["nbytes"])
                for e in json.loads(path.read_text())]
    entries = [TensorEntry(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape),
                           int(t.data_offset), int(t.n_bytes))
               for t in gguf.GGUFReader(str(source)).tensors]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(e) for e in entries]))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the whole table or none
    return entries


def gguf_quant_tensor(entry: TensorEntry, file: np.ndarray) -> QuantTensor:
    """One GGUF matrix as a ``QuantTensor`` (copied out of the file's memory map)."""
    raw = file[entry.offset:entry.offset + entry.nbytes]
    in_features = entry.shape[0]
    if entry.kind in GGUF_FORMATS:
        fmt = GGUF_FORMATS[entry.kind]
        data = torch.from_numpy(np.array(raw).reshape(-1, fmt.row_bytes(in_features)))
        return QuantTensor(fmt, data, in_features)
    if entry.kind in DENSE_TYPES:
        return QuantTensor(None, _dense(entry, raw).reshape(-1, in_features), in_features)
    raise ValueError(f"GGUF tensor {entry.name!r} is {entry.kind}; twinserve runs "
                     f"{', '.join([*GGUF_FORMATS, *DENSE_TYPES])} tensors.")


def _dense(entry: TensorEntry, raw: np.ndarray) -> torch.Tensor:
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[entry.kind]
    return torch.from_numpy(np.array(raw)).view(dtype).float()


def load_gguf_model(gguf_file: Path, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device, max_positions: int,
                    kernels: KernelSettings) -> QuantizedCausalLM:
    entries = tensor_index(gguf_file)
    file = np.memmap(gguf_file, dtype=np.uint8, mode="r")
    model = QuantizedCausalLM(config, max_positions, dtype, device, kernels)
    heads = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads}
    targets = config.arch.weight_map(config)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for tensor in entries:
        name = hf_name(tensor.name)
        if name == "model.embed_tokens.weight":
            model.set_embedding(gguf_quant_tensor(tensor, file))
            continue
        if name == "lm_head.weight":
            model.set_lm_head(gguf_quant_tensor(tensor, file))
            continue
        if name not in targets:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({name}) is not in the "
                             f"{config.architecture} weight map.")
        target = targets[name]
        module_name, _, _ = target.param.rpartition(".")
        owner = model.get_submodule(module_name)
        if isinstance(owner, LinearBase):
            part = gguf_quant_tensor(tensor, file)
            count = permuted_heads(tensor.name, heads)
            if count is not None:
                order = unpermute(np.arange(part.rows)[:, None], count)[:, 0]
                part = part.select_rows(torch.from_numpy(np.ascontiguousarray(order)))
            QuantizedLinearMethod.load_part(owner, part, target.shard_id)
        else:
            raw = file[tensor.offset:tensor.offset + tensor.nbytes]
            if tensor.kind not in DENSE_TYPES:
                raise ValueError(f"GGUF tensor {tensor.name!r} is {tensor.kind}; twinserve reads "
                                 f"norms as {', '.join(DENSE_TYPES)}.")
            params[target.param].data.copy_(_dense(tensor, raw).reshape(target.shape))
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
