"""Engine start-up: device, dtype, model, attention route, KV pool size, graphs, canary.

Each decision is recorded (what, requested, chosen, reason) so the start-up log and
`archserve explain` tell the same story.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from archserve.engine.config import EngineConfig
from archserve.engine.kv_cache import (
    DEFAULT_CPU_KV_BYTES,
    blocks_for_budget,
    cache_bytes_per_block,
    cuda_available_kv_bytes,
    kv_dtype_of,
)
from archserve.kernels.catalog import select_attention_backend
from archserve.kernels.registry import BackendError, Selection
from archserve.kernels.specs import AttentionSpec, batch_invariant_requested
from archserve.platform import DeviceInfo
from archserve.platform.decision import Decision
from archserve.platform.detect import device_info_for as platform_device_info_for
from archserve.routing.dtypes import (
    kv_cache_refusal,
    model_kv_cache_default,
    resolve_dtype,
    resolve_kv_cache_dtype,
)

log = logging.getLogger("archserve")


@dataclass
class StartupReport:
    device: DeviceInfo
    torch_device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: str
    decisions: list = field(default_factory=list)
    attention: Selection | None = None
    block_size: int = 16
    num_blocks: int = 0
    max_model_len: int = 0
    graph_sizes: list[int] = field(default_factory=list)
    graph_demoted: dict[int, str] = field(default_factory=dict)
    canary: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    kv_sizing: str = ""                                   # how num_blocks was reached
    routes: list = field(default_factory=list)            # explain Routes of the loaded model
    graphs_off: str | None = None                         # why decode runs eager, if it does
    kernel_cache: str | None = None                       # Triton compile/autotune cache dir
    self_check: object | None = None                      # self_check.SelfCheck on GPUs
    token_budget: object | None = None                    # step_budget.TokenBudget
    rank_memory: list = field(default_factory=list)       # rank_memory.RankMemory per rank


def resolve_torch_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(config.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device "
                         "(run `archserve doctor` for the reason)")
    return dev


def engine_device_info(torch_device: torch.device, emulate_device: str | None = None
                       ) -> DeviceInfo:
    """The DeviceInfo of the device the engine will run on (a CPU run on a GPU host is a
    CPU); with ``emulate_device``, the GPU here narrowed to that profile
    (platform/emulation.py). A GPU engine fixes its process's emulation, or its absence."""
    from archserve.platform.emulation import EmulationRefused, emulate
    if emulate_device is not None and torch_device.type != "cuda":
        raise EmulationRefused(f"cannot emulate {emulate_device}: emulation runs on a GPU, and "
                               f"this engine runs on {torch_device.type}")
    if torch_device.type == "cuda":
        emulate(emulate_device)
    return platform_device_info_for(torch_device)


def emulation_decision(device: DeviceInfo) -> Decision | None:
    """The start-up decision that says the engine runs emulated (None when it does not)."""
    from archserve.platform.emulation import emulation_summary
    if device.emulated_on is None:
        return None
    return Decision("device", f"emulate {device.id}", device.describe(),
                    emulation_summary(device))


def select_attention(device: DeviceInfo, config: EngineConfig, model_config, dtype: torch.dtype,
                     kv_cache_dtype: str, extra_reject=None) -> Selection:
    spec = attention_spec_of(config, model_config, dtype, kv_cache_dtype)
    return select_attention_backend(device, spec, override=config.attention_backend,
                                    extra_reject=extra_reject)


def select_attention_with_canary(device: DeviceInfo, config: EngineConfig, model_config,
                                 dtype: torch.dtype, kv_cache_dtype: str,
                                 torch_device: torch.device):
    """Select attention, demoting any candidate whose kernel fails the numerics canary.

    Returns (selection, the winner's impl, canary log lines).
    """
    from archserve.engine.canary import attention_canary
    spec = attention_spec_of(config, model_config, dtype, kv_cache_dtype)
    impls: dict[str, object] = {}
    log_lines: list[str] = []

    def canary(backend) -> str | None:
        impl = impls[backend.name] = backend.make_impl(device, spec)
        if config.skip_canary or backend.name == "TORCH_REFERENCE":
            return None
        reason = attention_canary(impl, spec, kv_block_size(config, backend, model_config),
                                  torch_device)
        log_lines.append(f"{backend.name}: {reason or 'passed'}")
        return reason

    selection = select_attention(device, config, model_config, dtype, kv_cache_dtype,
                                 extra_reject=canary)
    return selection, impls[selection.name], log_lines


def cuda_graphs_off_reason(torch_device: torch.device, config: EngineConfig,
                           attention: Selection, cudagraph_mode: str) -> str | None:
    """None when decode steps are captured as CUDA graphs, else why not (``cudagraph_mode``:
    compilation_config's, as parse_compilation_config read it)."""
    if torch_device.type != "cuda":
        return f"no CUDA graphs on {torch_device.type}"
    if config.enforce_eager:
        return "enforce_eager=True"
    if cudagraph_mode == "NONE":
        return "cudagraph_mode NONE (compilation_config)"
    if not attention.backend.graph_capturable:
        return (f"{attention.name} reads sequence lengths on the host, so a captured graph "
                f"would replay stale lengths")
    return None


def compiled_steps_off_reason(config: EngineConfig, compilation, lora, calibrate: bool,
                              keeps_hidden_states: bool) -> str | None:
    """None when a CPU's decode steps run compiled (engine/cpu_compiled_step.py), else why
    they run eager (``compilation``: parse_compilation_config's choice)."""
    if config.enforce_eager:
        return "enforce_eager=True"
    if not compilation.effective_level:
        return f"{compilation.level_source()}: -O 1-3 compiles them"
    if config.tensor_parallel_size > 1:
        # A rank's step holds collectives with the other ranks; a compiled step is not
        # built across them, so every rank keeps the one (eager) path.
        return "tensor parallel: compiled steps are not built across the ranks' collectives"
    if lora is not None:
        return "LoRA adapters: each step's adapters are a per-step choice"
    if calibrate:
        return "calculate_kv_scales measures the fp8 KV scales on eager steps"
    if keeps_hidden_states:
        return "a drafter reads each step's hidden states"
    return None


def model_routes(device: DeviceInfo, config: EngineConfig, model_config, dtype: torch.dtype,
                 kv_cache_dtype: str, attention: Selection, is_gguf: bool = False) -> list:
    """The explain routes of the loaded model, with attention as actually selected here."""

    from archserve.routing.dtypes import dtype_name
    from archserve.routing.explain import explain_model, route_from_selection
    from archserve.routing.model_summary import summary_from_model_config
    summary = summary_from_model_config(model_config, is_gguf=is_gguf)
    explanation = explain_model(device, summary, dtype_name(dtype), kv_cache_dtype,
                                config.quantization)
    spec = attention_spec_of(config, model_config, dtype, kv_cache_dtype)
    return [route_from_selection(attention, r.layer, device, spec)
            if r.layer == "attention" else r for r in explanation.routes]


def kv_block_size(config: EngineConfig, backend, model_config) -> int:  # noqa: ANN001
    """The KV block size: the user's, else the attention backend's preferred one. DeepSeek
    V4's must hold whole compression groups of every rate: the user's is refused otherwise,
    the preferred one rounded up to such a multiple."""
    preferred = getattr(backend, "preferred_block_size", 16)
    compressed = getattr(model_config, "compressed_attention", None)
    multiple = compressed.block_multiple if compressed is not None else 1
    if config.block_size is not None:
        if config.block_size % multiple:
            raise ValueError(
                f"block_size {config.block_size} does not hold whole compression groups: "
                f"this model compresses {', '.join(map(str, sorted(compressed.compress_rates.values())))}"
                f" tokens at a time, so a block must be a multiple of {multiple}")
        return config.block_size
    return -(-preferred // multiple) * multiple


def attention_spec_of(config: EngineConfig, model_config, dtype, kv_cache_dtype) -> AttentionSpec:
    mla = getattr(model_config, "mla", None)
    mla_fields = {} if mla is None else dict(
        use_mla=True, kv_lora_rank=mla.kv_lora_rank, qk_rope_head_dim=mla.qk_rope_head_dim,
        qk_nope_head_dim=mla.qk_nope_head_dim, v_head_dim=mla.v_head_dim)
    sparse = getattr(model_config, "sparse_attention", None)
    if mla is not None and sparse is not None:
        mla_fields.update(mla_sparse=True, index_topk=sparse.index_topk,
                          index_head_dim=sparse.index_head_dim,
                          index_num_heads=sparse.index_n_heads,
                          index_cache_dtype=config.index_cache_dtype)
    compressed = getattr(model_config, "compressed_attention", None)
    if compressed is not None:
        mla_fields = dict(compressed.spec_fields(compressed.selection_kind),
                          index_cache_dtype=config.index_cache_dtype)
    return AttentionSpec(
        head_size=model_config.kv_cache_head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        block_size=config.block_size, num_heads=model_config.num_heads,
        num_kv_heads=model_config.kv_cache_heads, sliding_window=model_config.sliding_window,
        batch_invariant=batch_invariant_requested(),
        **model_config.attention_facts.spec_fields(), **mla_fields)


def size_kv_pool(config: EngineConfig, runner, model_config, kv_torch_dtype: torch.dtype,
                 max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                 torch_device: torch.device, mixed_graph_tokens: int = 0,
                 extra_bytes_per_block: int = 0, rows_per_seq: int = 1,
                 ring_bytes: int = 0, decode_graph_rows: int | None = None
                 ) -> tuple[int, str]:
    """Number of KV blocks, and how that number was reached. ``mixed_graph_tokens``: the
    largest bucket of the mixed-step graphs to be captured (0: none);
    ``extra_bytes_per_block``: what else each block holds (a draft network's cache);
    ``rows_per_seq``: the rows a sequence samples in a step at most (1 + its drafts);
    ``ring_bytes``: what the cache holds beside its blocks (DeepSeek V4's window rings, one
    per sequence), taken from the budget first; ``decode_graph_rows``: the rows of the
    largest decode graph (None: ``max_num_seqs``; more where verification steps run as
    decode rows)."""
    per_block = runner.kv_bytes_per_block(kv_torch_dtype) + extra_bytes_per_block
    rings = f", {ring_bytes / 2**20:.1f} MiB of window rings" if ring_bytes else ""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, "num_kv_blocks given" + rings
    if config.kv_cache_memory_bytes is not None:
        return blocks_for_budget(config.kv_cache_memory_bytes - ring_bytes, per_block), \
            f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}" + rings
    if torch_device.type == "cuda":
        sampled_rows = max_num_seqs * rows_per_seq
        peak = runner.profile_peak_activation_bytes(max_num_batched_tokens, max_num_seqs,
                                                    sampled_rows)
        # CUDA graphs keep their own memory pool: set aside an estimate so graphs fit,
        # plus their LM-head output (float32 logits, and, where the LM head runs on cuBLAS,
        # the model-dtype product before them: an upper bound).
        logits_bytes = ((decode_graph_rows or max_num_seqs) * model_config.vocab_size
                        * (4 + 2))
        reserve = 0 if config.enforce_eager else (256 << 20) + logits_bytes
        if mixed_graph_tokens:
            # The mixed-step graphs' pool holds the activations of their largest bucket,
            # and their output buffer the float32 logits of every sampled row's slot.
            rows = min(mixed_graph_tokens, sampled_rows) + 1
            reserve += (int(peak * min(1.0, mixed_graph_tokens / max_num_batched_tokens))
                        + logits_bytes + rows * model_config.vocab_size * 4)
        if extra_bytes_per_block:
            # A draft network's graphs keep a pool of their own, of the same forwards at
            # the same sizes (its vocabulary at most the target's): as much again.
            reserve *= 2
        avail = cuda_available_kv_bytes(torch_device, config.gpu_memory_utilization, peak, reserve)
        return blocks_for_budget(avail - ring_bytes, per_block), (
            f"gpu_memory_utilization={config.gpu_memory_utilization}, activation peak "
            f"{peak / 2**20:.0f} MiB, graph reserve {reserve >> 20} MiB" + rings)
    # CPU: no more than the longest possible batch needs, capped by the default budget.
    needed_blocks = max_num_seqs * ((max_model_len + runner.block_size - 1) // runner.block_size)
    return min(needed_blocks, blocks_for_budget(DEFAULT_CPU_KV_BYTES - ring_bytes, per_block)), \
        f"CPU default budget {DEFAULT_CPU_KV_BYTES >> 20} MiB" + rings


def kv_capacity_before_load(config: EngineConfig, model_config, attn_impl,
                            kv_torch_dtype: torch.dtype, block_size: int,
                            torch_device: torch.device, blocks_shared: bool = False
                            ) -> tuple[int, str, bool]:
    """(tokens the KV pool will hold at most, how that is known, whether it is exact),
    from the config alone, before any weight is read. Exact where the budget is given or
    fixed (num_kv_blocks, kv_cache_memory_bytes, a CPU's default); on a GPU the pool gets
    what the weights and the activation peak leave, known only after the load, so this is
    the bound with neither (size_kv_pool has the exact number). ``blocks_shared``: a
    draft network's cache will share the blocks (an upper bound too, without its bytes)."""
    per_block = cache_bytes_per_block(model_config, attn_impl, kv_torch_dtype, block_size)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks * block_size, "num_kv_blocks given", True
    if config.kv_cache_memory_bytes is not None:
        return (blocks_for_budget(config.kv_cache_memory_bytes, per_block) * block_size,
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}", not blocks_shared)
    if torch_device.type == "cuda":
        avail = cuda_available_kv_bytes(torch_device, config.gpu_memory_utilization, 0)
        return (blocks_for_budget(avail, per_block) * block_size,
                f"gpu_memory_utilization={config.gpu_memory_utilization} of the device "
                f"before the weights and activations take their share", False)
    return (blocks_for_budget(DEFAULT_CPU_KV_BYTES, per_block) * block_size,
            f"CPU default budget {DEFAULT_CPU_KV_BYTES >> 20} MiB; --kv-cache-memory-bytes "
            f"sets another", not blocks_shared)


def fit_max_model_len(requested: int | None, max_model_len: int, capacity: int, sizing: str,
                      exact: bool = True) -> tuple[int, Decision | None]:
    """The context length that fits a KV pool of ``capacity`` tokens: ``max_model_len``
    where it fits; an explicit one (``requested``) that does not is a ValueError; the
    model's own is lowered to what fits, with a notice (as a decision, and a warning now:
    the load that follows may take a while). ``exact`` False: ``capacity`` is an upper
    bound, which only an explicit length can be refused against."""
    if max_model_len <= capacity:
        return max_model_len, None
    if requested is not None:
        raise ValueError(f"max_model_len={requested} does not fit: the KV cache has room for "
                         f"{'at most ' if not exact else ''}{capacity} tokens ({sizing}); "
                         f"lower max_model_len (to {capacity} or less) or give the cache "
                         f"more memory")
    if not exact:
        return max_model_len, None
    reason = (f"the model's {max_model_len} tokens do not fit the KV cache ({capacity} "
              f"tokens: {sizing}); set max_model_len, or give the cache more memory")
    log.warning("max_model_len %d: %s", capacity, reason)
    return capacity, Decision("max_model_len", "auto", str(capacity), reason)


def resolve_async_scheduling(requested: bool | None, torch_device: torch.device) -> Decision:
    """Async scheduling unless asked otherwise, where the device runs behind the host."""
    asked = {None: "auto", True: "async", False: "sync"}[requested]
    if requested is not None:
        return Decision("scheduling", asked, asked, "set by async_scheduling")
    if torch_device.type == "cuda":
        return Decision("scheduling", asked, "async",
                        "CUDA runs behind the host: the next step is built while this one runs")
    return Decision("scheduling", asked, "sync",
                    f"{torch_device.type} runs each op before returning: nothing to overlap")


def plan_checkpoint_quantization(device: DeviceInfo, config: EngineConfig, model_config,
                                 gguf_path: str | None, dtype: torch.dtype):
    """The kernel of every kind of quantized layer, from config.json alone; raises
    ValueError ("not loadable in this build: ...") when none can run one of them."""
    from archserve.models.registry import model_class_for
    from archserve.quant.config import resolve_quant_config
    from archserve.quant.plan import (
        gguf_experts_decision,
        keeps_gguf_quantized,
        plan_quantization,
        quantized_experts_refusal,
    )

    quant = resolve_quant_config(model_config.quantization_config, config.quantization,
                                 gguf_path is not None,
                                 keep_gguf_quantized=keeps_gguf_quantized(device, dtype))
    plan = plan_quantization(device, quant, dtype)
    has_moe = "moe" in getattr(model_class_for(model_config.architecture), "op_kinds", ())
    reason = plan.not_loadable or quantized_experts_refusal(quant, has_moe)
    if reason:
        raise ValueError(f"not loadable in this build: {reason}")
    experts = gguf_experts_decision(gguf_path is not None, has_moe, dtype)
    if experts is not None:
        plan.decisions.append(experts)
    return plan


def resolve_precision(device: DeviceInfo, config: EngineConfig, model_config):
    dtype, decisions = resolve_dtype(device, config.dtype, model_config.torch_dtype)
    sparse_mla = getattr(model_config, "sparse_attention", None) is not None
    kv, kv_decisions = resolve_kv_cache_dtype(
        device, config.kv_cache_dtype, model_config.attention_facts.checkpoint_kv_cache_dtype,
        sparse_mla, model_kv_cache_default(model_config.architecture, device))
    refusal = kv_cache_refusal(kv, sparse_mla)
    if refusal:
        raise ValueError(f"not loadable in this build: {refusal}")
    return dtype, kv, list(decisions) + list(kv_decisions)


def elapsed(start: float) -> float:
    return round(time.perf_counter() - start, 3)


__all__ = ["StartupReport", "resolve_torch_device", "engine_device_info", "emulation_decision", "select_attention",
           "size_kv_pool", "resolve_precision", "elapsed", "BackendError", "kv_dtype_of",
           "attention_spec_of"]
