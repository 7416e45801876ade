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


def build_tiny_checkpoint(path: str, model_type: str = "llama", seed: int = 0,
                          dtype: torch.dtype = torch.float32, **overrides) -> str:
    """Save a random ``model_type`` causal LM and its tokenizer under ``path``; return path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_tokenizer()
    sizes = {**TINY_SIZES, **overrides}
    sizes.setdefault("vocab_size", len(tokenizer))
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **sizes)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases non-trivial too
            param.add_(torch.randn_like(param) * 0.05)
    os.makedirs(path, exist_ok=True)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
