"""``twinserve plan``: the deployment that meets the SLOs at the least cost (``twinserve.planner``),
from flags or a spec file (``--spec plan.yaml``, the same keys; flags given override it), and
``--verify-top K``: the top configurations this machine can run, replayed on the real engine at
their predicted capacity and one step above it (``plan_verify``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

LIST_FLAGS = {"tp": ("space", "tensor_parallel_size", int), "pp": ("space", "pipeline_parallel_size", int),
              "replicas": ("space", "replicas", int), "routers": ("space", "router", str),
              "max_num_seqs": ("space", "max_num_seqs", int),
              "max_num_batched_tokens": ("space", "max_num_batched_tokens", int),
              "chunked_prefill": ("space", "enable_chunked_prefill", "onoff"),
              "policies": ("space", "scheduling_policy", str),
              "speculation": ("space", "speculation", str), "quantization": ("space", "quantization", str),
              "disaggregation": ("space", "disaggregation", str),
              "kv_link": ("space", "kv_link", str),
              **{name: ("space", name, "optint") for name in (
                  "prefill_max_num_seqs", "prefill_max_num_batched_tokens", "decode_max_num_seqs",
                  "decode_max_num_batched_tokens")}}
# the multi-application workload's settings (planner.spec.MULTI_APP_KEYS)
MULTI_APP_FLAGS = (("num_apps", int), ("zipf_s", float), ("system_len_min", int),
                   ("system_len_max", int), ("input_len", int), ("output_len", int),
                   ("range_ratio", float), ("seed", int))
SEARCH_FLAGS = ("tolerance", "base_rps", "min_rps", "max_rps", "dominance_slack", "acceptance_profile")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None, metavar="FILE", help="plan spec (.yaml or .toml); flags override")
    p.add_argument("--trace", default=None, help="bundled trace name or file (default azure-conv)")
    p.add_argument("--num-requests", type=int, default=None, help="the trace's first N requests")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="seconds of arrivals per replay, whatever its rate (default 120)")
    multi = p.add_argument_group("--trace multi-app (applications with their own system "
                                 "prompts, Zipf popularity)")
    for flag, kind in MULTI_APP_FLAGS:
        multi.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None)
    p.add_argument("--model", default=None, help="bundled model name or config.json")
    p.add_argument("--hardware", default=None, help="comma-separated profiles, e.g. a100-80gb,h100-sxm,h200")
    p.add_argument("--max-gpus", type=int, default=None, help="most GPUs a deployment may use")
    p.add_argument("--slo", action="append", default=None, metavar="KEY=MS",
                   help="e.g. ttft_p90_ms=2000 (repeat); keys <metric>[_p<pct>]_ms, metric ttft/tpot/e2el")
    p.add_argument("--attainment", type=float, default=None,
                   help="fraction of requests for SLO keys without a percentile (default 0.9)")
    p.add_argument("--price", action="append", default=None, metavar="HW=DOLLARS",
                   help="$ per GPU-hour over the bundled table (repeat)")
    axes = p.add_argument_group("space (comma-separated values; defaults: planner.space.PlanSpace)")
    for flag in LIST_FLAGS:
        pool = flag.split("_")[0] if flag.startswith(("prefill_", "decode_")) else None
        axes.add_argument(f"--{flag.replace('_', '-')}", default=None, metavar="V,V",
                          help=f"the {pool} pool's own value in xPyD deployments (none: the "
                               "deployment's)" if pool else None)
    axes.add_argument("--max-pd-instances", type=int, default=None, metavar="N",
                      help="adds every xPyD deployment with x + y <= N to --disaggregation")
    search = p.add_argument_group("search")
    for flag in SEARCH_FLAGS:
        if flag == "acceptance_profile":
            search.add_argument("--acceptance-profile", default=None, nargs="+", metavar="FILE",
                                help="measured acceptance profiles of the speculation axis "
                                     "(merged where several)")
        else:
            search.add_argument(f"--{flag.replace('_', '-')}", default=None, type=float)
    search.add_argument("--no-early-stop", action="store_true", help="replay every rate to its end")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--workers", type=int, default=None, help="local processes (default: cores)")
    p.add_argument("--ray-address", default=None, help="run the replays on this Ray cluster")
    p.add_argument("--resume", action="store_true", help="reuse the replays a previous run left in --out")
    p.add_argument("--top", type=int, default=10, help="rows of the printed ranking")
    p.add_argument("--verify-top", type=int, default=0, metavar="K",
                   help="replay the top K this machine can run on the real engine (xPyD too), "
                        "at capacity and one step above")


def plan_mapping(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The plan's mapping: the spec file's, with the flags given on top; and its source name."""
    from twinserve.planner.spec import load_plan_file
    data: dict[str, Any] = load_plan_file(args.spec) if args.spec else {}
    source = str(args.spec) if args.spec else "command line"
    for key in ("model", "max_gpus", "attainment"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if args.hardware is not None:
        data["hardware"] = args.hardware.split(",")
    workload = dict(data.get("workload") or {})
    if args.trace is not None:
        workload["trace"] = args.trace
    if args.num_requests is not None:
        workload["num_requests"] = args.num_requests
    if args.duration is not None:
        workload["duration_s"] = args.duration
    for flag, _ in MULTI_APP_FLAGS:
        if getattr(args, flag) is not None:
            workload[flag] = getattr(args, flag)
    data["workload"] = workload
    if args.slo:
        from twinserve.planner.slo import parse_slo_flag
        attainment = float(data.get("attainment", 0.9))
        data["slo"] = {s.key: s.limit_ms for s in (parse_slo_flag(t, attainment) for t in args.slo)}
    if args.price:
        from twinserve.planner.prices import parse_price_flag
        data["prices"] = {**(data.get("prices") or {}), **dict(map(parse_price_flag, args.price))}
    _overlay_lists(args, data)
    if args.max_pd_instances is not None:
        data["space"] = {**(data.get("space") or {}), "max_pd_instances": args.max_pd_instances}
    return data, source


def _overlay_lists(args: argparse.Namespace, data: dict[str, Any]) -> None:
    for flag, (section, key, kind) in LIST_FLAGS.items():
        text = getattr(args, flag)
        if text is not None:
            data.setdefault(section, {})
            data[section] = {**data[section], key: [_value(flag, v.strip(), kind) for v in text.split(",")]}
    search = dict(data.get("search") or {})
    search.update({k: getattr(args, k) for k in SEARCH_FLAGS if getattr(args, k) is not None})
    if args.no_early_stop:
        search["early_stop"] = False
    data["search"] = search


def _value(flag: str, text: str, kind: Any) -> Any:
    if kind == "onoff":
        if text not in ("on", "off"):
            raise ValueError(f"--{flag.replace('_', '-')}: expected on or off, got {text!r}.")
        return text == "on"
    if kind == "optint":  # a pool's limit; none: the deployment's own
        return None if text == "none" else _value(flag, text, int)
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"--{flag.replace('_', '-')}: expected {kind.__name__} values, "
                         f"got {text!r}.") from None


def run_plan_cli(args: argparse.Namespace) -> int:
    from twinserve.planner.output import front_table, top_table, write_outputs
    from twinserve.planner.plan import run_plan
    from twinserve.planner.report import write_report
    from twinserve.planner.spec import parse_plan
    spec = parse_plan(*plan_mapping(args))
    out = Path(args.out)
    result = run_plan(spec, out, backend="ray" if args.ray_address else "local", workers=args.workers,
                      address=args.ray_address, resume=args.resume, log=print)
    paths = write_outputs(result, spec, out)
    settings = (f"{spec.space.model} on {', '.join(spec.space.hardware)}, up to {spec.space.max_gpus} "
                f"GPUs; SLOs {', '.join(f'{s.key}={s.limit_ms:g}' for s in spec.slos)}; trace "
                f"{spec.trace} ({result.stats['requests_per_replay']} requests); prices: "
                f"{spec.prices.source}")
    write_report(result, front_table(result), out / "plan.html", "twinserve plan", settings)
    print(top_table(result, args.top))
    print(", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in result.stats.items()))
    print(f"written: {', '.join(str(p) for p in paths.values())}, {out / 'plan.html'}")
    if args.verify_top:
        from twinserve.entrypoints.cli.plan_verify import verify_top
        verify_top(result, spec, out, args.verify_top)
    return 0
