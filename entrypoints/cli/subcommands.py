"""Subcommands whose flags live beside their implementation (serve, bench, sweep, ...)."""

from __future__ import annotations

import argparse


def bench(sub) -> None:
    from twinserve.entrypoints.cli.bench_serve import add_bench_serve_args, run_bench_serve
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser("serve", help="replay a trace against an OpenAI-compatible server",
                         description="Replay a trace or synthetic workload against any "
                         "OpenAI-compatible server (twinserve or vLLM); writes a run folder.")
    add_bench_serve_args(p)

    def handler(args: argparse.Namespace) -> int:
        run_bench_serve(args)
        return 0
    p.set_defaults(handler=handler)


def demo(sub) -> None:
    from twinserve.entrypoints.cli.demo import add_parser
    add_parser(sub)


def sweep(sub) -> None:
    from twinserve.entrypoints.cli.sweep import add_sweep_args, run_sweep_cli
    p = sub.add_parser("sweep", help="grid of simulations (local processes or Ray), capacity, report",
                       description="Run a grid of simulations described by a TOML spec.")
    add_sweep_args(p)
    p.set_defaults(handler=run_sweep_cli)


def plan(sub) -> None:
    from twinserve.entrypoints.cli.plan import add_plan_args, run_plan_cli
    p = sub.add_parser("plan", help="the deployment meeting the SLOs at the least cost (twin search)",
                       description="Search hardware, parallelism, replicas, routers and engine "
                       "settings on the twin for the cheapest deployment meeting the SLOs.")
    add_plan_args(p)
    p.set_defaults(handler=run_plan_cli)


def serve(sub) -> None:
    from twinserve.entrypoints.openai.server import add_serve_args, run_server
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the real engine",
                       description="Serve the model over an OpenAI-compatible HTTP API "
                       "(binds 127.0.0.1 unless --host is given).")
    add_serve_args(p)

    def handler(args: argparse.Namespace) -> int:
        run_server(args)
        return 0
    p.set_defaults(handler=handler)


def pd_proxy(sub) -> None:
    from twinserve.entrypoints.pd_proxy import add_proxy_args, run_proxy
    p = sub.add_parser("pd-proxy", help="a prefill/decode proxy over separately started instances",
                       description="vLLM's disaggregated-serving proxy: each request's prefill on "
                       "a kv_producer instance, its decode on a kv_consumer instance "
                       "(docs/disaggregation.md).")
    add_proxy_args(p)

    def handler(args: argparse.Namespace) -> int:
        run_proxy(args)
        return 0
    p.set_defaults(handler=handler)


def calibrate(sub) -> None:
    from twinserve.entrypoints.cli.calibrate import add_parser
    add_parser(sub)


def validate(sub) -> None:
    from twinserve.entrypoints.cli.validate import add_parser
    add_parser(sub)

