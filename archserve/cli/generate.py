"""`archserve generate` and `archserve chat`: the engine from a terminal."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="HF directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="Tokens to generate at most.")]
TempOpt = Annotated[float, typer.Option("--temperature", help="0 = greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="0 = disabled.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Per-request seed for reproducible sampling.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto, bfloat16, float16, float32.")]
BackendOpt = Annotated[str | None, typer.Option("--attention-backend", help="Force an attention backend (validated; see `archserve explain`).")]
EagerOpt = Annotated[bool, typer.Option("--enforce-eager", help="Disable CUDA graphs.")]
CompilationOpt = Annotated[str | None, typer.Option("--compilation-config", "-O", help='vLLM\'s compilation config as JSON, or a level. On a CPU the level decides the decode steps: 1-3 compile them with inductor (batch 1, or cudagraph_capture_sizes), about twice as fast as eager; the default is 3 ($ARCHSERVE_COMPILATION_LEVEL changes it): a model\'s first start compiles (~40 s on 2 cores), later starts load torch\'s caches in seconds; -O0 runs them eager. On a GPU archserve takes cudagraph_mode (FULL, the default: steps with prompt tokens replay CUDA graphs too; FULL_DECODE_ONLY: decode steps only; NONE) and cudagraph_capture_sizes, e.g. \'{"cudagraph_mode": "FULL"}\'.')]
SpeculativeOpt = Annotated[str | None, typer.Option("--speculative-config", help='vLLM\'s speculative config as JSON: \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\', \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' or \'{"method": "mtp"}\' (DeepSeek-V3 checkpoints\' next-token layers). Drafted tokens are verified by one forward of the model; the output is what decoding without them gives.')]
AsyncSchedulingOpt = Annotated[bool | None, typer.Option("--async-scheduling/--no-async-scheduling", help="Schedule the next step while the device runs this one (outputs one step later). Default: on for CUDA, off on CPU.")]
MaxNumSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", help="Sequences in one batch at most.")]
LoadFormatOpt = Annotated[str, typer.Option("--load-format", help="auto, safetensors, gguf or dummy.")]
MaxLenOpt = Annotated[int | None, typer.Option("--max-model-len", help="Context length cap (default: the model's, lowered with a notice to what the KV cache holds; one that does not fit is an error before the load).")]
QuantOpt = Annotated[str | None, typer.Option("--quantization", "-q", help="Default: the checkpoint's own scheme; fp8 quantizes a 16-bit checkpoint at load (checked against the checkpoint).")]
TPOpt = Annotated[int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="Ranks to split the model over: one worker process per GPU (gloo ranks share the cores on a CPU).")]
ExecutorOpt = Annotated[str, typer.Option("--distributed-executor-backend", help="mp (worker processes on this machine) or ray (actors of a Ray cluster; see docs/tensor-parallel.md).")]
BatchedTokensOpt = Annotated[int | None, typer.Option("--max-num-batched-tokens", min=1, help="Tokens one step computes at most (the chunked-prefill budget: smaller keeps decodes from waiting behind long prompts, larger fills the device). Default: the engine's.")]
TargetItlOpt = Annotated[str, typer.Option("--target-itl-ms", help="Inter-token latency that a step carrying decodes should stay within; its token budget is the largest chunk whose measured step cost fits (stall-free chunked prefill). auto: 3x a decode step of 16 sequences (fewer if --max-num-seqs is smaller); off: no bound (every step may take --max-num-batched-tokens); or milliseconds. A given --max-num-batched-tokens fixes every step's budget instead (auto is then ignored; a number is an error).")]
PrefixCachingOpt = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse the KV blocks of a prompt prefix seen before.")]
ChunkedPrefillOpt = Annotated[bool, typer.Option("--enable-chunked-prefill/--no-enable-chunked-prefill", help="Split long prompts over steps, beside the running decodes.")]
KvCacheDtypeOpt = Annotated[str, typer.Option("--kv-cache-dtype", help="auto (the model dtype), fp8 / fp8_e4m3 or fp8_e5m2: half the KV bytes per token; scales from the checkpoint when it has them. A sparse-MLA model (DeepSeek-V3.2, GLM-5) keeps fp8 as fp8_ds_mla.")]
IndexCacheDtypeOpt = Annotated[str, typer.Option("--index-cache-dtype", help="Sparse MLA's indexer keys: auto (the model dtype, or fp8 beside an fp8 latent) or fp8 (as vLLM keeps them).")]
CalculateKvScalesOpt = Annotated[bool, typer.Option("--calculate-kv-scales", help="With an fp8 KV cache: measure each layer's k/v scales on the first prompt (the checkpoint's own scales otherwise, else 1.0).")]
EnableLoraOpt = Annotated[bool, typer.Option("--enable-lora", help="Serve LoRA adapters (PEFT directories) over the model: each request may run with one.")]
MaxLorasOpt = Annotated[int, typer.Option("--max-loras", min=1, help="Distinct LoRA adapters in one batch at most (each linear layer holds this many adapter slots on the device).")]
MaxLoraRankOpt = Annotated[int, typer.Option("--max-lora-rank", help="The largest adapter rank served: 1, 8, 16, 32, 64, 128, 256, 320 or 512 (slots are this wide).")]
MaxCpuLorasOpt = Annotated[int | None, typer.Option("--max-cpu-loras", min=1, help="LoRA adapters kept read in host memory (least recently used evicted; default: --max-loras).")]
EmulateOpt = Annotated[str | None, typer.Option("--emulate-device", help="Run on this GPU with the capability model of a device profile (v100, t4, a100, a10, l40s, rtx4090, ...): its dtypes, features, shared-memory limits, routes and tiles, as `archserve explain --device PROFILE` shows them. Refused, with the reason, where this GPU cannot execute that profile's kernels.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Log the start-up route.")]


def parse_target_itl(text: str) -> float | str | None:
    """--target-itl-ms: 'auto', 'off' (None) or a positive number of milliseconds."""
    text = text.strip().lower()
    if text in ("auto", "off"):
        return None if text == "off" else "auto"
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise typer.BadParameter(f"expected auto, off or a positive number of ms, got {text!r}",
                                 param_hint="--target-itl-ms")
    return value


def _engine(model, dtype, attention_backend, enforce_eager, load_format, max_model_len, verbose,
            quantization=None, tensor_parallel_size=1, distributed_executor_backend="mp",
            speculative_config=None, emulate_device=None, compilation_config=None):
    import logging

    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(model=model, dtype=dtype, attention_backend=attention_backend,
                          enforce_eager=enforce_eager, load_format=load_format,
                          max_model_len=max_model_len, max_num_seqs=8,
                          quantization=quantization, tensor_parallel_size=tensor_parallel_size,
                          distributed_executor_backend=distributed_executor_backend,
                          speculative_config=speculative_config,
                          emulate_device=emulate_device, compilation_config=compilation_config)
    return LLMEngine(config)


def _params(max_tokens, temperature, top_p, top_k, seed):
    from archserve.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed)


def generate(prompt: Annotated[str, typer.Argument(help="The prompt text.")],
             model: ModelOpt = None, max_tokens: MaxTokensOpt = 64, temperature: TempOpt = 0.0,
             top_p: TopPOpt = 1.0, top_k: TopKOpt = 0, seed: SeedOpt = None,
             chat_template: Annotated[bool, typer.Option("--chat/--raw", help="Send PROMPT raw, as a completion (default, as vLLM's generate does), or wrapped in the model's chat template.")] = False,
             dtype: DtypeOpt = "auto", attention_backend: BackendOpt = None,
             enforce_eager: EagerOpt = False, compilation_config: CompilationOpt = None,
             load_format: LoadFormatOpt = "auto",
             max_model_len: MaxLenOpt = None, verbose: VerboseOpt = False,
             quantization: QuantOpt = None, tensor_parallel_size: TPOpt = 1,
             distributed_executor_backend: ExecutorOpt = "mp",
             speculative_config: SpeculativeOpt = None,
             emulate_device: EmulateOpt = None) -> None:
    """Generate a completion for PROMPT, streamed to the terminal."""
    from archserve.engine.streaming import stream_text
    from archserve.loader.tokenizer import apply_chat_template
    try:
        engine = _engine(model, dtype, attention_backend, enforce_eager, load_format,
                         max_model_len, verbose, quantization, tensor_parallel_size,
                         distributed_executor_backend, speculative_config, emulate_device,
                         compilation_config)
        params = _params(max_tokens, temperature, top_p, top_k, seed)
        request = (apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
                   if chat_template else prompt)
        for delta, _ in stream_text(engine, request, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def chat(model: ModelOpt = None, max_tokens: MaxTokensOpt = 256, temperature: TempOpt = 0.7,
         top_p: TopPOpt = 0.9, top_k: TopKOpt = 0, seed: SeedOpt = None,
         system: Annotated[str | None, typer.Option("--system", help="A system message.")] = None,
         dtype: DtypeOpt = "auto", attention_backend: BackendOpt = None,
         enforce_eager: EagerOpt = False, compilation_config: CompilationOpt = None,
         load_format: LoadFormatOpt = "auto",
         max_model_len: MaxLenOpt = None, verbose: VerboseOpt = False,
         quantization: QuantOpt = None, tensor_parallel_size: TPOpt = 1,
         distributed_executor_backend: ExecutorOpt = "mp",
         speculative_config: SpeculativeOpt = None,
         emulate_device: EmulateOpt = None) -> None:
    """Chat with a model in the terminal; replies stream token by token.

    Type a message and press Enter. /help lists the commands: /reset clears the
    conversation, /exit (or Ctrl-D) quits. Input may also be piped: one message per line.
    """
    from archserve.engine.streaming import stream_text
    from archserve.loader.tokenizer import apply_chat_template
    try:
        engine = _engine(model, dtype, attention_backend, enforce_eager, load_format,
                         max_model_len, verbose, quantization, tensor_parallel_size,
                         distributed_executor_backend, speculative_config, emulate_device,
                         compilation_config)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    interactive = sys.stdin.isatty()
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    if interactive:
        typer.echo("archserve chat - /help lists the commands, /exit quits.")
    while True:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        message = line.strip()
        if not message:
            continue
        command = _chat_command(message)
        if command == "/exit":
            break
        if command == "/reset":
            history = history[:1] if system else []
            typer.echo("(conversation cleared)")
            continue
        if command is not None:   # /help, or a command it does not know: never sent
            typer.echo(_CHAT_HELP if command == "/help" else
                       f"unknown command {message.split()[0]}; /help lists the commands")
            continue
        history.append({"role": "user", "content": message})
        params = _params(max_tokens, temperature, top_p, top_k, seed)
        try:
            prompt = apply_chat_template(engine.tokenizer, history)
            reply = []
            for delta, _ in stream_text(engine, prompt, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except ValueError as exc:   # e.g. the conversation outgrew the context
            history.pop()
            typer.echo(f"\nerror: {exc}", err=True)
            continue
        # A reply may hold blank lines of its own: a rule says where it ends.
        sys.stdout.write("\n" + _TURN_SEPARATOR + "\n")
        history.append({"role": "assistant", "content": "".join(reply)})


_CHAT_COMMANDS = {"/help": "list these commands",
                  "/reset": "clear the conversation (a --system message stays)",
                  "/exit": "quit (also /quit, or Ctrl-D)"}
_CHAT_HELP = "\n".join(f"  {name:<7} {what}" for name, what in _CHAT_COMMANDS.items())
_TURN_SEPARATOR = "─" * 40


def _chat_command(message: str) -> str | None:
    """The command a line is (/quit is /exit), an unknown "/word" as itself, or None for a
    message to the model."""
    if not message.startswith("/"):
        return None
    word = message.split()[0].lower()
    return "/exit" if word == "/quit" else word
