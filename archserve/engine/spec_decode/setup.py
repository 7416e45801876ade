"""Start-up of speculative decoding: what a config asks of the target, the draft network it
loads, and the decision that says what runs.

``plan_speculation`` reads configs only (explain and doctor call it too); the engine then
loads the draft network (``load_draft_network``: the draft model, or the checkpoint's MTP
layers), gives it a ModelRunner of its own (``draft_runner``) and builds the speculator.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from archserve.engine.spec_decode.speculator import Speculator
from archserve.engine.speculative_config import SpeculativeConfig
from archserve.platform.decision import Decision

log = logging.getLogger("archserve")

_VERIFY = ("one target forward verifies each sequence's drafts (greedy: accepted while "
           "they are the argmax; sampled: rejection sampling, lossless); a step with drafts "
           "resolves before the next is scheduled")


def plan_speculation(config: SpeculativeConfig, target, target_path: str | None = None
                     ) -> tuple[SpeculativeConfig, Decision]:
    """``config`` completed for the ``target`` ModelConfig (mtp: its layer count as the
    default number of drafts), and the decision saying what will run; ValueError when the
    target or the draft cannot (read from configs and tokenizers, no weights).
    ``target_path``: the target's checkpoint, whose tokenizer a draft model's must match."""
    verify = _VERIFY
    if getattr(target, "compressed_attention", None) is not None:
        verify += ("; a sequence with a rejected draft gets its window ring rows and "
                   "compressor sums back and computes the step's accepted tokens again in "
                   "the next (spec_decode/cache_rollback.py)")
    if config.method == "ngram":
        return config, Decision("speculative decoding", "ngram", "ngram",
                                f"{config.describe()}; {verify}")
    if config.method == "mtp":
        from archserve.models.deepseek_mtp import mtp_unsupported, num_mtp_layers
        reason = mtp_unsupported(target)
        if reason is not None:
            raise ValueError(f"speculative_config method mtp: {reason}")
        layers = num_mtp_layers(target)
        if config.num_speculative_tokens is None:
            config = dataclasses.replace(config, num_speculative_tokens=layers)
        reuse = ("" if config.num_speculative_tokens <= layers else
                 f"; {config.num_speculative_tokens} drafts from {layers} layer(s): the "
                 f"layers run again in turn")
        return config, Decision(
            "speculative decoding", "mtp", "mtp",
            f"{config.describe()} ({target.architecture}: {layers} MTP layer(s) after "
            f"layer {target.num_layers - 1}, greedy, their KV cache in the target's "
            f"blocks){reuse}; {verify}")
    from archserve.loader.loader import load_model_config, resolve_model_path
    draft, _ = load_model_config(resolve_model_path(config.model))
    if getattr(draft, "compressed_attention", None) is not None:
        raise ValueError(f"speculative_config draft model {config.model}: "
                         f"{draft.architecture} keeps its window's keys in a ring per "
                         f"sequence, which a draft network's cache (in the target's blocks) "
                         f"does not have; use another draft model or ngram")
    if draft.vocab_size > target.vocab_size:
        raise ValueError(f"speculative_config draft model {config.model}: its vocabulary "
                         f"({draft.vocab_size} tokens) is larger than the target's "
                         f"({target.vocab_size}); the draft must share the target's tokenizer")
    return config, Decision(
        "speculative decoding", "draft_model", "draft_model",
        f"{config.describe()} ({draft.architecture}, {draft.num_layers} layers, greedy, its "
        f"KV cache in the target's blocks; {_same_tokenizer(target_path, config.model)}); "
        f"{verify}")


def verification_graphs_text(backend, rows_per_seq: int) -> str:
    """How verification steps of ``rows_per_seq`` (1 + k) query tokens a sequence run over
    the target's attention ``backend`` (a registry backend) with CUDA graphs on: what
    explain says. The engine's start-up decisions ("cudagraph_mode", the decode graph
    sizes) say what it captured."""
    from archserve.engine.mixed_graphs import mixed_step_query_limit
    if not backend.graph_capturable:
        return f"verification steps run eagerly ({backend.name} is not captured in CUDA graphs)"
    captured, _ = mixed_step_query_limit(backend, rows_per_seq)
    buckets = "mixed-step CUDA graphs per token bucket (cudagraph_mode FULL)"
    rows_limit = backend.decode_rows_max_query_len
    if 1 < rows_per_seq <= rows_limit:
        return (f"verification steps run as decode rows, each of a sequence's {rows_per_seq} "
                f"tokens a row of {backend.name}'s decode kernel with its own causal length, "
                f"in the decode CUDA graph of (sequences x {rows_per_seq}) rows; a step of "
                f"more rows than the largest graph "
                + (f"replays {buckets}" if captured else "runs eagerly"))
    why = (f"{backend.name} runs at most {rows_limit} query tokens a sequence as decode rows"
           if rows_limit > 1 else f"{backend.name}'s decode path takes no decode rows")
    if not captured:
        return (f"verification steps run eagerly ({backend.name}'s CUDA graphs capture "
                f"decode steps only; {why})")
    return f"verification steps replay {buckets} ({backend.name}; {why})"


def _same_tokenizer(target_path: str | None, draft_path: str) -> str:
    """How the draft model's tokenizer was checked against the target's: every draft token
    must have the target's id (ValueError where one does not)."""
    from archserve.loader.loader import resolve_model_path
    from archserve.loader.tokenizer import has_tokenizer, load_tokenizer
    paths = [resolve_model_path(target_path), resolve_model_path(draft_path)]
    if not all(has_tokenizer(p) for p in paths):
        return "tokenizers not compared: a checkpoint has none"
    target, draft = (load_tokenizer(p).get_vocab() for p in paths)
    other = [token for token, index in draft.items() if target.get(token) != index]
    if other:
        raise ValueError(f"speculative_config draft model {draft_path}: its tokenizer is not "
                         f"the target's ({len(other)} of its {len(draft)} tokens have another "
                         f"id there, e.g. {other[:3]})")
    return "its tokenizer the target's"


def load_draft_network(config: SpeculativeConfig, target_path: str | None, target,
                       dtype: torch.dtype, device: torch.device, load_format: str):
    """(the draft network, its ModelConfig for its KV cache) on ``device`` in ``dtype``:
    the draft model, or the target checkpoint's MTP layers."""
    from archserve.loader.loader import load_model
    if config.method == "mtp":
        from archserve.models.deepseek_mtp import DeepseekMTP, mtp_cache_config
        model, _ = load_model(target_path, dtype=dtype, device=device, load_format=load_format,
                              model_class=DeepseekMTP)
        return model, mtp_cache_config(target)
    return load_model(config.model, dtype=dtype, device=device, quantization=config.quantization,
                      load_format="dummy" if load_format == "dummy" else "auto")


def draft_runner(network, network_config, device, engine_config, dtype: torch.dtype,
                 kv_cache_dtype: str, torch_device: torch.device, block_size: int,
                 max_model_len: int, max_tokens: int, attn_impl=None):  # noqa: ANN001
    """A ModelRunner for the draft network, no sampler: ``attn_impl``, the target's where
    the network's attention has the target's shapes (MTP layers: selected, canaried and
    tuned already), else one selected (and canaried) for its own shapes at the target's
    block size. ``max_tokens``: the most inputs one of its forwards takes (an MTP
    network's hidden-state buffers are that long)."""
    from archserve.engine import startup
    from archserve.engine.model_runner import ModelRunner
    if network_config.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model's context ({network_config.max_position_embeddings} "
                         f"tokens) is shorter than max_model_len ({max_model_len}); lower "
                         f"max_model_len")
    if attn_impl is None:
        config = dataclasses.replace(engine_config, block_size=block_size,
                                     attention_backend=None)
        selection, attn_impl, _ = startup.select_attention_with_canary(
            device, config, network_config, dtype, kv_cache_dtype, torch_device)
        log.info("draft network attention: %s", selection.name)
    allocate = getattr(network, "allocate_hidden_buffers", None)
    if allocate is not None:
        allocate(max_tokens, dtype, torch_device)
    return ModelRunner(network, network_config, torch_device, dtype, attn_impl, block_size,
                       max_model_len, None)


def build_speculator(config: SpeculativeConfig, max_model_len: int, runner=None) -> Speculator:
    """The engine's speculator for ``config`` (``runner``: the draft network's ModelRunner
    for draft_model and mtp)."""
    if config.method == "ngram":
        from archserve.engine.spec_decode.ngram import NgramProposer
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                 config.prompt_lookup_max)
    else:
        from archserve.engine.spec_decode.drafter import DraftNetwork, ModelDrafter
        from archserve.engine.spec_decode.mtp import MTPNetwork
        network = MTPNetwork(runner) if config.method == "mtp" else DraftNetwork(runner)
        proposer = ModelDrafter(network, config.num_speculative_tokens)
    return Speculator(config, proposer, max_model_len)


def capture_draft_graphs(runner, graph_sizes: list[int], mixed_tokens: int,
                         max_num_seqs: int, max_query_len: int | None = None) -> Decision:
    """The draft network's CUDA graphs: its chained one-token forwards at the decode sizes,
    and its forward over a step's inputs at the mixed-step buckets where the target has
    those (``max_query_len``: the target's limit on a captured step's tokens a sequence,
    which the draft's forward after a verification keeps: at most k + 1); the decision
    saying which."""
    layers = len(getattr(runner.model, "layers", ())) if hasattr(runner.model, "current") else 1
    if layers > 1:
        return Decision("draft network CUDA graphs", "on", "off",
                        f"the {layers} MTP layers take turns, and a graph would replay the "
                        f"one it captured: the draft forwards run eagerly")
    runner.capture_cuda_graphs(graph_sizes)
    captured = f"decode sizes {runner.graphs.set.sizes}"
    if mixed_tokens:
        try:
            runner.capture_mixed_graphs(mixed_tokens, max_num_seqs,
                                        max_query_len=max_query_len)
            reason = runner.replay_mixed_canary()
        except Exception as exc:  # noqa: BLE001 - the draft's steps then run eagerly
            reason = f"{type(exc).__name__}: {exc}"
        if reason is None and runner.mixed_graphs.set.sizes:
            captured += f"; steps' inputs at token buckets {runner.mixed_graphs.set.sizes}"
        else:
            runner.mixed_graphs = None
            captured += f"; steps' inputs eagerly ({reason or 'no bucket captured'})"
    return Decision("draft network CUDA graphs", "on", "on", captured)
