"""SamplingParams: how one request is decoded. Names and defaults follow vLLM's."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from archserve.structured.params import StructuredOutputsParams

# The widest top-N a request may ask for, per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each RequestOutput carries (vLLM's names)."""

    CUMULATIVE = 0   # everything so far, every step
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # one output, when the request finishes (the offline API's choice)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16          # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None          # top-N logprobs per generated token
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
    allowed_token_ids: list[int] | None = None   # sample only among these
    truncate_prompt_tokens: int | None = None    # keep only the prompt's last k tokens
    # The output must match a JSON schema, regex, choice or grammar (vLLM's field).
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field; the engine never sees invalid params."""
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.min_tokens, int):
            bad(f"min_tokens must be an integer, got {self.min_tokens!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be 0 (disabled), -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -100.0 <= bias <= 100.0:
                bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                       for t in self.allowed_token_ids)):
            bad("allowed_token_ids must be a non-empty list of token ids")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool)
                or not isinstance(self.truncate_prompt_tokens, int)
                or self.truncate_prompt_tokens < 1):
            bad(f"truncate_prompt_tokens must be an integer >= 1, got "
                f"{self.truncate_prompt_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def plain_greedy(self) -> bool:
        """Greedy, and nothing else shapes the row's argmax or asks for more than the token
        (no penalty, bias, allowed list, grammar or logprobs). Stop tokens held back by
        ``min_tokens`` depend on the sequence: SamplingBatch.from_sequences checks them."""
        return (self.greedy and self.logprobs is None and self.structured_outputs is None
                and not self.logit_bias and self.allowed_token_ids is None
                and not self.needs_output_token_values)

    @property
    def needs_output_token_values(self) -> bool:
        """Sampling reads the generated tokens themselves (penalties), not just their count.

        A grammar reads them too, but only after the step's forward pass is queued (it
        waits for the in-flight step's copy then: see ``SamplingBatch.from_sequences``),
        so it does not stop asynchronous scheduling from overlapping steps."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
