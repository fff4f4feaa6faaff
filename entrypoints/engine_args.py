"""Engine arguments as command-line flags and ``--config`` files: built from
``core.engine_args.EngineArgs``, so every subcommand that builds an engine (real or simulated)
has the same flags, meaning the same thing.

``--config FILE.yaml`` works as in ``vllm serve --config``: its keys are the command's flag names
(dashes or underscores); flags given on the command line override the file; an unknown key or a
value of the wrong type is an error naming the key and the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from twinserve.core.engine_args import (
    EXECUTOR_BACKENDS,
    NOT_IMPLEMENTED,
    EngineArgs,
    check_not_implemented,
)
from twinserve.core.kernel_settings import CPU_ATTENTION_CHOICES, QUANT_ACTIVATION_CHOICES
from twinserve.core.quantization import check_kv_cache_dtype, check_quantization

_HELP: dict[str, str] = {
    "dtype": "auto, float32, bfloat16 or float16 (auto: the checkpoint's on CUDA; on a CPU "
             "bfloat16 only with native bf16, else float32)",
    "device": "auto (cuda when present), cpu or cuda; the twin's device is its hardware profile",
    "seed": "seed of the engine's sampler",
    "scheduling_policy": "fcfs, priority, fair, sjf, static, lora_affinity or a plugin",
    "policy_options": 'policy options as JSON, e.g. \'{"tenant_weights": {"gold": 2}}\'',
    "block_size": "tokens per KV block",
    "max_num_seqs": "most requests in one step (default: vLLM's for the device and usage)",
    "max_num_batched_tokens": "token budget of one step (default: vLLM's for the device and usage)",
    "max_model_len": "longest prompt + output (default and limit: the model's)",
    "enable_chunked_prefill": "split long prompts across steps",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "prefill_first": "vLLM v0's scheduler (with --no-enable-chunked-prefill): steps that admit "
                     "prompts run only prefills, decodes wait for the others",
    "long_prefill_token_threshold": "cap on one request's prefill chunk (0: none)",
    "preemption_mode": "recompute or swap",
    "gpu_memory_utilization": "share of device memory the engine may use",
    "kv_cache_memory_bytes": "bytes of KV cache (default: on a CPU 2 GiB; on a GPU what "
                             "gpu_memory_utilization leaves)",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "kv_offloading_size": "GiB of host memory for a KV tier below the device cache (vLLM's "
                          "OffloadingConnector): evicted prefixes and preempted requests "
                          "reload from it instead of recomputing",
    "kv_offloading_backend": "the host KV tier's implementation: native (vLLM's "
                             "OffloadingConnector; lmcache is not implemented)",
    "num_gpu_blocks_override": "number of KV blocks, instead of sizing them from memory",
    "max_waiting_requests": "requests queued beyond the running batch's free seats, past which "
                            "new ones are refused (server: 4 x max_num_seqs; offline: unbounded)",
    "max_waiting_tokens": "prompt tokens queued, not yet admitted, beyond which new requests are "
                          "refused (server: 4 x the KV cache's tokens; offline: unbounded)",
    "tensor_parallel_size": "devices one replica is sharded over (on a CPU: processes, the "
                            "cores split between them)",
    "pipeline_parallel_size": "stages the model's layers are split into, one batch in flight per "
                              "stage (world = tp x pp processes)",
    "pp_layer_partition": "layers per pipeline stage, comma-separated, first stage first, e.g. "
                          "19,11 (vLLM's VLLM_PP_LAYER_PARTITION; default: the even split)",
    "distributed_executor_backend": "tensor and pipeline parallelism's workers: mp (local processes) or ray "
                                    "(Ray actors) (default: mp)",
    "data_parallel_size": "engine replicas (processes, each with its share of the cores on a "
                          "CPU, one GPU each on CUDA) behind one front that routes each request",
    "data_parallel_backend": "the replicas: mp (local processes) or ray (Ray actors)",
    "restart_dead_replicas": "restart a replica that died (its in-flight requests end with an "
                             "error either way)",
    "router": "how the front picks a replica for each request (a name of twinserve.routers)",
    "enforce_eager": "no CUDA graphs",
    "disable_sliding_window": "serve a sliding-window model as full attention, max_model_len "
                              "capped to its window (vLLM's)",
    "disable_hybrid_kv_cache_manager": "a model mixing sliding-window and full layers (Gemma "
                                       "2/3) keeps every block in every layer instead of "
                                       "freeing its sliding layers' (vLLM's)",
    "quantization": "weights: gguf (a .gguf model, run as it is), int8 or fp8 (weight-only, "
                    "quantized at load), gptq or awq (4-bit checkpoints; named by their "
                    "config.json)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (e4m3, one byte per value: twice the "
                      "tokens in the same memory)",
    "enable_lora": "serve LoRA adapters (PEFT format) beside the base model",
    "max_loras": "most distinct LoRA adapters in one step (device slots; default 1)",
    "max_lora_rank": "largest LoRA rank an adapter may have (default 16)",
    "max_cpu_loras": "LoRA adapters kept in host memory (default: max_loras)",
    "cpu_attention": "decode attention on a CPU: native (the compiled paged kernel) or torch "
                     "(the plain-torch path)",
    "fused_decode": "a quantized Llama-family model's decode step as one C++ call where it "
                    "applies (off: the per-op path)",
    "fused_packed": "the fused decode step streams Q4_0/Q4_1 weights repacked into 8-row "
                    "groups (off: the file's rows)",
    "quant_activations": "activations of the Q8_0/Q4_0/Q4_1 products: int8 (integer dot "
                         "products, as llama.cpp) or fp32 (the exact reference)",
    "speculative_config": 'speculative decoding as JSON (vLLM\'s keys), e.g. \'{"method": '
                          '"ngram", "num_speculative_tokens": 4, "policy": "adaptive"}\'',
    "kv_transfer_config": 'a KV connector as JSON (vLLM\'s keys), e.g. \'{"kv_connector": '
                          '"PeerConnector", "kv_role": "kv_producer"}\'',
}
# string arguments with a fixed set of values: argparse (and --config) refuse others by flag name
_CHOICES: dict[str, tuple[str, ...]] = {"cpu_attention": CPU_ATTENTION_CHOICES,
                                        "quant_activations": QUANT_ACTIVATION_CHOICES,
                                        "data_parallel_backend": EXECUTOR_BACKENDS}
_SHORT = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",),
          "scheduling_policy": ("--policy",)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds a flag per ``EngineArgs`` field but ``model`` (each command words its own), plus
    ``--config``. A flag the parser already has (``--max-model-len`` of the workload flags, which
    clips the trace to it; a workload's ``--seed``) is left to it: one flag then serves both, or
    the engine keeps its default."""
    g = parser.add_argument_group("engine (vLLM's names; also keys of --config)")
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="engine (and command) arguments from a YAML file; flags override it")
    dests: list[str] = []
    defaults = EngineArgs()
    for name in EngineArgs.field_names():
        flag = "--" + name.replace("_", "-")
        if name == "model" or flag in parser._option_string_actions:
            if name == "max_model_len":
                dests.append(name)
            continue
        dests.append(name)
        flags = (flag, *_SHORT.get(name, ()))
        default = getattr(defaults, name)
        help_ = _HELP[name]
        if "default" not in help_:  # (where the text states its default, once is enough)
            help_ += f" (default: {default if default is not None else 'resolved'})"
        if isinstance(default, bool):
            g.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                           default=None, help=help_)
        elif name == "policy_options":
            g.add_argument(*flags, dest=name, type=json.loads, default=None, help=help_)
        elif name in ("speculative_config", "kv_transfer_config"):
            g.add_argument(*flags, dest=name, type=_speculative_config, default=None, help=help_)
        else:
            kind = _field_type(name)
            g.add_argument(*flags, dest=name, type=kind, default=None, help=help_,
                           choices=_CHOICES.get(name))
    for name in NOT_IMPLEMENTED:  # refused by name, not as an unknown flag
        flag = "--" + name.replace("_", "-")
        if flag not in parser._option_string_actions:
            g.add_argument(flag, dest=f"_unimplemented_{name}", nargs="?", const=True,
                           default=None, help=argparse.SUPPRESS)
    parser.set_defaults(_engine_dests=tuple(dests))


def add_pool_args(group: Any) -> None:
    """``--prefill-args JSON`` and ``--decode-args JSON`` (also ``prefill_args:`` and
    ``decode_args:`` mappings in a ``--config`` file): each pool's engine-argument overrides in
    a disaggregated deployment, checked by ``core/pool_args.py``."""
    for pool in ("prefill", "decode"):
        group.add_argument(f"--{pool}-args", dest=f"{pool}_args", type=_speculative_config,
                           default=None, metavar="JSON",
                           help=f"engine arguments of the {pool} pool only, as JSON with "
                                '--config\'s keys, e.g. \'{"max_num_seqs": 8}\' (model, dtype, '
                                "block_size and kv_cache_dtype are the deployment's)")


def _speculative_config(text: str) -> str:
    """``--speculative-config JSON``: kept as text for ``EngineArgs``, whose ValueError names the
    bad key (argparse would only say "invalid value"); a ``--config`` file's mapping passes as
    it is."""
    return text


def _field_type(name: str) -> type:
    value = {"dtype": str, "device": str, "scheduling_policy": str, "preemption_mode": str,
             "distributed_executor_backend": str, "quantization": str, "kv_cache_dtype": str,
             "cpu_attention": str, "quant_activations": str, "data_parallel_backend": str,
             "router": str, "pp_layer_partition": str,
             "kv_offloading_backend": str,
             "gpu_memory_utilization": float, "swap_space": float, "kv_offloading_size": float}
    return value.get(name, int)


def engine_args_from(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """``EngineArgs`` from the flags the user set (others keep the defaults); ``overrides``
    (e.g. ``model``) win. Raises ValueError naming a flag twinserve does not implement."""
    for key, value in vars(args).items():
        if key.startswith("_unimplemented_") and value is not None:
            check_not_implemented(key.removeprefix("_unimplemented_"), value,
                                  "command line")
    dests = getattr(args, "_engine_dests", ())
    given = {k: getattr(args, k) for k in dests if getattr(args, k, None) is not None}
    if given.get("policy_options") is not None and not isinstance(given["policy_options"], dict):
        raise ValueError("--policy-options must be a JSON object.")
    return EngineArgs.from_mapping(given, "command line", **overrides)


# ---- --config FILE.yaml -------------------------------------------------------------------
def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parses ``argv`` with the keys of ``--config FILE`` (if given) as defaults, so that flags
    on the command line override the file. Keys are ``parser``'s flag names."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    parser.set_defaults(**config_file_defaults(parser, Path(path)))
    return parser.parse_args(argv)


def config_file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """``{dest: value}`` for each key of the YAML file, checked against ``parser``'s flags."""
    import yaml
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a mapping of argument names to values.")
    actions = {a.option_strings[0].lstrip("-").replace("-", "_"): a for a in parser._actions
               if a.option_strings and a.help is not argparse.SUPPRESS}
    actions.update({a.dest: a for a in parser._actions if a.option_strings
                    and a.help is not argparse.SUPPRESS})
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        check_not_implemented(key, value, str(path))
        action = actions.get(key)
        if action is None or key in ("config", "help"):
            valid = sorted(k for k in actions if k not in ("config", "help"))
            raise ValueError(f"{path}: unknown key {raw_key!r} for this command; valid keys: "
                             f"{', '.join(valid)}.")
        out[action.dest] = _config_value(action, value, f"{path}: key {raw_key!r}")
        if key in _VALUE_CHECKS and isinstance(value, str):  # named with the file
            try:
                _VALUE_CHECKS[key](value)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
    return out


_VALUE_CHECKS = {"quantization": check_quantization, "kv_cache_dtype": check_kv_cache_dtype}


def _config_value(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                           argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}.")
        if isinstance(action, argparse._StoreFalseAction):
            return not value
        return value
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, v, where) for v in items]
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type
    if kind is json.loads:
        return value if not isinstance(value, str) else json.loads(value)
    if isinstance(value, bool) and kind in (int, float):
        raise ValueError(f"{where} must be a number, got {value!r}.")
    if kind in (int, float, str):
        if kind is int and not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}.")
        if kind is float and not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}.")
        if kind is str and not isinstance(value, (str, int, float)):
            raise ValueError(f"{where} must be a string, got {value!r}.")
        value = kind(value)
    elif callable(kind) and isinstance(value, str):
        try:
            value = kind(value)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} must be one of {', '.join(map(str, action.choices))}, "
                         f"got {value!r}.")
    return value
