"""The proposer and the verification settings a ``speculative_config`` asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinserve.core.engine_args import EngineArgs
from twinserve.gpu.worker.rejection_sampler import VerifySettings
from twinserve.spec_decode.ngram import NgramProposer
from twinserve.spec_decode.proposer import Proposer
from twinserve.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from twinserve.core.speculative_config import SpeculativeConfig


def build_proposer(config: SpeculativeConfig, args: EngineArgs, vocab_size: int,
                   usage_context: str) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    if config.method == "draft_model" and config.model:
        from twinserve.gpu.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(args, config.model, vocab_size, usage_context, args.seed)
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer here.")


def verify_settings(config: SpeculativeConfig) -> VerifySettings:
    return VerifySettings(config.rejection_sample_method, config.acceptance_rates)
