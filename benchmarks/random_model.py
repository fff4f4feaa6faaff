"""An HF model directory with random weights, shaped like a bundled architecture (for benchmarks on
hardware that can hold a model we do not ship, such as Llama-3-8B on a GPU).

    python -m twinserve.benchmarks.random_model --config llama-3-8b --out /tmp/llama-3-8b-random \\
        [--dtype bfloat16] [--num-layers N] [--device cuda]

Writes ``config.json`` (the bundled config of ``simulator/data/models``, or any HF ``config.json``
path) and one safetensors shard per decoder layer with ``model.safetensors.index.json``: the
layout ``gpu/models/weights.py`` loads. Weights are N(0, 0.02) (norms 1), drawn on ``--device`` (a GPU
draws 8B parameters in seconds) and written from host memory one layer at a time. No tokenizer:
prompts are token ids. The directory is reused when its config and shards are already there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from twinserve.core.hf_config import read_hf_config
from twinserve.core.model_config import ModelConfig

BUNDLED = Path(__file__).resolve().parent.parent / "simulator" / "data" / "models"
INDEX = "model.safetensors.index.json"


def bundled_config(name_or_path: str) -> dict:
    """A bundled architecture by name (``llama-3-8b``) or an HF ``config.json`` path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = BUNDLED / f"{name_or_path}.json"
    if not path.is_file():
        names = sorted(p.stem for p in BUNDLED.glob("*.json"))
        raise ValueError(f"config {name_or_path!r} is neither a file nor a bundled model; "
                         f"bundled: {', '.join(names)}.")
    return read_hf_config(path)


def layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of decoder layer ``layer`` (the architecture's weight map)."""
    prefix = f"model.layers.{layer}."
    return {name: t.shape for name, t in config.arch.weight_map(config).items()
            if name.startswith(prefix)}


def outer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The embedding, the final norm and an untied LM head."""
    return {name: t.shape for name, t in config.arch.weight_map(config).items()
            if not name.startswith("model.layers.")}


def _draw(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str,
          gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        out[name] = t.cpu()
    return out


def write_random_model(out: str | Path, config: str = "llama-3-8b", dtype: str = "bfloat16",
                       num_layers: int | None = None, device: str = "cpu", seed: int = 0) -> Path:
    """Writes (or reuses) the directory; returns its path."""
    out = Path(out)
    cfg = dict(bundled_config(config))
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
        cfg["num_hidden_layers"] = num_layers
    cfg["torch_dtype"] = dtype
    if (out / INDEX).is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    model = ModelConfig.from_hf_dict(cfg, out.name or "model")
    parts = [outer_shapes(model)] + [layer_shapes(model, i) for i in range(model.num_hidden_layers)]
    for k, shapes in enumerate(parts):
        shard = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        save_file(_draw(shapes, torch_dtype, device, gen), out / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shapes, shard))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-3-8b",
                    help="bundled model name or an HF config.json path")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        path = write_random_model(args.out, args.config, args.dtype, args.num_layers, args.device,
                                  args.seed)
    except ValueError as exc:
        ap.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
