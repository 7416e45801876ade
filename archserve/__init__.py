"""archserve: a portable LLM inference and serving engine.

``from archserve import LLM, SamplingParams`` is the offline API. The heavy engine is
imported lazily, so ``import archserve`` (and the CLI's hardware commands) stay fast.
"""

import os

# CPU threads must not spin between parallel regions. torch's OpenMP runtime (Intel's,
# with MKL) keeps each worker spinning for 200 ms after every region by default; on a busy
# machine the spinning workers take the cores from the one doing the work, and a decode
# step of the embedded model went from 0.21 s (idle) to 1.3-4.4 s (two other busy
# processes on 2 cores). With blocktime 0 it took 0.25 s there and the same 0.21 s idle
# (`archserve bench` on the embedded model). The runtime reads this when it starts, so it is set
# here, before anything imports torch; a value the user set is kept.
os.environ.setdefault("KMP_BLOCKTIME", "0")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput",
           "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from archserve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from archserve.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "LoRARequest":
        from archserve.engine.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from archserve.engine import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'archserve' has no attribute {name!r}")
