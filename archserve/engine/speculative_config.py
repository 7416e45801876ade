"""vLLM's ``speculative_config``: which proposer drafts tokens, and how many.

Methods (vLLM's names):

- ``ngram``: prompt lookup. The longest suffix of the sequence, ``prompt_lookup_min`` to
  ``prompt_lookup_max`` tokens long, that occurred earlier in it; the tokens that followed
  its first occurrence are the draft. No model. Both bounds default to 5 when neither is
  given, and one given stands for both (as vLLM does).
- ``draft_model``: a smaller model sharing the target's tokenizer (``model``: its
  checkpoint) drafts greedily, with its own KV cache in the target's blocks.
- ``mtp``: the target checkpoint's own multi-token-prediction layers (DeepSeek-V3's
  ``num_nextn_predict_layers``), run on the target's hidden states; the number of draft
  tokens defaults to that layer count, and a larger one runs the layers again.

``num_speculative_tokens`` is required except for ``mtp``. Keys archserve does not have
are refused by name rather than ignored; vLLM's deprecated MTP method names
(``deepseek_mtp``) mean ``mtp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from archserve.engine.config_json import loads_option, refuse_unknown_keys

METHODS = ("ngram", "draft_model", "mtp")
_MTP_ALIASES = ("deepseek_mtp", "deepseek_v3_mtp", "deepseek_v32_mtp", "glm4_moe_mtp")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
         "prompt_lookup_min", "draft_tensor_parallel_size", "quantization")
NGRAM_DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # None only for mtp before the checkpoint is read (resolve_mtp_tokens fills it).
    num_speculative_tokens: int | None
    model: str | None = None                  # the draft model's checkpoint (draft_model)
    prompt_lookup_max: int = 0                # ngram only
    prompt_lookup_min: int = 0
    quantization: str | None = None           # the draft model's (draft_model)

    def describe(self) -> str:
        """One line for logs and explain: the method and its parameters."""
        what = {"ngram": f"n-gram prompt lookup (n = {self.prompt_lookup_min}.."
                         f"{self.prompt_lookup_max})",
                "draft_model": f"draft model {self.model}",
                "mtp": "the checkpoint's multi-token-prediction layers"}[self.method]
        return f"{what}, {self.num_speculative_tokens} draft tokens a step"


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
    return value


def parse_speculative_config(value: dict | str | SpeculativeConfig | None
                             ) -> SpeculativeConfig | None:
    """The config a ``speculative_config`` (a dict, its JSON text, or one already parsed)
    asks for; None for none. ValueError names what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = loads_option(value, "speculative_config")
    if not isinstance(value, dict):
        raise ValueError('speculative_config must be a JSON object such as {"method": "ngram", '
                         '"num_speculative_tokens": 4}')
    refuse_unknown_keys(value, _KEYS, "speculative_config")
    method = value.get("method")
    model = value.get("model")
    if method is None:   # vLLM infers it: "ngram" as the model names the method
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
    if method == "[ngram]":
        method = "ngram"
    if method in _MTP_ALIASES:
        method = "mtp"
    if method not in METHODS:
        raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; "
                         f"got {method!r}")
    if value.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("speculative_config draft_tensor_parallel_size: archserve runs the "
                         "draft on one rank; give 1 (or leave it out)")
    tokens = value.get("num_speculative_tokens")
    if tokens is not None:
        tokens = _positive_int(tokens, "num_speculative_tokens")
    elif method != "mtp":
        raise ValueError(f"speculative_config method {method} needs num_speculative_tokens")
    quantization = value.get("quantization")
    if method == "ngram":
        if quantization is not None or model not in (None, "ngram", "[ngram]"):
            raise ValueError("speculative_config method ngram takes no model or quantization")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low = None if low is None else _positive_int(low, "prompt_lookup_min")
        high = None if high is None else _positive_int(high, "prompt_lookup_max")
        if low is None and high is None:
            low = high = NGRAM_DEFAULT_LOOKUP
        low, high = low or high, high or low
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} must be <= "
                             f"prompt_lookup_max={high}")
        return SpeculativeConfig("ngram", tokens, prompt_lookup_max=high, prompt_lookup_min=low)
    if "prompt_lookup_max" in value or "prompt_lookup_min" in value:
        raise ValueError(f"speculative_config prompt_lookup_max/min belong to method ngram, "
                         f"not {method}")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config method draft_model needs model: the draft "
                             "checkpoint (a directory or a .gguf file)")
        return SpeculativeConfig("draft_model", tokens, model=model, quantization=quantization)
    if model is not None or quantization is not None:
        raise ValueError("speculative_config method mtp reads the target checkpoint's own "
                         "layers: it takes no model or quantization")
    return SpeculativeConfig("mtp", tokens)
