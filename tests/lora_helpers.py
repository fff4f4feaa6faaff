"""PEFT adapters with random weights for the LoRA tests, and HF + PEFT greedy references."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False


ADAPTERS = {
    "qv4": AdapterSpec(4, 8.0, ("q_proj", "v_proj")),
    "all8": AdapterSpec(8, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"), rslora=True),
    "mlp16": AdapterSpec(16, 32.0, ("o_proj", "gate_proj", "down_proj")),
}


def make_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec, seed: int,
                 scale: float = 0.3) -> Path:
    """Saves a PEFT LoRA of ``base_dir`` with every ``lora_`` tensor drawn at random (PEFT
    initialises B to zero, which would make the adapter a no-op)."""
    import peft
    import torch
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                             use_rslora=spec.rslora, lora_dropout=0.0, bias="none")
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the base model with ``adapter_dir`` applied by PEFT (fp32)."""
    import peft
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(input_ids=torch.tensor([prompt]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            for _ in range(max_new_tokens - 1):
                out = model(input_ids=torch.tensor([[tokens[-1]]]),
                            past_key_values=out.past_key_values, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs
