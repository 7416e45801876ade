"""Tiny but real checkpoints on disk: a transformers model with random weights, saved as
safetensors, plus a byte-level BPE tokenizer trained here (no downloads) with a chat template.

Shared by the engine, server and benchmark tests.
"""

from __future__ import annotations

import os

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join the running batch.",
    "Hello world! How are you today? I am fine, thank you.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small engine that could run on every GPU.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "def main():\n    print('hello')\n",
    "Ünïcödé façade naïve café – 東京 – ☃ – 😀",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

TINY_SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96,
                  max_position_embeddings=256)
# A tiny Qwen3-MoE whose attention every GPU backend takes (head size 64: decode in CUDA
# graphs): top-8 of 16 experts. With build_tiny_checkpoint(path, "qwen3_moe", **TINY_QWEN3_MOE).
TINY_QWEN3_MOE = dict(hidden_size=256, head_dim=64, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, num_experts=16,
                      num_experts_per_tok=8, moe_intermediate_size=24, norm_topk_prob=True,
                      num_hidden_layers=2, tie_word_embeddings=False)
# A tiny DeepSeek-V2-Lite (MLA without q_lora_rank, a dense first layer, a shared expert),
# for build_tiny_checkpoint(path, "deepseek_v2", **TINY_V2_LITE).
TINY_V2_LITE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, head_dim=8,
                    qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
                    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                    first_k_dense_replace=1, num_hidden_layers=2, max_position_embeddings=256,
                    tie_word_embeddings=False, q_lora_rank=None, topk_method="greedy")


def train_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def randomize_weights(model, random_buffers: tuple[str, ...] = ()) -> None:  # noqa: ANN001
    """Noise on every parameter of a freshly made transformers model (its norms and biases
    non-trivial too), and on its buffers whose names end in ``random_buffers``."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for name, buffer in model.named_buffers():
            if random_buffers and name.endswith(random_buffers):
                buffer.add_(torch.randn_like(buffer) * 0.05)


def build_tiny_checkpoint(path: str, model_type: str = "llama", seed: int = 0,
                          dtype: torch.dtype = torch.float32,
                          random_buffers: tuple[str, ...] = (), init_model=None,
                          **overrides) -> str:
    """Save a random ``model_type`` causal LM and its tokenizer under ``path``; return path.
    ``random_buffers``: name endings of saved buffers to randomise too (transformers keeps
    DeepSeek-V3's e_score_correction_bias as a zero buffer); ``init_model``: a function of
    the random model that sets what else it needs (DeepSeek V4's token-to-expert table)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_tokenizer()
    sizes = {**TINY_SIZES, **overrides}
    sizes.setdefault("vocab_size", len(tokenizer))
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **sizes)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_weights(model, random_buffers)
    if init_model is not None:
        with torch.no_grad():
            init_model(model)
    os.makedirs(path, exist_ok=True)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _llama_cpp_permute(weight, num_heads: int):
    """The q/k row order llama.cpp's converter writes for "llama" GGUFs (pairs interleaved)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _quantize_rows(data, type_name: str):
    """GGUF blocks of ``type_name`` for a float32 [rows, cols] array: the legacy types by
    the gguf package, the K-quants by libgguf (llama.cpp's own quantizer)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):
        import libgguf
        return libgguf.quantize_rows(data, libgguf.GGMLQuantizationType[type_name]), qtype
    return gguf.quants.quantize(data, qtype), qtype


# llama.cpp's architecture name for each transformers model type (Mixtral is "llama").
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                       "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _add_moe_metadata(writer, cfg) -> None:
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _gguf_tensors(state: dict):
    """(HF module name or None, GGUF-side suffix, tensor) as llama.cpp's converter splits
    them: transformers 5's stacked experts become ffn_{gate,up,down}_exps [E, rows, cols];
    Qwen2-MoE's shared expert gate is stored as [H]."""
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            block = name.removesuffix(".gate_up_proj")
            yield f"{block}.gate_proj", "weight", gate
            yield f"{block}.up_proj", "weight", up
        elif name.endswith("mlp.experts.down_proj"):
            yield name, "weight", tensor
        elif name.endswith("shared_expert_gate.weight"):
            yield name.removesuffix(".weight"), "weight", tensor.reshape(-1)
        else:
            base, _, suffix = name.rpartition(".")
            yield base, suffix, tensor


def write_tiny_gguf(hf_dir: str, out_path: str, linear_types=None, expert_type=None) -> str:
    """Write the HF checkpoint in ``hf_dir`` as a GGUF file, the way llama.cpp's converter
    lays it out (tensor names, q/k permutation for llama, BPE tokenizer, stacked experts).
    Tensors are F32, except linear weights for which ``linear_types(hf_name)`` names a GGUF
    type (Q4_K ...) and the routed experts when ``expert_type`` names one (Q8_0 ...).
    """
    import json

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    arch_name = _GGUF_ARCHITECTURES[cfg.model_type]
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    writer = gguf.GGUFWriter(out_path, arch_name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    writer.add_rope_freq_base(rope)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _add_moe_metadata(writer, cfg)
    writer.add_file_type(0)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    for added in spec["added_tokens"]:
        if len(tokens) <= added["id"] < cfg.vocab_size:
            tokens.append(added["content"])
    special = {a["id"] for a in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch_name != "llama" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    for base, suffix, tensor in _gguf_tensors(state):
        name = f"{base}.{suffix}"
        data = tensor.numpy().astype(np.float32)
        if arch_name == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if ".experts." in base:
            type_name = expert_type
        else:
            type_name = (linear_types(name) if linear_types and name.endswith("proj.weight")
                         else None)
        if type_name:
            raw, qtype = _quantize_rows(np.ascontiguousarray(data), type_name)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


# A tiny DeepSeek-V3 (MLA with the q LoRA, sigmoid grouped routing, a dense first layer).
TINY_V3 = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, head_dim=8,
               qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               first_k_dense_replace=1, num_hidden_layers=2, max_position_embeddings=256,
               tie_word_embeddings=False, q_lora_rank=48, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, norm_topk_prob=True)

# The indexer of a tiny DeepSeek-V3.2 built on TINY_V3 (model_type deepseek_v32): 9 heads
# (with 2-3 many keys score exactly 0 after the ReLU and top-k ties break arbitrarily),
# top-4 (selection matters from the 5th position).
TINY_V32_INDEXER = dict(index_n_heads=9, index_head_dim=24, index_topk=4)


def build_tiny_mtp_checkpoint(path: str, model_type: str = "deepseek_v3",
                              predicts_next: bool = False, seed: int = 0, **overrides) -> str:
    """A tiny DeepSeek-V3-family checkpoint with one multi-token-prediction layer, laid out
    as DeepSeek's: layer N (after the N decoder layers) holds the MTP layer's decoder block,
    and its own embed_tokens, enorm, hnorm, eh_proj and shared_head (in a second file).
    transformers builds N + 1 layers and the last becomes the MTP block; it does not run
    MTP layers itself (tests hold their reference).

    ``predicts_next``: the MTP layer passes the target's hidden state through unchanged
    (eh_proj picks it, the block's output projections are zero) and reads it with the
    target's LM head, so it drafts the target's own next token: in a run of one repeated
    token, the right draft. Otherwise its weights are random."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_tokenizer()
    sizes = {**TINY_V3, **overrides}
    layers = sizes["num_hidden_layers"]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id,
                                  vocab_size=len(tokenizer),
                                  **{**sizes, "num_hidden_layers": layers + 1})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.05)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    hidden = config.hidden_size
    prefix = f"model.layers.{layers}"
    own = {f"{prefix}.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
           f"{prefix}.enorm.weight": 1 + 0.05 * torch.randn(hidden),
           f"{prefix}.hnorm.weight": 1 + 0.05 * torch.randn(hidden),
           f"{prefix}.eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
           f"{prefix}.shared_head.norm.weight": 1 + 0.05 * torch.randn(hidden),
           f"{prefix}.shared_head.head.weight": 0.1 * torch.randn(config.vocab_size, hidden)}
    if predicts_next:
        own[f"{prefix}.hnorm.weight"] = torch.ones(hidden)
        own[f"{prefix}.shared_head.norm.weight"] = torch.ones(hidden)
        own[f"{prefix}.eh_proj.weight"] = torch.cat([torch.zeros(hidden, hidden),
                                                     torch.eye(hidden)], dim=1)
        own[f"{prefix}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        _zero_block_outputs(path, prefix)
    save_file({k: v.contiguous() for k, v in own.items()},
              os.path.join(path, "mtp.safetensors"))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    saved.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    for key, value in saved.items():   # per-layer lists (V3.2's layer_types): the decoders'
        if key.endswith("_types") and isinstance(value, list) and len(value) == layers + 1:
            saved[key] = value[:layers]
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)
    return path


def _zero_block_outputs(path: str, prefix: str) -> None:
    """Zero the output projections of the decoder block ``prefix`` in the saved weights
    (o_proj, and every down projection: the block then adds nothing to its input)."""
    from safetensors.torch import load_file, save_file
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        tensors = load_file(file)
        zeroed = {k: (torch.zeros_like(v) if k.startswith(prefix + ".") and
                      (k.endswith("o_proj.weight") or "down_proj" in k) else v)
                  for k, v in tensors.items()}
        save_file(zeroed, file, metadata={"format": "pt"})
