"""Scheduler overhead: one step through the step driver (``schedule`` + ``update_from_output``
and the driver's bookkeeping, step rows off) with N running decode requests and a long waiting
queue, prefix caching on. Target: <= 5 us per running request per step.

    python -m twinserve.benchmarks.scheduler_overhead [--running 256 1024] [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from twinserve.core import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig
from twinserve.core.step_driver import RunRecorder, StepDriver
from twinserve.policies import get_policy


def build(num_running: int, num_waiting: int, policy: str, prompt_len: int) -> StepDriver:
    block_size = 16
    blocks_per_req = (prompt_len + 4096) // block_size + 1
    config = SchedulerConfig(num_gpu_blocks=blocks_per_req * num_running + 64, block_size=block_size,
                             max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running),
                             max_model_len=prompt_len + 8192, enable_prefix_caching=True)
    driver = StepDriver(Scheduler(config, get_policy(policy)), RunRecorder(record_steps=False))
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    system = list(range(100, 100 + 64))  # a shared system prompt, so the prefix cache is used
    for i in range(num_running + num_waiting):
        prompt = system + [1000 + (i * 7919 + j) % 40000 for j in range(prompt_len - len(system))]
        driver.add_request(Request(f"r{i}", prompt, params, 0.0, tenant=f"t{i % 4}"))
    return driver


def measure(num_running: int, steps: int, policy: str, num_waiting: int, prompt_len: int) -> float:
    """Microseconds per running request per decode step."""
    driver = build(num_running, num_waiting, policy, prompt_len)
    sched = driver.scheduler
    now = 0.0
    while len(sched.running) < num_running or any(r.is_prefill for r in sched.running):
        out = driver.schedule(now)
        driver.complete(out, _tokens(out), now, now)
        now += 0.01
    t0 = time.perf_counter()
    for _ in range(steps):
        out = driver.schedule(now)
        driver.complete(out, _tokens(out), now, now)
        now += 0.01
    elapsed = time.perf_counter() - t0
    assert out.num_decode_seqs == num_running
    return elapsed / steps / num_running * 1e6


def _tokens(out) -> ModelRunnerOutput:
    return ModelRunnerOutput({sr.request.request_id: [11] for sr in out.scheduled if sr.sample})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--waiting", type=int, default=5000)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", nargs="+", default=["fcfs", "fair"])
    args = ap.parse_args()
    print(f"{'policy':<8} {'running':>8} {'us/req/step (median of ' + str(args.repeats) + ')':>30}  runs")
    for policy in args.policy:
        for n in args.running:
            runs = [measure(n, args.steps, policy, args.waiting, args.prompt_len)
                    for _ in range(args.repeats)]
            print(f"{policy:<8} {n:>8} {statistics.median(runs):>30.2f}  "
                  + " ".join(f"{r:.2f}" for r in runs))


if __name__ == "__main__":
    main()
