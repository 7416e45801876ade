"""The offline API: ``LLM(...).generate(prompts, sampling_params)``, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import fields, replace

from archserve.engine.config import EngineConfig
from archserve.engine.llm_engine import LLMEngine
from archserve.engine.lora.request import LoRARequest
from archserve.engine.outputs import RequestOutput
from archserve.engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict
Message = dict[str, str]


class LLM:
    """Load a model once and generate for batches of prompts.

    Keyword arguments are EngineConfig fields (vLLM's names): ``dtype``,
    ``attention_backend``, ``enforce_eager``, ``gpu_memory_utilization``,
    ``max_model_len``, ``load_format``, ``seed``, ``max_num_seqs``, ...
    """

    def __init__(self, model: str | None = None, dtype: str = "auto",
                 attention_backend: str | None = None, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 load_format: str = "auto", seed: int = 0, **kwargs) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(unknown)}; "
                            f"valid: {', '.join(sorted(known))}")
        self.config = EngineConfig(
            model=model, dtype=dtype, attention_backend=attention_backend,
            enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, load_format=load_format, seed=seed, **kwargs)
        self.llm_engine = LLMEngine(self.config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | SequenceOf[Prompt],
                 sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        Every prompt is validated before any is queued, so one bad prompt raises
        ValueError without leaving the others half-submitted. ``lora_request``: one adapter
        for every prompt, or one (or None) per prompt (needs ``enable_lora=True``).
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        # Only final outputs are returned: the engine then skips per-step output work.
        params_list = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(lora_list)} LoRA "
                                 f"requests")
        engine = self.llm_engine
        # Each prompt is validated and tokenized once, as its request is checked (its own
        # truncate_prompt_tokens included); none is queued until all are.
        prepared = [engine.prepare_request(None, _prompt_value(p), sp, lora_request=lora)
                    for p, sp, lora in zip(prompt_list, params_list, lora_list, strict=True)]
        # Grammars compile in parallel on the compiler's threads; a bad one is a ValueError
        # before anything is queued.
        engine.wait_for_grammars(prepared)
        ids_in_order = [engine.queue_request(state) for state in prepared]
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(ids_in_order)) if use_tqdm else None
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if progress:
                            progress.advance(progress.task_ids[0])
        except BaseException:
            for rid in ids_in_order:
                engine.abort_request(rid)
            raise
        finally:
            if progress:
                progress.stop()
        return [finished[rid] for rid in ids_in_order]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        from archserve.loader.tokenizer import apply_chat_template
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.get_tokenizer(), conv,
                                       add_generation_prompt=add_generation_prompt)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]   # one prompt given as token ids
    return prompts


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return prompt


def _progress(total: int):
    from rich.progress import Progress
    progress = Progress(transient=True)
    progress.add_task("generating", total=total)
    progress.start()
    return progress
