"""EngineConfig: every knob of one engine instance, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    model: str | None = None                 # None: the embedded default model
    tokenizer: str | None = None             # None: from the model
    skip_tokenizer_init: bool = False        # no tokenizer: token-id prompts, no output text
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # Sparse MLA (DeepSeek-V3.2, GLM-5): how the lightning indexer's key is cached. "auto":
    # the model dtype, or fp8 beside an fp8 latent (fp8 / fp8_ds_mla KV cache); "fp8":
    # always fp8, as vLLM keeps it (kernels/sparse_mla/layout.py).
    index_cache_dtype: str = "auto"
    # fp8 cache without scales in the checkpoint: measure them on the first prefill
    # (vLLM's --calculate-kv-scales); checkpoint scales are used when present.
    calculate_kv_scales: bool = False
    load_format: str = "auto"                # auto | safetensors | gguf | dummy
    device: str = "auto"                     # auto | cpu | cuda | cuda:N
    # A device profile (t4, a100, l40s, ...) whose capability model the GPU here runs with:
    # its dtypes, features, shared-memory limits, routes and tiles (platform/emulation.py).
    emulate_device: str | None = None
    attention_backend: str | None = None     # override, validated alone (or ARCHSERVE_ATTENTION_BACKEND)
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None # explicit KV budget (the CPU's way of sizing the pool)
    num_kv_blocks: int | None = None         # explicit pool size, for tests and experiments
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192, and target_itl_ms bounds decode steps
    # The inter-token latency a step that carries decodes should stay within, which sets
    # its token budget from the measured step cost (engine/step_budget.py): "auto" (a
    # multiple of a 16-sequence decode step; the server's default), milliseconds, or None (no bound:
    # throughput first, the offline default). Ignored when max_num_batched_tokens is set.
    target_itl_ms: float | str | None = None
    block_size: int | None = None            # None: the attention backend's preferred size
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Schedule and launch step N+1 before step N's tokens reach the host, so host work
    # overlaps the device (vLLM's --async-scheduling). Outputs arrive one step later.
    # None: on for CUDA, off on CPU (where every op is synchronous); the engine resolves it.
    async_scheduling: bool | None = None
    cuda_graph_sizes: list[int] = field(default_factory=list)  # empty: a default ladder
    # vLLM's compilation_config (a dict or its JSON): cudagraph_mode FULL (the default: steps
    # with prompt tokens replay graphs too), FULL_DECODE_ONLY or NONE, and
    # cudagraph_capture_sizes. engine/compilation_config.py says what else is refused.
    compilation_config: dict | str | None = None
    # vLLM's speculative_config (a dict or its JSON): {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    # {"method": "draft_model", "model": PATH, ...} or {"method": "mtp"}
    # (engine/speculative_config.py).
    speculative_config: dict | str | None = None
    seed: int = 0
    skip_canary: bool = False                # numerics canary of the attention kernel at start
    self_check: bool | None = None           # roofline self-check of a decode step (None: on GPUs)
    # Also attribute a GPU step's kernel time to op kinds with torch.profiler. Off by
    # default: the CUDA profiler leaves CUPTI attached for the life of the process, which
    # slows every later kernel launch (engine/self_check.py); `archserve prepare` sets it.
    self_check_profile: bool = False
    # One worker process per rank, each on its own GPU (or sharing the CPU's cores).
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp" # mp (this machine) | ray (a Ray cluster)
    # LoRA adapters (vLLM's names): each request may run with one (LoRARequest); every
    # dense linear holds max_loras adapter slots of rank max_lora_rank, and the host keeps
    # up to max_cpu_loras adapters read (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Accepted for vLLM compatibility:
    # None: the checkpoint's own; else a method checked against it ("fp8" on a 16-bit
    # checkpoint quantizes it at load, as vLLM's online fp8).
    quantization: str | None = None
    trust_remote_code: bool = False          # no effect: archserve never runs checkpoint code
    disable_log_stats: bool = False

    def validate(self) -> None:
        if self.emulate_device is not None:
            from archserve.platform.profiles import get_profile
            get_profile(self.emulate_device)   # an unknown profile: the valid ids, now
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        itl = self.target_itl_ms
        in_ms = isinstance(itl, int | float) and not isinstance(itl, bool)
        if not (itl is None or itl == "auto" or (in_ms and itl > 0)):
            raise ValueError(f"target_itl_ms must be 'auto', a positive number of milliseconds "
                             f"or None; got {itl!r}")
        if self.max_num_batched_tokens is not None and in_ms:
            raise ValueError("give max_num_batched_tokens (a fixed budget for every step) or "
                             "target_itl_ms (a budget derived from it), not both")
        from archserve.kernels.sparse_mla.layout import INDEX_CACHE_DTYPES
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(f"index_cache_dtype must be one of {', '.join(INDEX_CACHE_DTYPES)}; "
                             f"got {self.index_cache_dtype!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors, gguf or dummy; got {self.load_format!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be mp or ray; got "
                             f"{self.distributed_executor_backend!r}")
        from archserve.engine.speculative_config import parse_speculative_config
        if parse_speculative_config(self.speculative_config) is not None \
                and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding with tensor_parallel_size > 1 is not "
                             "supported yet; use tensor_parallel_size 1")
        if self.enable_lora:
            self._validate_lora()
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    def _validate_lora(self) -> None:
        from archserve.engine.lora.peft_adapter import MAX_LORA_RANKS
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of "
                             f"{', '.join(map(str, MAX_LORA_RANKS))}; got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 yet; "
                             "serve adapters with --tensor-parallel-size 1")
