"""The workload flags every replaying entry point adds (``--trace``, ``--num-requests``, ...,
``--loras``): argument definitions only, importing nothing heavy, so a command's ``--help``
starts fast. ``traces.cli_args`` applies them."""

from __future__ import annotations

import argparse

from twinserve.traces.bundled import BUNDLED_TRACES

SYNTHETIC = "synthetic"
# Flags only a synthetic workload takes; each destination is the SyntheticConfig field of that name.
SYNTHETIC_FLAGS = ("request_rate", "burstiness", "input_len", "output_len", "range_ratio", "prefix_len",
                   "prefix_share")
MULTI_APP = "multi-app"
# Flags the multi-application workload takes; each destination is the MultiAppConfig field of that
# name (the first four it shares with the synthetic workload).
MULTI_APP_FLAGS = ("request_rate", "input_len", "output_len", "range_ratio", "num_apps", "zipf_s",
                   "system_len_min", "system_len_max")


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """Adds the workload flags (see the module docstring for the order they apply in)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--trace", default="azure-conv",
                   help=f"{', '.join(BUNDLED_TRACES)}, {SYNTHETIC}, {MULTI_APP} (applications with "
                        f"their own system prompts), or a .csv/.jsonl trace file")
    g.add_argument("--num-requests", type=int, help="first N requests (synthetic: how many; default 1000)")
    g.add_argument("--time-window", metavar="START:END", help="keep arrivals in [START, END) seconds")
    g.add_argument("--time-scale", type=float, help="replay K times as fast (arrivals / K)")
    g.add_argument("--request-rate", type=float, help="synthetic: requests/s (default inf: all at t=0)")
    g.add_argument("--burstiness", type=float, help="synthetic: gamma shape of the gaps (1 = Poisson)")
    g.add_argument("--input-len", type=int, help="synthetic: prompt tokens besides the prefix")
    g.add_argument("--output-len", type=int, help="synthetic: output tokens")
    g.add_argument("--range-ratio", type=float, help="synthetic: lengths uniform in len*(1 +- r)")
    g.add_argument("--prefix-len", type=int, help="synthetic: shared system-prompt tokens")
    g.add_argument("--prefix-share", type=float, help="synthetic: fraction of requests sharing it")
    g.add_argument("--num-apps", type=int, help="multi-app: applications (default 24)")
    g.add_argument("--zipf-s", type=float, help="multi-app: Zipf exponent of their popularity (default 1)")
    g.add_argument("--system-len-min", type=int, help="multi-app: shortest system prompt (default 256)")
    g.add_argument("--system-len-max", type=int, help="multi-app: longest system prompt (default 2048)")
    g.add_argument("--tenants", metavar="NAME=W,...", help="assign tenants with these weights")
    g.add_argument("--priorities", metavar="PRIO=W,...", help="assign priorities with these weights")
    g.add_argument("--max-model-len", type=int, help="clip prompt+output to fit (see clip_lengths)")
    g.add_argument("--max-output-tokens", type=int,
                   help="cap every output length (clip_lengths), to bound a replay's runtime")
    g.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """Adds ``--loras``, ``--lora-rank`` and ``--lora-target-modules`` (the simulated adapters)."""
    g = parser.add_argument_group("LoRA adapters (serve them with --enable-lora --max-loras N)")
    g.add_argument("--loras", metavar="NAME=W[:RANK],...|N",
                   help="assign adapters with these weights (N: lora0..lora{N-1}, equal weights; "
                        "base=W: share without adapter); a trace's lora column is kept otherwise")
    g.add_argument("--lora-rank", type=int, default=None,
                   help="rank of every simulated adapter without its own (default: max_lora_rank)")
    g.add_argument("--lora-target-modules", default=None, metavar="all|q_proj,v_proj,...",
                   help="PEFT modules the adapters adapt (default all: q,k,v,o,gate,up,down_proj)")
