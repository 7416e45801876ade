"""DeepSeek-V3's and V3.2's multi-token-prediction layer (models/deepseek_mtp.py) against a
reference built from transformers' own decoder layer, fp32, CPU.

The checkpoint is laid out as DeepSeek's (tiny_checkpoints.build_tiny_mtp_checkpoint):
layer N holds the MTP block and its own parts. The reference is the formula of the
DeepSeek-V3 report: h' = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]), transformers'
decoder layer of the target's family (V3.2's with its indexer) over h' (a one-layer model
fed h' as its input embeddings, its layer 0 holding layer N's weights), then shared_head's
norm and head; h_i is the target's
final hidden state from transformers. Every position in one forward, and the same
positions forward by forward over the MTP layer's paged cache, must agree.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from tiny_checkpoints import TINY_V3, TINY_V32_INDEXER, build_tiny_mtp_checkpoint

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.loader.loader import load_model
from archserve.models.deepseek_mtp import DeepseekMTP, mtp_cache_config, mtp_unsupported
from archserve.models.layers.forward_context import ForwardContext, set_forward_context
from models.helpers import PagedSequences

ATOL = 1e-4
TOKENS = [5, 17, 99, 3, 250, 41, 7, 8, 9, 120, 33, 34, 35]


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def checkpoint(request, tmp_path_factory):
    extra = TINY_V32_INDEXER if request.param == "deepseek_v32" else {}
    return build_tiny_mtp_checkpoint(str(tmp_path_factory.mktemp("tiny-mtp")), request.param,
                                     **extra)


def _reference_logits(path: str, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, vocab]: the MTP layer's logits at positions 0 .. L - 2 (row i
    reads h_i and token i + 1), by the formula, on transformers' modules."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    config = target.config
    n = config.num_hidden_layers
    weights = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(path, name)))
    own = {k.removeprefix(f"model.layers.{n}."): v for k, v in weights.items()
           if k.startswith(f"model.layers.{n}.")}
    # The per-layer lists (V3.2's) name the target's layers: the one layer's are derived.
    fields = {k: v for k, v in config.to_dict().items()
              if k != "model_type" and not k.endswith("_types")}
    one = AutoConfig.for_model(config.model_type, **{
        **fields, "num_hidden_layers": 1, "first_k_dense_replace": 0})
    state = {f"model.layers.0.{k}": v for k, v in own.items()
             if not k.startswith(("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head"))}
    state["model.norm.weight"] = own["shared_head.norm.weight"]
    state["lm_head.weight"] = own["shared_head.head.weight"]
    state["model.embed_tokens.weight"] = own["embed_tokens.weight"]
    # Saved in the checkpoint's layout, loaded by transformers (which converts it).
    block_dir = tempfile.mkdtemp()
    one.save_pretrained(block_dir)
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(block_dir, "model.safetensors"), metadata={"format": "pt"})
    block = AutoModelForCausalLM.from_pretrained(block_dir, torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = target.model(ids).last_hidden_state[0, :-1]           # h_0 .. h_{L-2}
        embedded = own["embed_tokens.weight"][ids[0, 1:]]              # t_1 .. t_{L-1}
        embedded[0] = 0.0                                              # position 0
        joined = torch.cat([rms(embedded, own["enorm.weight"]),
                            rms(hidden, own["hnorm.weight"])], dim=-1)
        h = joined @ own["eh_proj.weight"].T
        return block(inputs_embeds=h[None]).logits[0].float(), hidden


def _mtp(path: str):
    model, config = load_model(path, dtype=torch.float32, device="cpu", model_class=DeepseekMTP)
    model.allocate_hidden_buffers(64, torch.float32, torch.device("cpu"))
    cache = PagedSequences.for_config(mtp_cache_config(config))
    return model, cache


def _forward(model, cache: PagedSequences, tokens: list[int], hidden: torch.Tensor
             ) -> torch.Tensor:
    """One MTP forward of ``tokens`` (sequence 0's next inputs) reading ``hidden``."""
    ids, positions, meta, _ = cache.step({0: tokens})
    model.previous_hidden[:len(tokens)].copy_(hidden)
    ctx = ForwardContext(attn_metadata=meta, kv_caches=cache.kv_caches,
                         attn_impl=cache.attn_impl)
    assert isinstance(meta, AttentionMetadata)
    with set_forward_context(ctx):
        return model.compute_logits(model(ids, positions))


def test_mtp_layer_matches_the_reference_at_every_position(checkpoint):
    want, hidden = _reference_logits(checkpoint, TOKENS)
    model, cache = _mtp(checkpoint)
    got = _forward(model, cache, TOKENS[1:], hidden)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # The output hidden states are what a chained forward reads.
    assert model.output_hidden[:len(TOKENS) - 1].abs().sum() > 0


def test_mtp_layer_forward_by_forward_over_its_cache(checkpoint):
    """A prefill of half the positions, then one position a forward: the paged cache of
    the MTP layer holds what the later positions attend to."""
    want, hidden = _reference_logits(checkpoint, TOKENS)
    model, cache = _mtp(checkpoint)
    half = 6
    rows = [_forward(model, cache, TOKENS[1:half + 1], hidden[:half])]
    for i in range(half, len(TOKENS) - 1):
        rows.append(_forward(model, cache, [TOKENS[i + 1]], hidden[i:i + 1]))
    torch.testing.assert_close(torch.cat(rows), want, atol=ATOL, rtol=0)


def test_only_the_mtp_layers_tensors_are_read(checkpoint, monkeypatch):
    import archserve.loader.loader as loader
    read = []
    iterate = loader.iterate_safetensors

    def recording(path, wanted=None):
        for name, tensor in iterate(path, wanted):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "iterate_safetensors", recording)
    load_model(checkpoint, dtype=torch.float32, device="cpu", model_class=DeepseekMTP)
    layers = TINY_V3["num_hidden_layers"]
    assert read and all(name.startswith(f"model.layers.{layers}.") for name in read)


def test_checkpoints_without_mtp_layers_are_refused(tiny_checkpoint):
    from archserve.loader.loader import load_model_config
    config, _ = load_model_config(tiny_checkpoint("llama"))
    assert "no multi-token-prediction layers archserve runs" in mtp_unsupported(config)
