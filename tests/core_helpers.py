"""Scheduler factories from plain integers, and a fake backend, for the core tests."""

from __future__ import annotations

from twinserve.core import (
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from twinserve.policies import get_policy


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256,
                   policy: str = "fcfs", policy_options: dict | None = None,
                   **kwargs) -> Scheduler:
    config = SchedulerConfig(num_gpu_blocks=num_blocks, block_size=block_size,
                             max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, **kwargs)
    return Scheduler(config, get_policy(policy, **(policy_options or {})))


def make_req(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0,
             prefix: list[int] | None = None, **kwargs) -> Request:
    """A request whose prompt is ``prefix`` followed by tokens unique to ``rid``."""
    prefix = prefix or []
    base = 1000 + 1000 * (abs(hash(rid)) % 10_000)
    prompt = prefix + [base + i for i in range(prompt_len - len(prefix))]
    params = kwargs.pop("params", None) or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, arrival, eos_token_id=2, **kwargs)


def fake_execute(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Samples ``token`` for every entry that must sample."""
    return ModelRunnerOutput({sr.request_id: [token] for sr in out.scheduled if sr.sample})


def step(sched: Scheduler, now: float, token: int = 7):
    out = sched.schedule(now)
    outs = sched.update_from_output(out, fake_execute(out, token), now + 0.01)
    return out, outs


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, dt: float = 0.01) -> int:
    now = 0.0
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return n
        step(sched, now)
        now += dt
    raise AssertionError("requests did not finish")
