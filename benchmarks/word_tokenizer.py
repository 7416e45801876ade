"""A tokenizer with one word per id of a model's whole vocabulary, for serving benchmarks of
config-only models with dummy weights.

Such a model samples ids anywhere in its vocabulary; a smaller tokenizer decodes the ids past
its end to no text, so a streamed response sends no chunk for them and the client-side
latencies (TPOT, ITL) measure nothing. Here every id decodes to a word ("w123"), so every
token is one streamed delta, as with a real tokenizer.

    python3 benchmarks/word_tokenizer.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys


def build_word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(len(specials),
                                                                            vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def main(model_dir: str, out_dir: str) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    build_word_tokenizer(vocab_size).save_pretrained(out_dir)
    print(f"{out_dir}: {vocab_size} ids")


if __name__ == "__main__":
    main(*sys.argv[1:3])
