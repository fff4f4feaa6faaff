"""Engine knobs as command-line flags, under vLLM's names, shared by every subcommand that builds
an engine (real or simulated), so the same flags mean the same thing everywhere."""

from __future__ import annotations

import argparse
import json
from typing import Any

# flag -> (field, type, help); a knob both backends understand.
_SHARED: dict[str, tuple[str, type, str]] = {
    "--scheduling-policy": ("scheduling_policy", str, "fcfs, priority, fair, sjf, static or a plugin"),
    "--block-size": ("block_size", int, "tokens per KV block"),
    "--max-num-seqs": ("max_num_seqs", int, "most requests in one step"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "token budget of one step"),
    "--max-model-len": ("max_model_len", int, "longest prompt + output"),
    "--long-prefill-token-threshold": ("long_prefill_token_threshold", int,
                                       "cap on one request's prefill chunk (0: none)"),
    "--preemption-mode": ("preemption_mode", str, "recompute or swap"),
    "--swap-space": ("swap_space", float, "GiB of host memory for swapped KV blocks"),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float, "share of device memory used"),
}


def add_engine_args(parser: argparse.ArgumentParser, simulated: bool, with_seed: bool = True) -> None:
    g = parser.add_argument_group("engine (vLLM's names)")
    for flag, (dest, typ, help_) in _SHARED.items():
        # --max-model-len may already be there from the workload flags (which clip the trace
        # to it): one flag then serves both.
        if flag not in parser._option_string_actions:
            g.add_argument(flag, dest=dest, type=typ, help=help_, default=None)
    g.add_argument("--policy", dest="scheduling_policy", help="alias of --scheduling-policy")
    g.add_argument("--policy-options", type=json.loads, default=None,
                   help='policy options as JSON, e.g. \'{"tenant_weights": {"gold": 2}}\'')
    for name, help_ in (("prefix-caching", "prefix caching"), ("chunked-prefill", "chunked prefill")):
        dest = "enable_" + name.replace("-", "_")
        g.add_argument(f"--enable-{name}", dest=dest, action="store_true", default=None,
                       help=f"turn {help_} on (default on)")
        g.add_argument(f"--no-enable-{name}", dest=dest, action="store_false",
                       help=f"turn {help_} off")
    if simulated:
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
        g.add_argument("--num-gpu-blocks-override", dest="num_gpu_blocks", type=int, default=None)
        g.add_argument("--num-replicas", type=int, default=None)
        g.add_argument("--router", default=None,
                       help="round-robin, least-outstanding or prefix-affinity")
    else:
        g.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
        g.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
        g.add_argument("--kv-cache-memory", type=int, default=None,
                       help="bytes of KV cache on CPU (default 2 GiB)")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument("--enforce-eager", action="store_true", default=None)
        if with_seed:
            g.add_argument("--seed", type=int, default=None)


def engine_kwargs(args: argparse.Namespace, fields: set[str]) -> dict[str, Any]:
    """The knobs the user set, restricted to ``fields`` (those of EngineArgs or SimConfig)."""
    out = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if getattr(args, "policy_options", None) is not None:
        if not isinstance(args.policy_options, dict):
            raise ValueError("--policy-options must be a JSON object.")
        out["policy_options"] = args.policy_options
    return out
