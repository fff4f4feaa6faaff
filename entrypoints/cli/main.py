"""The ``twinserve`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinserve.core.engine_config import USAGE_CONTEXTS
from twinserve.entrypoints.engine_args import (
    add_engine_args,
    add_pool_args,
    config_file_defaults,
    engine_args_from,
)

if TYPE_CHECKING:
    from twinserve.simulator import SimConfig


def _simulate_parser(sub) -> None:
    from twinserve.traces import add_lora_args, add_trace_args
    p = sub.add_parser("simulate", help="replay a trace through the simulated engine",
                       description="Replay a trace through the SimPy twin of the engine. By "
                       "default Llama-3-8B on an A100-80GB, whose step times are fitted to "
                       "Vidur's measurements; a model or GPU without a measured fit runs on the "
                       "roofline, and the run says how far rooflines fell short where measured.")
    add_trace_args(p)
    add_lora_args(p)
    p.add_argument("--model", default=None,
                   help="bundled model name, config.json or model directory (default "
                   "llama-3-8b)")
    # the defaults are simulator.run's, written out: importing the simulator here would load
    # simpy and numpy for --help (tests/simulator/test_roofline_gap.py keeps them equal)
    p.add_argument("--hardware", default=None,
                   help="bundled profile name or JSON path (default a100-80gb: "
                   "fitted to measured steps of Llama-3-8B at TP 1-8; h100-sxm and most other "
                   "pairs run on the roofline, saying so)")
    p.add_argument("--usage-context", default=None, choices=USAGE_CONTEXTS,
                   help="whose defaults apply: server (default: a trace replay is a server's "
                        "workload) or llm (offline batches)")
    p.add_argument("--num-replicas", type=int, default=None, help="engines behind a router")
    p.add_argument("--router", default=None,
                   help="round-robin, least-outstanding, prefix-affinity, cache-aware or a plugin's")
    p.add_argument("--prefill-instances", type=int, default=None, metavar="X",
                   help="disaggregated prefill/decode: X prefill instances (with "
                        "--decode-instances; docs/disaggregation.md)")
    p.add_argument("--decode-instances", type=int, default=None, metavar="Y",
                   help="disaggregated prefill/decode: Y decode instances")
    p.add_argument("--kv-link", default=None,
                   help="the link KV moves over between instances: nvlink, infiniband, pcie or "
                        "measured (the profile's calibrated kv_link; default: measured if the "
                        "profile has it, else nvlink)")
    add_pool_args(p)
    add_engine_args(p)
    p.add_argument("--structured-fraction", type=float, default=0.0, metavar="F",
                   help="share of requests decoding under a grammar (JSON mode), charged the "
                        "profile's mask time (simulator/structured_cost.py); default 0")
    p.add_argument("--acceptance-profile", default=None, nargs="+", metavar="FILE",
                   help="with --speculative-config: the drafts' per-position acceptance measured "
                        "on real runs (JSON profiles that calibrate and validate write, merged "
                        "where several); default: the config's synthetic_acceptance_rate")
    p.add_argument("--label", default=None, help="name of the run in reports")
    p.add_argument("--out", default=None, help="run folder (default runs/sim-<policy>)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(handler=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from twinserve.simulator import SimConfig, simulate, write_sim_run
    from twinserve.simulator.run import DEFAULT_SIM_MODEL, PD_KEYS, SIM_KEYS
    from twinserve.traces import lora_adapters_from_args, trace_desc, trace_from_args
    sim = {k: getattr(args, k) for k in SIM_KEYS + PD_KEYS if getattr(args, k, None) is not None}
    engine = engine_args_from(args, model=args.model or DEFAULT_SIM_MODEL)
    if engine.data_parallel_size > 1:  # vLLM's name for the twin's replicas
        if sim.setdefault("num_replicas", engine.data_parallel_size) != engine.data_parallel_size:
            raise ValueError("--num-replicas and --data-parallel-size differ: give one of them.")
        engine = engine.replace(data_parallel_size=1)
    cfg = SimConfig(engine, **sim)
    trace = trace_from_args(args)
    lora = cfg.engine.lora_config()
    adapters = lora_adapters_from_args(args, lora.max_lora_rank) if lora is not None else None
    from twinserve.simulator.structured_cost import StructuredWorkload
    fraction = getattr(args, "structured_fraction", 0.0) or 0.0
    structured = StructuredWorkload(fraction, cfg.engine.seed or 0) if fraction else None
    acceptance = _acceptance_profile(args, cfg)
    result = simulate(cfg, trace, progress=not args.disable_tqdm, adapters=adapters,
                      structured=structured, acceptance=acceptance)
    out = Path(args.out or f"runs/sim-{cfg.scheduling_policy}")
    desc = trace_desc(args)
    if structured is not None:
        desc = {**desc, "structured_fraction": fraction}
    if acceptance is not None:
        desc = {**desc, "acceptance_profile": acceptance.to_dict()}
    write_sim_run(result, out, desc)
    _print_summary(result.summary, f"Simulation Result ({cfg.model} on {cfg.hardware}"
                                    f"{_deployment(cfg)}, {cfg.scheduling_policy})")
    print(f"step times: {result.cost_model}")
    if result.roofline_gap:
        print(result.roofline_gap)
    if result.kernel_mismatch:
        print(f"WARNING: the profile's fit does not match this run: {result.kernel_mismatch}",
              file=sys.stderr)
    print(f"simulated {len(trace)} requests in {result.wall_time_s:.2f} s wall; run folder: {out}")
    return 0


def _deployment(cfg: SimConfig) -> str:
    """What the run deploys beyond one engine on one device, for the summary's title: its
    parallelism, replicas behind a router, or prefill and decode pools (empty when none)."""
    engine, parts = cfg.engine, []
    if engine.tensor_parallel_size > 1:
        parts.append(f"TP={engine.tensor_parallel_size}")
    if engine.pipeline_parallel_size > 1:
        parts.append(f"PP={engine.pipeline_parallel_size}")
    if cfg.prefill_instances:
        parts.append(f"{cfg.prefill_instances}P{cfg.decode_instances}D")
    elif cfg.num_replicas > 1:
        parts.append(f"{cfg.num_replicas} replicas behind {cfg.router}")
    return "".join(f", {p}" for p in parts)


def _acceptance_profile(args: argparse.Namespace, cfg: Any) -> Any:
    """``--acceptance-profile``'s profile (None without the flag); refused without speculation."""
    paths = getattr(args, "acceptance_profile", None)
    if not paths:
        return None
    if cfg.engine.speculation is None:
        raise ValueError("--acceptance-profile needs --speculative-config (speculation is off).")
    from twinserve.simulator.acceptance_merge import load_profiles
    return load_profiles(paths)


def _print_summary(summary: dict, title: str) -> None:
    try:
        from twinserve.entrypoints.cli.result_printout import format_result
    except ImportError:
        print(json.dumps(summary, indent=2, default=str))
        return
    print(format_result(summary, title=title))


def _generate_parser(sub) -> None:
    for name in ("generate", "chat"):
        p = sub.add_parser(name, help=f"{name} with the real engine (default: bundled model)")
        p.add_argument("prompts", nargs="*", help="prompts (chat: user messages); stdin if none")
        p.add_argument("--model", default=None, help="HF model directory (default: bundled)")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--n", type=int, default=1)
        p.add_argument("--stop", action="append", default=None)
        p.add_argument("--sampling-seed", type=int, default=None)
        if name == "chat":
            p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                           help="the chat template (a jinja2 file, or the template itself) "
                                "used instead of the model's")
        add_engine_args(p)
        p.set_defaults(handler=_generate, chat=name == "chat")


def _generate(args: argparse.Namespace) -> int:
    from twinserve.core.sampling_params import SamplingParams
    from twinserve.entrypoints.llm import LLM
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt given (pass prompts as arguments or on stdin).")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, n=args.n, stop=args.stop or [],
                            seed=args.sampling_seed)
    llm = LLM.from_engine_args(engine_args_from(args, model=args.model))
    if args.chat:
        from twinserve.entrypoints.openai.chat_server_options import load_chat_template
        template = load_chat_template(args.chat_template)
        extra = {"chat_template": template} if template is not None else {}
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, **extra)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        for comp in out.outputs:
            print(f"### {prompt!r} [{comp.finish_reason}]\n{comp.text}\n")
    return 0


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="compare run folders in one HTML report")
    p.add_argument("runs", nargs="+", help="run folders (simulate, bench serve, validate)")
    p.add_argument("--out", default="report.html")
    p.add_argument("--title", default="twinserve run comparison")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    p.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from twinserve.entrypoints.cli.bench_serve import parse_goodput
    from twinserve.reports import write_report
    out = write_report(args.runs, Path(args.out), slos_ms=parse_goodput(args.goodput) or None,
                       title=args.title)
    print(f"report written: {out}")
    return 0


# Each command with its one-line help and the function that adds its full parser. Only the
# command being run gets its full parser (building serve's imports the real engine, torch
# included); the others are listed by name and help, so `twinserve --help` and the simulator's
# commands start without importing any backend.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("replay a trace through the simulated engine", "cli:_simulate_parser"),
    "generate": ("generate with the real engine (default: bundled model)", "cli:_generate_parser"),
    "chat": ("chat with the real engine (default: bundled model)", "cli:_generate_parser"),
    "report": ("compare run folders in one HTML report", "cli:_report_parser"),
    "bench": ("benchmarks against a running server", "subcommands:bench"),
    "demo": ("the main job: simulate policies, run the real engine, report", "subcommands:demo"),
    "sweep": ("grid of simulations (local processes or Ray), capacity, report",
              "subcommands:sweep"),
    "plan": ("the deployment meeting the SLOs at the least cost (twin search)", "subcommands:plan"),
    "serve": ("OpenAI-compatible HTTP server on the real engine", "subcommands:serve"),
    "pd-proxy": ("a prefill/decode proxy over separately started instances",
                 "subcommands:pd_proxy"),
    "calibrate": ("fit the simulator's step time to the real backend", "subcommands:calibrate"),
    "validate": ("replay a trace on the real engine and its twin; errors",
                 "subcommands:validate"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``twinserve`` parser: every command's full parser, or with ``only`` that command's
    full parser and the others' names and help."""
    parser = argparse.ArgumentParser(prog="twinserve", description=(
        "LLM serving engine and its SimPy digital twin, sharing one scheduler."))
    sub = parser.add_subparsers(dest="command", required=True)
    full = COMMANDS if only is None else {k: v for k, v in COMMANDS.items() if k == only}
    for where in dict.fromkeys(where for _, where in full.values()):  # generate, chat: one
        _builder(where)(sub)
    for name, (help_, _) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def _builder(where: str) -> Callable[[Any], None]:
    module, name = where.split(":")
    if module == "cli":
        return globals()[name]
    from twinserve.entrypoints.cli import subcommands
    return getattr(subcommands, name)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses ``argv``; with ``--config FILE.yaml`` the file's keys become the subcommand's
    defaults and the command line is parsed again, so flags override the file."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        sub = _subparser(parser, args.command)
        sub.set_defaults(**config_file_defaults(sub, Path(args.config)))
        args = parser.parse_args(argv)
    return args


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def main(argv: list[str] | None = None) -> int:
    """The command line's entry point (``argv`` None: the program's own arguments)."""
    as_program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), "")
    if command in ONE_BLAS_THREAD:
        # before numpy loads OpenBLAS, which reads it once (a user's own setting is kept)
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    parser = build_parser(only=command)
    try:
        args = parse_args(parser, argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"twinserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        code = args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"twinserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if as_program and command in EXIT_WITHOUT_TEARDOWN:
        _exit_now(code)
    return code


# Commands of the twin alone, which does no BLAS work (its matrices are fits of a few columns):
# numpy's OpenBLAS would start a thread per core at import, ~0.05 s of CPU per command on this
# 2-core machine, a tenth of a 2,000-request `simulate` (benchmarks/sim_speed.py --cli).
ONE_BLAS_THREAD = ("simulate", "sweep")


# Commands that, run as the program, end as soon as their work is written: the interpreter's
# teardown would free every object of the replay one at a time (the scheduler's blocks and
# requests sit in reference cycles the replay never collects), ~0.1 s of a 2,000-request
# simulation. Called as a function (``main(argv)``, tests) they return as usual.
EXIT_WITHOUT_TEARDOWN = ("simulate",)


def _exit_now(code: int) -> None:
    """Flushes the logging handlers and the standard streams, then leaves the process with
    ``code`` at once (no atexit handlers: a simulation registers none of its own). Where a
    stream cannot be flushed (a closed pipe) it returns: the interpreter's own exit reports
    that, as without this."""
    import logging
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        return
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
