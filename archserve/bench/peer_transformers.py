"""The same requests through Hugging Face transformers, as the peer to compare against.

The preferred path is transformers' own continuous batching (paged attention, one
request per prompt, each with its own ``max_new_tokens``); when that fails here, the
fallback is plain batched ``generate`` with left padding. The JSON records which path
ran as ``peer.method``. Dummy weights give the peer the same config, randomly
initialised: throughput does not depend on the values.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from archserve.bench.offline import ThroughputResult
from archserve.bench.progress import progress_bar
from archserve.bench.workload import BenchRequest

log = logging.getLogger("archserve.bench")

CB_PAGE_SIZE = 256          # tokens per KV page in transformers' continuous batching


def load_peer_model(model_path: str, load_format: str, dtype: torch.dtype,
                    device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    from archserve.loader.loader import load_model_config
    _, gguf_path = load_model_config(model_path)
    if load_format == "dummy":
        if gguf_path is not None:
            config = AutoConfig.from_pretrained(os.path.dirname(gguf_path),
                                                gguf_file=os.path.basename(gguf_path))
        else:
            config = AutoConfig.from_pretrained(model_path)
        # Built on the target device: random init of an 8B model on the host takes minutes.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif gguf_path is not None:
        from archserve.loader.transformers_gguf import transformers_model_from_gguf
        model = transformers_model_from_gguf(gguf_path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()


def _generation_config(model, ignore_eos: bool, **extra):
    from transformers import GenerationConfig
    eos = None if ignore_eos else model.config.eos_token_id
    pad = model.config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    return GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=pad, **extra)


def run_continuous_batching(model, requests: list[BenchRequest], ignore_eos: bool,
                            max_num_seqs: int, show_progress: bool) -> ThroughputResult:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    device = next(model.parameters()).device
    # The cache is sized for the workload, as ours is bounded by it too; sizing from free
    # memory is slow on a CPU and, on a GPU, leaves nothing for the fallback path.
    pages = sum(math.ceil((r.input_len + r.output_len) / CB_PAGE_SIZE) for r in requests)
    cb_options: dict = {"max_requests_per_batch": max_num_seqs,
                        "num_blocks": pages + len(requests)}
    if device.type != "cuda":
        cb_options.update(max_batch_tokens=2048, use_cuda_graph=False)
    cb_config = ContinuousBatchingConfig(**cb_options)
    gen_config = _generation_config(model, ignore_eos,
                                    max_new_tokens=max(r.output_len for r in requests))
    # No inference_mode here: transformers' batching thread updates tensors made in this
    # one, which inference mode would forbid ("Inplace update to inference tensor").
    with progress_bar(show_progress) as bar, torch.no_grad():
        task = bar.add_task("transformers (continuous batching)", total=len(requests))
        with model.continuous_batching_context_manager(
                generation_config=gen_config, continuous_batching_config=cb_config,
                block=True, timeout=30, warmup=device.type == "cuda") as manager:
            t0 = time.perf_counter()
            ids = [manager.add_request(r.prompt_token_ids, request_id=f"peer-{i}",
                                       max_new_tokens=r.output_len)
                   for i, r in enumerate(requests)]
            output_tokens, done = 0, 0
            while done < len(ids):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' batching loop stopped early")
                    continue
                if not result.is_finished():
                    continue
                if result.error is not None:
                    raise RuntimeError(f"transformers request failed: {result.error}")
                output_tokens += len(result.generated_tokens)
                done += 1
                bar.advance(task)
            elapsed = time.perf_counter() - t0
    return ThroughputResult(len(requests), sum(r.input_len for r in requests),
                            output_tokens, elapsed)


def run_padded_generate(model, requests: list[BenchRequest], ignore_eos: bool,
                        max_num_seqs: int, show_progress: bool) -> ThroughputResult:
    """Static batches of ``max_num_seqs`` prompts, left-padded; a batch runs until its
    longest request is done, which is the cost continuous batching removes."""
    device = next(model.parameters()).device
    gen_config = _generation_config(model, ignore_eos)
    pad = gen_config.pad_token_id
    eos = set() if ignore_eos else set(_as_list(model.config.eos_token_id))
    output_tokens = 0
    with progress_bar(show_progress) as bar, torch.inference_mode():
        task = bar.add_task("transformers (batched generate)", total=len(requests))
        t0 = time.perf_counter()
        for start in range(0, len(requests), max_num_seqs):
            batch = requests[start:start + max_num_seqs]
            width = max(r.input_len for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, width - r.input_len:] = torch.tensor(r.prompt_token_ids)
                mask[row, width - r.input_len:] = 1
            longest = max(r.output_len for r in batch)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=gen_config, max_new_tokens=longest,
                                 min_new_tokens=longest if ignore_eos else 0)
            for row, r in enumerate(batch):
                output_tokens += _useful_tokens(out[row, width:].tolist()[:r.output_len], eos)
            bar.advance(task, len(batch))
        elapsed = time.perf_counter() - t0
    return ThroughputResult(len(requests), sum(r.input_len for r in requests),
                            output_tokens, elapsed)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _useful_tokens(tokens: list[int], eos: set[int]) -> int:
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


def run_peer(model_path: str, load_format: str, dtype: torch.dtype, device: torch.device,
             requests: list[BenchRequest], ignore_eos: bool = True, max_num_seqs: int = 256,
             show_progress: bool = True) -> tuple[ThroughputResult, str]:
    """(throughput, method) of transformers on the same requests; method names the path."""
    model = load_peer_model(model_path, load_format, dtype, device)
    try:
        return run_continuous_batching(model, requests, ignore_eos, max_num_seqs,
                                       show_progress), "continuous_batching"
    except Exception as exc:   # any failure of the optional fast path: use the plain one
        log.warning("transformers continuous batching failed (%s); using batched generate",
                    exc)
        return run_padded_generate(model, requests, ignore_eos, max_num_seqs,
                                   show_progress), "generate_left_padded"
