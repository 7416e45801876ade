"""How a model splits over tensor-parallel ranks: heads, KV heads, MLP columns, vocabulary.

One place answers "what does rank r hold" for the parallel layers, the KV cache sizing,
``explain`` and ``doctor``; and "can this model split N ways at all" with a reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from archserve.platform.decision import Decision


@dataclass(frozen=True)
class HeadSplit:
    """Attention heads of one rank: its query heads, its KV heads, and where they start."""

    num_heads: int          # query heads on this rank
    num_kv_heads: int       # KV heads on this rank (1 when replicated)
    first_head: int         # index of its first query head in the checkpoint
    first_kv_head: int      # index of its first KV head in the checkpoint
    kv_replicas: int        # how many ranks hold each KV head (1: none replicated)


def split_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadSplit:
    """Query heads split evenly; KV heads split too, or replicated when fewer than ranks.

    With fewer KV heads than ranks, each rank holds the one KV head its query heads read:
    query head h reads KV head h // (num_heads / num_kv_heads).
    """
    reason = head_split_problem(num_heads, num_kv_heads, size)
    if reason:
        raise ValueError(reason)
    local_heads = num_heads // size
    first_head = rank * local_heads
    if num_kv_heads >= size:
        local_kv = num_kv_heads // size
        return HeadSplit(local_heads, local_kv, first_head, rank * local_kv, 1)
    replicas = size // num_kv_heads
    return HeadSplit(local_heads, 1, first_head, rank // replicas, replicas)


def head_split_problem(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    if num_heads % size:
        return (f"{num_heads} attention heads do not split over {size} tensor-parallel "
                f"ranks (the heads must be a multiple of the ranks)")
    if num_kv_heads >= size and num_kv_heads % size:
        return (f"{num_kv_heads} KV heads do not split over {size} tensor-parallel ranks "
                f"(a multiple of the ranks, or a divisor of them to replicate)")
    if num_kv_heads < size and size % num_kv_heads:
        return (f"{num_kv_heads} KV heads cannot be replicated evenly over {size} "
                f"tensor-parallel ranks (the ranks must be a multiple of the KV heads)")
    return None


def split_evenly(total: int, size: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank's part of ``total`` columns that divide evenly."""
    if total % size:
        raise ValueError(f"{total} does not split over {size} tensor-parallel ranks")
    per = total // size
    return rank * per, per


def vocab_part(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """(first token id, number of real rows, rows allocated) of rank's vocabulary part.

    Every rank allocates the same ceil(vocab / size) rows so the gathered logits line up;
    the last part's rows past the vocabulary are padding (zero embedding, logits cut off).
    """
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return start, min(per, vocab_size - start), per


def layout_problems(model_config, size: int, device_type: str = "cpu",
                    num_devices: int = 0) -> list[str]:
    """Why ``model_config`` (a ModelConfig or routing's ModelSummary) cannot run over
    ``size`` tensor-parallel ranks on ``num_devices`` devices of ``device_type`` (empty:
    it can)."""
    if size == 1:
        return []
    problems = []
    devices = device_count_problem(size, device_type, num_devices)
    if devices:
        problems.append(devices)
    head = head_split_problem(model_config.num_heads, model_config.num_kv_heads, size)
    if head:
        problems.append(head)
    for what, width in split_widths(model_config):
        if width % size:
            problems.append(f"{what} {width} does not split over {size} tensor-parallel "
                            f"ranks")
    return problems


def _experts(model_config) -> tuple[int, int] | None:
    """(routed experts, each one's intermediate channels) of an MoE model, else None."""
    count = getattr(model_config, "num_experts", 0)         # a ModelSummary's
    width = model_config.intermediate_size                  # ... is the experts' already
    hf = getattr(model_config, "hf_config", None)
    text = getattr(hf, "text_config", None) or hf
    if text is not None:
        count = next((int(getattr(text, key)) for key in ("num_local_experts", "num_experts",
                                                           "n_routed_experts")
                      if getattr(text, key, None)), 0)
        width = int(getattr(text, "moe_intermediate_size", None) or width)
    return (count, width) if count else None


def split_widths(model_config) -> tuple[tuple[str, int], ...]:
    """The widths tensor parallelism splits evenly: the dense MLP's intermediate channels,
    and an MoE model's expert and shared-expert channels (every expert's are split). A
    ModelConfig's HF config names them; a ModelSummary carries them from its ModelConfig
    (``split_widths``), or has only its intermediate size (a GGUF's)."""
    hf = getattr(model_config, "hf_config", None)
    if hf is None:
        return (getattr(model_config, "split_widths", ())
                or (("MLP intermediate size", model_config.intermediate_size),))
    text = getattr(hf, "text_config", None) or hf
    widths = [("MLP intermediate size", model_config.intermediate_size)]
    moe = getattr(text, "moe_intermediate_size", None)
    if moe:
        widths.append(("expert intermediate size", int(moe)))
    shared = (getattr(text, "shared_expert_intermediate_size", None)
              or int(moe or 0) * int(getattr(text, "n_shared_experts", 0) or 0))   # DeepSeek's
    if shared:
        widths.append(("shared expert intermediate size", int(shared)))
    return tuple(widths)


def device_count_problem(size: int, device_type: str, num_devices: int) -> str | None:
    """More ranks than devices: each rank needs a GPU of its own (CPU ranks share cores)."""
    if device_type == "cuda" and size > num_devices:
        return (f"tensor_parallel_size={size} needs {size} GPUs, this machine has "
                f"{num_devices}")
    return None


def rank_model_config(model_config, size: int, rank: int):
    """The model config as one rank's KV cache and attention kernels see it: its own
    query and KV heads. Everything else (vocabulary, hidden size) stays whole."""
    if size == 1:
        return model_config
    heads = split_heads(model_config.num_heads, model_config.num_kv_heads, size, rank)
    return dataclasses.replace(model_config, num_heads=heads.num_heads,
                               num_kv_heads=heads.num_kv_heads)


def describe_rank(model_config, size: int, rank: int) -> str:
    """What one rank holds, in words (explain, doctor, the start-up log)."""
    heads = split_heads(model_config.num_heads, model_config.num_kv_heads, size, rank)
    _, mlp = split_evenly(model_config.intermediate_size, size, rank)
    kv = (f"KV head {heads.first_kv_head} (replicated on {heads.kv_replicas} ranks)"
          if heads.kv_replicas > 1 else
          f"KV heads {heads.first_kv_head}..{heads.first_kv_head + heads.num_kv_heads - 1}")
    if getattr(model_config, "mla", None) or getattr(model_config, "use_mla", False):
        kv = "the whole MLA latent cache (every head reads it)"
    text = (f"rank {rank}: query heads {heads.first_head}.."
            f"{heads.first_head + heads.num_heads - 1}, {kv}, MLP columns {rank * mlp}.."
            f"{(rank + 1) * mlp - 1}")
    experts = _experts(model_config)
    if experts:
        count, width = experts
        first, per = split_evenly(width, size, rank)
        text += f", channels {first}..{first + per - 1} of each of the {count} experts"
    vocab = getattr(model_config, "vocab_size", None)      # a ModelSummary has none
    if vocab:
        first, rows, _ = vocab_part(vocab, size, rank)
        text += f", vocabulary rows {first}..{first + rows - 1}"
    return text


def comm_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def layout_decision(model_config, size: int, device_type: str, executor: str = "mp"
                    ) -> Decision:
    """The parallel layout as a start-up / explain / doctor decision: ranks, the
    communication backend, the executor, and what each rank holds."""
    ranks = "; ".join(describe_rank(model_config, size, rank) for rank in range(size))
    return Decision("tensor parallel", str(size),
                    f"{size} ranks, {comm_backend(device_type)}, {executor} executor", ranks)
