"""archserve: a portable LLM inference and serving engine.

``from archserve import LLM, SamplingParams`` is the offline API. The heavy engine is
imported lazily, so ``import archserve`` (and the CLI's hardware commands) stay fast.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from archserve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from archserve.engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from archserve.engine import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'archserve' has no attribute {name!r}")
