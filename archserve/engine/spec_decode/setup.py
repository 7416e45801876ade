"""Start-up of speculative decoding: the proposer a config asks for, and the decision
that says what runs."""

from __future__ import annotations

from archserve.engine.spec_decode.config import SpeculativeConfig
from archserve.engine.spec_decode.speculator import Speculator
from archserve.platform.decision import Decision


def build_speculator(config: SpeculativeConfig, max_model_len: int
                     ) -> tuple[Speculator, Decision]:
    """The engine's speculator for ``config``, and the start-up decision naming it."""
    if config.method == "ngram":
        from archserve.engine.spec_decode.ngram import NgramProposer
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                 config.prompt_lookup_max)
    else:
        raise ValueError(f"speculative_config method {config.method} is not built yet")
    decision = Decision(
        "speculative decoding", config.method, config.method,
        f"{config.describe()}; one target forward verifies each sequence's drafts (greedy: "
        f"accepted while they are the argmax; sampled: rejection sampling, lossless); a step "
        f"with drafts resolves before the next is scheduled")
    return Speculator(config, proposer, max_model_len), decision
