"""The TRITON_SKINNY_GEMM linear routine: per GEMM shape, the Triton GEMV or cuBLAS,
whichever measured faster on this GPU.

Two kinds of GEMM are chosen: a plain linear, and a gate/up linear followed by
silu(gate) * up ("silu_mul"). For the second, cuBLAS then the SiLU kernel is timed
against the Triton kernel with the SiLU in its epilogue (one kernel, no [rows, 2I]
intermediate) and against the Triton GEMV then the SiLU kernel. Each (kind, rows,
out_features, in_features, dtype) a decode graph will run is timed once at start-up,
both ways, inside a CUDA graph (as the engine replays it) and cycling through
every layer's weight of that shape (as a decode step does, so a weight that would fit
in L2 is not read from there). A Triton config wins only when it is faster by a margin
and its output agrees with cuBLAS's; otherwise that shape stays on cuBLAS. The result
is saved per device and library versions, so a second start reads it instead. A gate/up
weight's product without the activation (a layer serving LoRA adapters adds their delta
between the two) runs the config its gated form timed fastest unfused.

x is always in the model dtype. A float32 weight in a 16-bit model (DeepSeek's router) is
keyed by both dtypes and timed with 16-bit x, as it runs: the GEMV converts x in its
kernel, cuBLAS's side needs a conversion kernel first (``torch_linear``).

Where a shape runs on Triton, the RMSNorm before it (fusion ``rms_norm_gemm``) can run in
the kernel's prologue or as the norm kernel first; that too is timed per shape, and the
prologue is used only where it wins. The prologue adds the squares in the same pass over
the row as the products and scales the sums by 1/rms at the end (triton_skinny_gemm.py);
as first built it read the row twice, sum of squares first, and on Llama-3-8B's
4096-wide rows that cost more than the launch it saved (H200: 216 against 129 µs per
decoder layer).

The Triton kernel runs only inside ``decode_graph_scope()``, which the engine holds while
it warms up and captures its decode graphs. Launched eagerly, the kernel's Python launch
costs more host time than the kernel takes on the device; the eager paths (prefill, and
decode without graphs) stay on cuBLAS.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from archserve.kernels.linear.torch_linear import torch_linear
from archserve.kernels.tuning_cache import read_cache, write_cache

log = logging.getLogger(__name__)

CUBLAS = "cublas"
LINEAR, SILU_MUL = "linear", "silu_mul"   # the kinds of GEMM
# A silu_mul choice "unfused:<config>" is the Triton GEMV, then the SiLU kernel: on some
# shapes (Llama-3-8B's gate/up) the fused epilogue's two weight streams per program cost
# more than the separate SiLU launch. A plain "<config>" is fused for silu_mul.
UNFUSED = "unfused:"
# A Triton config must beat cuBLAS by this fraction: below it, timing noise decides.
MIN_GAIN = 0.03
# The norm prologue must beat the norm kernel then the GEMV by this percentage (MIN_GAIN's
# 3%; step_vs_graph.py --set moves it, e.g. -5 forces a prologue that timed 5% slower).
NORM_PROLOGUE_MIN_GAIN_PERCENT = 3
# 7: the look-ahead configs (keys ending "_p") are gone; 8: the norm prologue timed as a
# folded norm's, on the residual stream's one row (fold_norm_weights); 9: the prologue
# timed at every choice (norm_choice); 10: the prologue's squares summed once; 11: the
# tiles of more than one row loaded in the product's layout, rows up to 16; 12: the
# tensor cores' configs ("_mma") from four rows
_CACHE_VERSION = 12

# (kind, out_features, in_features, dtype) -> every weight of that kind and shape
WeightGroups = dict[tuple[str, int, int, torch.dtype], list[torch.Tensor]]

_graph_scope_depth = 0


@contextmanager
def decode_graph_scope() -> Iterator[None]:
    """Within the block, linear calls may take the tuned Triton kernels (graph capture)."""
    global _graph_scope_depth
    _graph_scope_depth += 1
    try:
        yield
    finally:
        _graph_scope_depth -= 1


def shape_key(kind: str, rows: int, out_features: int, in_features: int, dtype: torch.dtype,
              weight_dtype: torch.dtype | None = None) -> str:
    """The key of one decode GEMM: ``dtype`` is x's; a weight of another dtype (a float32
    router in a 16-bit model) is named after it, "linear:1x64x2048:bfloat16:float32"."""
    key = f"{kind}:{rows}x{out_features}x{in_features}:{_dtype_name(dtype)}"
    if weight_dtype is not None and weight_dtype != dtype:
        key += f":{_dtype_name(weight_dtype)}"
    return key


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class ShapeTiming:
    """What tuning measured for one shape: µs per call for cuBLAS and each config."""
    cublas_us: float
    triton_us: dict[str, float] = field(default_factory=dict)
    chosen: str = CUBLAS
    note: str = ""
    rows: int = 1
    calls: int = 1          # weights of this shape: calls per decode step
    # The RMSNorm in a Triton choice's prologue (norm_choice: the fastest of every timed
    # choice with it, norm_fused_us) against the norm kernel then the chosen choice
    # (norm_separate_us), µs per call; the prologue runs only where fuse_norm says so, and
    # only for calls of the form it was timed in (norm_form: FOLDED or RESIDUAL,
    # _prologue_form). Its best tile need not be the GEMV's: the prologue's cost grows
    # with the GEMV's programs and its K steps (timed on an H200: +0.2 µs over the GEMV
    # alone on a 128-wide router, +4.1 on Qwen3-30B-A3B's QKV, +16 on an LM head).
    norm_fused_us: float = 0.0
    norm_separate_us: float = 0.0
    fuse_norm: bool = False
    norm_form: str = ""
    norm_choice: str = ""

    def gain_us(self) -> float:
        """Device time the choice saves per decode step (all calls of this shape)."""
        if self.chosen == CUBLAS:
            return 0.0
        return (self.cublas_us - self.triton_us[self.chosen]) * self.calls


@dataclass
class TuneReport:
    timings: dict[str, ShapeTiming] = field(default_factory=dict)
    from_cache: bool = False
    seconds: float = 0.0

    def summary(self) -> str:
        if not self.timings:
            return "no decode GEMM shapes to tune"
        won = [t for t in self.timings.values() if t.chosen != CUBLAS]
        gains = {}
        for t in self.timings.values():
            gains[t.rows] = gains.get(t.rows, 0.0) + t.gain_us()
        per_step = ", ".join(f"{gain / 1e3:.3f} ms at {rows}"
                             for rows, gain in sorted(gains.items()))
        source = "cached" if self.from_cache else f"tuned in {self.seconds:.1f}s"
        fused = sum(t.fuse_norm for t in won)
        return (f"Triton GEMV for {len(won)} of {len(self.timings)} decode GEMM shapes, cuBLAS "
                f"for the rest; saves per decode step (rows): {per_step}; RMSNorm in the "
                f"GEMV's prologue for {fused} of {len(won)} (where it timed faster); {source}")


class SkinnyGemmRoutine:
    """Called as ``routine(x, weight, bias)`` by every linear layer (set_linear_routine)."""

    def __init__(self, device=None, spec=None) -> None:
        self.choices: dict[str, str] = {}   # shape_key -> config key or CUBLAS
        # shape key -> the Triton choice that runs it with the norm in its prologue
        self.norm_choices: dict[str, str] = {}
        self.norm_form = _prologue_form()   # the calls it was timed for (_time_norm_prologue)
        self.report: TuneReport | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        chosen = self._triton(LINEAR, x, weight, bias) or torch_linear
        return chosen(x, weight, bias)

    def linear_silu_mul(self, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of x times a gate-then-up weight [2I, K] -> [.., I]."""
        chosen = self._triton(SILU_MUL, x, weight, bias) or implementation(SILU_MUL, CUBLAS)
        return chosen(x, weight, bias)

    def linear_add(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   add: torch.Tensor) -> torch.Tensor | None:
        """x W^T (+ b) + ``add`` with the add in the Triton kernel's epilogue (a layer's
        residual add in its last GEMM); None where the shape runs on cuBLAS or the operands
        do not suit (the caller then adds as before). Not timed: the epilogue reads the
        output's few values again, and the reader of the sum reads one row instead of two."""
        config = self._tuned_config(x, weight, bias)
        if config is None:
            return None
        from archserve.kernels.linear.triton_skinny_gemm import add_unsupported, skinny_gemm
        dtype = torch.promote_types(x.dtype, weight.dtype)
        if add_unsupported((x.shape[0], weight.shape[0]), dtype, add) is not None:
            return None
        return skinny_gemm(x, weight, bias, config, add=add)

    def linear_lora(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    add: torch.Tensor | None, lora_epilogue: Callable[[], Any]
                    ) -> torch.Tensor | None:
        """x W^T (+ b) (+ ``add``) plus each row's LoRA delta, added in the Triton kernel's
        epilogue: ``lora_epilogue()`` launches the adapters' shrink and returns what the
        epilogue reads (kernels/lora/triton_lora.py's LoRAEpilogue), or None where it does
        not apply. None, launching nothing, where the shape runs on cuBLAS or the operands
        do not suit (the caller then adds the delta apart). Not timed, as ``linear_add``:
        the epilogue reads the slot's B columns, which the expand's launch read anyway."""
        config = self._tuned_config(x, weight, bias)
        if config is None:
            return None
        from archserve.kernels.linear.triton_skinny_gemm import add_unsupported, skinny_gemm
        if not _product_keeps_dtype(x, weight) or (add is not None and add_unsupported(
                (x.shape[0], weight.shape[0]), x.dtype, add) is not None):
            return None
        lora = lora_epilogue()
        if lora is None:
            return None
        return skinny_gemm(x, weight, bias, config, add=add, lora=lora)

    def linear_float(self, x: torch.Tensor, weight: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``torch_linear(x, weight).float()`` (an LM head's logits) with the widening in
        the Triton kernel's epilogue, into ``out`` where it suits; None where the shape
        runs on cuBLAS or the operands do not suit. Not timed: the epilogue stores the
        output's few values at twice the width, and the conversion's launch is gone."""
        config = self._tuned_config(x, weight, None)
        if config is None:
            return None
        from archserve.kernels.linear.triton_skinny_gemm import skinny_gemm, widen_unsupported
        if out is not None and widen_unsupported(x, weight, out) is not None:
            out = None      # a new tensor, if the product itself can be widened
        if out is None and widen_unsupported(x, weight, None) is not None:
            return None
        return skinny_gemm(x, weight, None, config, widen=True, out=out)

    def rms_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor,
                        bias: torch.Tensor | None = None, silu_mul: bool = False,
                        keep_normed: bool = False,
                        lora_epilogue: Callable[[], Any] | None = None
                        ) -> tuple[torch.Tensor, ...] | None:
        """(this GEMM of rms_norm(x, norm_weight, eps, residual), the new residual, and
        with ``keep_normed`` the normalised rows) with the norm in the Triton kernel's
        prologue: one launch instead of two (``norm_weight`` None: a norm folded into
        ``weight``, RMSNorm.fold_into). None where the shape runs on cuBLAS or the
        prologue timed slower than the norm kernel (then the norm kernel runs first, as
        always). With ``lora_epilogue`` (as ``linear_lora``'s) each row's adapter delta is
        added in the epilogue; None, launching nothing, where the call or it declines."""
        kind = SILU_MUL if silu_mul else LINEAR
        if self._choice(kind, x, weight, bias) is None:
            return None
        norm_choice = self.norm_choices.get(_key(kind, x, weight))
        if norm_choice is None:
            return None
        if self.norm_form == FOLDED and (residual is not None or norm_weight is not None):
            # Timed reading x alone: with a residual (the block before could not add it)
            # or a weight (a norm that could not fold) the prologue reads more rows, which
            # on a wide GEMV cost more than the norm kernel; that form was not timed.
            return None
        from archserve.kernels.linear.triton_skinny_gemm import norm_unsupported
        if norm_unsupported(x, residual, norm_weight, weight) is not None:
            return None
        lora = None
        if lora_epilogue is not None:
            if not _product_keeps_dtype(x, weight):
                return None
            lora = lora_epilogue()
            if lora is None:
                return None
        return norm_prologue(kind, norm_choice)(x, residual, norm_weight, eps, weight, bias,
                                                keep_normed, lora)

    def _triton(self, kind: str, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None):
        """The tuned Triton path for this call as a function of (x, weight, bias), or None
        (outside the graph scope, not chosen, or operands it cannot take)."""
        chosen = self._choice(kind, x, weight, bias)
        return None if chosen is None else implementation(kind, chosen)

    def _tuned_config(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None):  # noqa: ANN202 - a SkinnyConfig or None
        """The plain linear's tuned Triton config for this call, for an epilogue form of
        it (add, widen), or None (see ``_triton``)."""
        chosen = self._choice(LINEAR, x, weight, bias)
        if chosen is None:
            return None
        from archserve.kernels.linear.triton_skinny_gemm import SkinnyConfig
        return SkinnyConfig.from_key(chosen)

    def _choice(self, kind: str, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> str | None:
        """The tuned Triton choice for this call, or None (see ``_triton``)."""
        if not (_graph_scope_depth and x.is_cuda and x.dim() == 2):
            return None
        chosen = self.choices.get(_key(kind, x, weight), CUBLAS)
        if chosen == CUBLAS:
            return None
        from archserve.kernels.linear.triton_skinny_gemm import skinny_gemm_unsupported
        if skinny_gemm_unsupported(x, weight, bias) is not None:
            return None
        return chosen

    def tune(self, groups: WeightGroups, rows: Sequence[int], cache_path: str | None,
             activation_dtype: torch.dtype | None = None) -> TuneReport:
        """Choose per shape for every row count in ``rows`` (those above the kernel's
        limit stay on cuBLAS). ``groups``: the model's linear weights by (kind,
        out_features, in_features, dtype). ``activation_dtype``: the model dtype, x's in
        every call, also with a float32 weight (timed so, as it runs); None: each
        group's own. Reads and writes ``cache_path`` when given."""
        from archserve.kernels.linear.triton_skinny_gemm import MAX_ROWS
        start = time.perf_counter()

        def key_of(kind: str, r: int, n: int, k: int, dtype: torch.dtype) -> str:
            return shape_key(kind, r, n, k, activation_dtype or dtype, dtype)
        wanted = [key_of(kind, r, n, k, dtype) for r in rows if 1 <= r <= MAX_ROWS
                  for (kind, n, k, dtype) in groups]
        cached = _read_cache(cache_path)
        if wanted and all(key in cached for key in wanted):
            report = TuneReport({key: cached[key] for key in wanted}, from_cache=True)
        else:
            report = TuneReport()
            failed: set[str] = set()
            for r in sorted({r for r in rows if 1 <= r <= MAX_ROWS}):
                for (kind, n, k, dtype), weights in groups.items():
                    shape = key_of(kind, r, n, k, dtype)
                    try:
                        report.timings[shape] = time_shape(kind, r, weights,
                                                           activation_dtype=activation_dtype)
                    except Exception as exc:  # noqa: BLE001 - cuBLAS serves; start goes on
                        log.warning("decode GEMM %s stays on cuBLAS: timing it failed (%s: %s)",
                                    shape, type(exc).__name__, exc)
                        report.timings[shape] = ShapeTiming(
                            cublas_us=0.0, rows=r, calls=len(weights),
                            note=f"timing failed: {type(exc).__name__}: {exc}")
                        failed.add(shape)
            if cache_path is not None:  # a failure is not cached: the next start retries
                _write_cache(cache_path, {**cached, **{k: t for k, t in report.timings.items()
                                                       if k not in failed}})
        report.seconds = time.perf_counter() - start
        self.choices.update({key: t.chosen for key, t in report.timings.items()})
        self.norm_choices.update({key: t.norm_choice
                                  for key, t in report.timings.items() if t.fuse_norm})
        self._choose_plain_gate_up(report)
        self.report = report
        return report

    def _choose_plain_gate_up(self, report: TuneReport) -> None:
        """Choices for the plain product of each gate/up weight (a LINEAR call of a
        SILU_MUL shape): a layer serving LoRA adapters adds their delta to gate and up
        before the activation, so it runs the GEMM alone, then the SiLU kernel. That is
        the unfused form its gated timing measured (``triton_choices``): the fastest
        unfused Triton config where it beat cuBLAS then the SiLU kernel by MIN_GAIN, with
        the norm prologue where the gated timing chose one. Without this the plain call
        found no choice and ran cuBLAS after the norm kernel."""
        for key, timing in report.timings.items():
            plain = LINEAR + key.removeprefix(SILU_MUL)
            if not key.startswith(SILU_MUL + ":") or plain in report.timings:
                continue
            unfused = {c: us for c, us in timing.triton_us.items() if c.startswith(UNFUSED)}
            best = min(unfused, key=unfused.get, default=None)
            if best is None or unfused[best] >= timing.cublas_us * (1 - MIN_GAIN):
                continue
            self.choices[plain] = best.removeprefix(UNFUSED)
            if timing.fuse_norm:
                self.norm_choices[plain] = timing.norm_choice.removeprefix(UNFUSED)


def implementation(kind: str, choice: str):
    """The function (x, weight, bias) -> output that ``choice`` names for ``kind``."""
    from archserve.kernels.elementwise import silu_and_mul
    if choice == CUBLAS:
        if kind == SILU_MUL:
            return lambda x, w, b: silu_and_mul(torch_linear(x, w, b))
        return torch_linear
    from archserve.kernels.linear.triton_skinny_gemm import SkinnyConfig, skinny_gemm
    config = SkinnyConfig.from_key(choice.removeprefix(UNFUSED))
    if choice.startswith(UNFUSED):
        return lambda x, w, b: silu_and_mul(skinny_gemm(x, w, b, config))
    return lambda x, w, b: skinny_gemm(x, w, b, config, silu_mul=kind == SILU_MUL)


def norm_prologue(kind: str, choice: str):
    """The function (x, residual, norm_weight, eps, weight, bias, keep_normed=False,
    lora=None) -> (output, new residual[, normed rows]) that runs the Triton ``choice`` for
    ``kind`` with rms_norm in its prologue (and with ``lora``, a LoRAEpilogue, each row's
    adapter delta in its epilogue)."""
    from archserve.kernels.elementwise import silu_and_mul
    from archserve.kernels.linear.triton_skinny_gemm import SkinnyConfig, rms_norm_skinny_gemm
    config = SkinnyConfig.from_key(choice.removeprefix(UNFUSED))
    fused_silu = kind == SILU_MUL and not choice.startswith(UNFUSED)

    def run(x, residual, norm_weight, eps, weight, bias, keep_normed=False, lora=None):
        y, *rest = rms_norm_skinny_gemm(x, residual, norm_weight, eps, weight, bias, config,
                                        silu_mul=fused_silu, keep_normed=keep_normed,
                                        lora=lora)
        if kind == SILU_MUL and not fused_silu:
            y = silu_and_mul(y)
        return (y, *rest)
    return run


def _product_keeps_dtype(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x W^T comes out in x's dtype: the LoRA epilogue adds its deltas in that
    dtype, so a float32 weight under 16-bit activations keeps the delta apart."""
    return torch.promote_types(x.dtype, weight.dtype) == x.dtype


def _key(kind: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    return shape_key(kind, x.shape[0], weight.shape[0], weight.shape[1], x.dtype, weight.dtype)


def triton_choices(kind: str, config_keys: Sequence[str]) -> list[str]:
    """The Triton choices the configs give for ``kind``: each config, and for silu_mul each
    config again as the GEMV followed by the SiLU kernel."""
    return list(config_keys) + ([UNFUSED + c for c in config_keys] if kind == SILU_MUL else [])


def time_shape(kind: str, rows: int, weights: list[torch.Tensor], iters: int = 10,
               choices: Sequence[str] | None = None,
               activation_dtype: torch.dtype | None = None) -> ShapeTiming:
    """cuBLAS (then the SiLU kernel, for silu_mul) and each Triton choice on one shape; the
    fastest that agrees with cuBLAS wins. ``choices`` default to ``triton_choices`` of the
    candidate configs at this row count. x is in ``activation_dtype`` (default: the
    weights' dtype); for a float32 weight with 16-bit x, cuBLAS's side includes the
    conversion of x it needs."""
    from archserve.kernels.cuda_timing import graph_median_us
    from archserve.kernels.linear.triton_skinny_gemm import (
        candidate_configs,
        skinny_gemm_unsupported,
    )
    weight = weights[0]
    x = torch.randn(rows, weight.shape[1], device=weight.device,
                    dtype=activation_dtype or weight.dtype)

    def per_call_us(gemm) -> float:
        us, how = graph_median_us(lambda: [gemm(w) for w in weights], iters, warmup=2, reps=1)
        if how != "graph":
            raise RuntimeError("the candidate could not be captured in a CUDA graph")
        return us / len(weights)

    baseline = implementation(kind, CUBLAS)
    timing = ShapeTiming(cublas_us=per_call_us(lambda w: baseline(x, w, None)), rows=rows,
                         calls=len(weights))
    unsupported = skinny_gemm_unsupported(x, weight, None)
    if unsupported is not None:
        timing.note = unsupported
        return timing
    expected = baseline(x, weight, None).float()
    best_us = timing.cublas_us * (1 - MIN_GAIN)
    if choices is None:
        choices = triton_choices(kind, [c.key() for c in candidate_configs(rows)])
    for choice in choices:
        run = implementation(kind, choice)
        try:
            got = run(x, weight, None).float()
            if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max()):
                timing.note += f"{choice}: disagrees with cuBLAS; "
                continue
            us = per_call_us(lambda w, run=run: run(x, w, None))
        except Exception as exc:  # noqa: BLE001 - a config that fails is skipped, and said so
            timing.note += f"{choice}: {type(exc).__name__}: {exc}; "
            continue
        timing.triton_us[choice] = us
        if us < best_us:
            best_us, timing.chosen = us, choice
    if timing.chosen != CUBLAS:
        _time_norm_prologue(timing, kind, x, weight, per_call_us)
    return timing


def _time_norm_prologue(timing: ShapeTiming, kind: str, x: torch.Tensor, weight: torch.Tensor,
                        per_call_us) -> None:
    """Each timed Triton choice with RMSNorm in its prologue; the fastest, timed again (the
    least of several noisy timings is biased low), against the norm kernel then the chosen
    choice (as the decoder layer runs them); the prologue is chosen where it is faster by
    MIN_GAIN. A prologue that fails, disagrees with the norm kernel then the GEMM, or cannot
    take these operands, is not chosen, and said. Timed in the form a decode step runs it:
    where the norm weights are folded into the GEMMs (``fold_norm_weights``), the layer's
    last GEMM before has added the residual, so the prologue reads one row and no weight;
    otherwise it adds the residual and reads the norm's weight."""
    from archserve.kernels.elementwise import rms_norm
    from archserve.kernels.linear.triton_skinny_gemm import norm_unsupported
    # The weight first: the norm kernels read it before PDL's wait (kernels/pdl.py), so the
    # kernel launched right before their first call must not be the one that wrote it.
    norm_weight = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
    timing.norm_form = _prologue_form()
    folded = timing.norm_form == FOLDED
    residual = None if folded else torch.randn_like(x)
    unsupported = norm_unsupported(x, residual, norm_weight, weight)
    if unsupported is not None:
        timing.note += f"norm prologue: {unsupported}; "
        return
    run = implementation(kind, timing.chosen)

    def separate(w):
        normed, new_residual = rms_norm(x, norm_weight, 1e-6, residual)
        return run(normed, w, None), new_residual
    timing.norm_separate_us = per_call_us(separate)
    expected = separate(weight)[0].float()
    prologue_weight = None if folded else norm_weight

    def prologue_us(fused) -> float:  # noqa: ANN001 - a norm_prologue function
        return per_call_us(lambda w: fused(x, residual, prologue_weight, 1e-6, w, None))
    fastest, fastest_fused = float("inf"), None
    for choice in timing.triton_us:     # the choices that ran and agreed with cuBLAS
        fused = norm_prologue(kind, choice)
        try:
            got = fused(x, residual, prologue_weight, 1e-6, weight, None)[0].float()
            if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max()):
                timing.note += f"norm prologue {choice}: disagrees with the norm kernel; "
                continue
            us = prologue_us(fused)
        except Exception as exc:  # noqa: BLE001 - the norm kernel serves, and the note says why
            timing.note += f"norm prologue {choice}: {type(exc).__name__}: {exc}; "
            continue
        if us < fastest:
            timing.norm_choice, fastest, fastest_fused = choice, us, fused
    if fastest_fused is None:
        return
    timing.norm_fused_us = prologue_us(fastest_fused)
    timing.fuse_norm = timing.norm_fused_us < timing.norm_separate_us * (
        1 - NORM_PROLOGUE_MIN_GAIN_PERCENT / 100)


def _read_cache(path: str | None) -> dict[str, ShapeTiming]:
    """The cached timings whose norm prologue was timed in this start's form (a start with
    ``fold_norm_weights`` toggled times its shapes again)."""
    form = _prologue_form()
    return {key: timing for key, timing in
            read_cache(path, _CACHE_VERSION, "shapes", ShapeTiming).items()
            if timing.norm_form in (form, "")}


# The norm prologue's two forms. FOLDED: the fusion fold_norm_weights is on, so the norm's
# weight is in the GEMM's and the block before added the residual: the prologue reads x
# alone. RESIDUAL: it adds the residual and reads the norm's weight.
FOLDED, RESIDUAL = "folded", "residual"


def _prologue_form() -> str:
    from archserve.kernels.elementwise.dispatch import fusion_not_disabled
    return FOLDED if fusion_not_disabled("fold_norm_weights") else RESIDUAL


def _write_cache(path: str, timings: dict[str, ShapeTiming]) -> None:
    write_cache(path, _CACHE_VERSION, "shapes", timings)
