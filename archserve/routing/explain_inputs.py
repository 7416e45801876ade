"""What `archserve explain` is asked, checked without importing torch: a typo in an
argument is answered at once, before the seconds the selection rules take to import.

``routing/explain.py`` answers the request; this module holds its inputs and their rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from archserve.kernels.registry import ATTENTION_TYPES, OP_KINDS, LibraryAssumption

if TYPE_CHECKING:
    from archserve.models.attention_facts import AttentionFacts

# vLLM's two side selections, explained alone with --op.
SIDE_SELECTIONS = ("vit_attention", "mla_prefill")
EXPLAIN_OPS = OP_KINDS + SIDE_SELECTIONS
# --op attention without --head-size: Llama-3-8B's attention (head 128, 32 query and 8 KV
# heads), as --op linear takes Llama-3-8B's shapes.
DEFAULT_HEAD_SIZE = 128


@dataclass(frozen=True)
class SelectionInputs:
    """What else vLLM selects on, beyond dtype, KV dtype, head and block size (vLLM 0.33
    v1/attention/selector.py, AttentionSelectorConfig; parallel sizes for MoE). Defaults
    are a plain causal decoder on one GPU."""

    has_sinks: bool = False
    attn_type: str = "decoder"
    non_causal: bool = False
    batch_invariant: bool = False
    per_head_kv_scales: bool = False
    fa_version: int | None = None
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    # LoRA adapters served over the model (vLLM's --enable-lora): a route of its own.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.attn_type not in ATTENTION_TYPES:
            raise ValueError(f"attention type must be one of {', '.join(ATTENTION_TYPES)}, "
                             f"not {self.attn_type!r}")
        if self.fa_version not in (None, 2, 3, 4):
            raise ValueError(f"FlashAttention version must be 2, 3 or 4, not {self.fa_version}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor parallel size must be >= 1")

    def attention_fields(self) -> dict[str, Any]:
        return dict(has_sinks=self.has_sinks, attn_type=self.attn_type,
                    non_causal=self.non_causal, batch_invariant=self.batch_invariant,
                    per_head_kv_scales=self.per_head_kv_scales, fa_version=self.fa_version)

    def for_model(self, facts: AttentionFacts) -> SelectionInputs:
        """These inputs with what the model's config says (sinks, per-head KV scales, an
        encoder's bidirectional attention): a flag adds to the config, never hides it."""
        fields = facts.spec_fields()
        return replace(self, has_sinks=self.has_sinks or fields["has_sinks"],
                       per_head_kv_scales=self.per_head_kv_scales or fields["per_head_kv_scales"],
                       attn_type=(fields["attn_type"] if self.attn_type == "decoder"
                                  else self.attn_type))

    def per_rank_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """Heads one tensor-parallel rank holds (KV heads are replicated below one per rank)."""
        tp = self.tensor_parallel_size
        return max(1, num_heads // tp), max(1, num_kv_heads // tp)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.attention_fields(), tensor_parallel_size=self.tensor_parallel_size,
                    expert_parallel=self.expert_parallel, enable_lora=self.enable_lora,
                    max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)


def parse_libraries(text: str) -> LibraryAssumption:
    """``all`` | ``none`` | ``installed`` | a comma-separated list of library names."""
    key = text.strip().lower()
    if key in ("all", "none", "installed"):
        return key
    return frozenset(n.strip() for n in key.split(",") if n.strip())


def check_op(op: str, head_size: int | None) -> None:
    """ValueError naming what is wrong with ``--op OP [--head-size N]``."""
    if op not in EXPLAIN_OPS:
        raise ValueError(f"--op must be one of {', '.join(EXPLAIN_OPS)}, not {op!r}")
    if head_size is not None and head_size <= 0:
        raise ValueError(f"--head-size must be positive, not {head_size}")
    if op == "vit_attention" and head_size is None:
        raise ValueError("--op vit_attention needs --head-size (a vision encoder's)")
