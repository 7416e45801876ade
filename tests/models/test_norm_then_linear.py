"""``apply_rms_norm_linear``: where the norm before a GEMM runs in the GEMM's kernel (the
linear routine's ``rms_norm_linear``) and where it runs on its own first (the routine
declines, or the norm is one its prologue does not compute: Gemma's offset weight)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archserve.kernels.linear.torch_linear import torch_linear
from archserve.models.layers import linear as linear_layers
from archserve.models.layers.moe import Router
from archserve.models.layers.norm import GemmaRMSNorm, RMSNorm


class RecordingRoutine:
    """torch_linear, with an ``rms_norm_linear`` that records its calls and returns
    ``fused_result`` (None: it declines)."""

    def __init__(self, fused_result):
        self.calls = []
        self.fused_result = fused_result

    def __call__(self, x, weight, bias=None):
        return torch_linear(x, weight, bias)

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias, silu_mul,
                        keep_normed):
        self.calls.append((norm_weight, eps, silu_mul, keep_normed))
        return self.fused_result


@pytest.fixture
def operands():
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    return x, residual, torch.randn(8, 16, generator=gen)


@pytest.fixture(autouse=True)
def fusion_on(monkeypatch):
    """The fusion as on a GPU (there the fused kernels' route is Triton); the norm modules
    still run their torch reference here. The linear routine is restored after."""
    monkeypatch.setattr(linear_layers, "fusion_enabled", lambda name, device: True)
    yield
    linear_layers.set_linear_routine(None)


def test_a_plain_norm_runs_in_the_routines_kernel(operands):
    x, residual, weight = operands
    norm = RMSNorm(16, 1e-5)
    marker = (torch.zeros(1), torch.zeros(1), torch.zeros(1))
    routine = RecordingRoutine(marker)
    linear_layers.set_linear_routine(routine)
    out = linear_layers.apply_rms_norm_linear(x, residual, norm, weight, keep_normed=True)
    assert out is marker
    assert routine.calls == [(norm.weight, 1e-5, False, True)]


@pytest.mark.parametrize("norm", [GemmaRMSNorm(16, 1e-5), RMSNorm(16, 1e-5)],
                         ids=["gemma-offset-weight", "declined"])
def test_otherwise_the_norm_runs_first(operands, norm):
    """Gemma's norm never reaches the routine; a plain one it declines (None) falls back.
    Either way: the norm module's own output, then the GEMM, and the normalised rows."""
    x, residual, weight = operands
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    routine = RecordingRoutine(None)
    linear_layers.set_linear_routine(routine)
    y, new_residual, normed = linear_layers.apply_rms_norm_linear(
        x, residual, norm, weight, keep_normed=True)
    expected_normed, expected_residual = norm(x, residual)
    assert torch.equal(normed, expected_normed) and torch.equal(new_residual, expected_residual)
    assert torch.equal(y, F.linear(expected_normed, weight))
    assert routine.calls == ([] if isinstance(norm, GemmaRMSNorm) else [(norm.weight, 1e-5,
                                                                         False, True)])


def test_a_router_after_a_gemma_norm_gives_its_logits_residual_and_rows(operands):
    x, residual, weight = operands
    norm = GemmaRMSNorm(16, 1e-5)
    router = Router(8, 16)
    with torch.no_grad():
        router.weight.copy_(weight)
        norm.weight.uniform_(-0.5, 0.5)
    routine = RecordingRoutine((torch.zeros(1),) * 3)
    linear_layers.set_linear_routine(routine)
    logits, new_residual, normed = router.forward_after_norm(x, residual, norm)
    expected_normed, expected_residual = norm(x, residual)
    assert routine.calls == []
    assert torch.equal(normed, expected_normed) and torch.equal(new_residual, expected_residual)
    assert torch.equal(logits, F.linear(expected_normed, weight))


# ---- norm weights folded into their readers; the residual added in a block's last GEMM

class AddingRoutine(RecordingRoutine):
    """RecordingRoutine whose ``linear_add`` adds in "the kernel" (torch here)."""

    def linear_add(self, x, weight, bias, add):
        return torch_linear(x, weight, bias) + add


def test_a_folded_norm_reaches_the_routine_without_its_weight(operands):
    x, residual, weight = operands
    norm = RMSNorm(16, 1e-5)
    norm.fold_into([weight.clone()])
    routine = RecordingRoutine((torch.zeros(1),) * 2)
    linear_layers.set_linear_routine(routine)
    linear_layers.apply_rms_norm_linear(x, residual, norm, weight)
    assert routine.calls == [(None, 1e-5, False, False)]


def test_the_last_gemm_adds_the_residual_where_the_routine_can(operands):
    x, residual, weight = operands
    linear = linear_layers.Linear(16, 8)
    with torch.no_grad():
        linear.weight.copy_(weight)
    linear_layers.set_linear_routine(AddingRoutine(None))
    out, left = linear_layers.add_in_last_gemm(linear, x, residual[:, :8])
    assert left is None and torch.equal(out, F.linear(x, weight) + residual[:, :8])
    linear_layers.set_linear_routine(RecordingRoutine(None))     # no linear_add: as before
    out, left = linear_layers.add_in_last_gemm(linear, x, residual[:, :8])
    assert torch.equal(left, residual[:, :8])
    assert torch.equal(out, F.linear(x, weight))


def test_folding_keeps_the_model_and_skips_what_cannot_absorb_a_scale(tmp_path, monkeypatch):
    """fold_norm_weights on a tiny Qwen3-MoE (attention, router and experts after the
    norms): the same logits as the unfolded model, norms of ones, the readers scaled; with
    the fusion disabled nothing changes; a quantized reader keeps its norm."""
    from archserve.loader.loader import load_model
    from archserve.models.layers.norm_folding import float_matrices, fold_norm_weights
    from models.helpers import PagedSequences, tiny_hf_model
    tiny_hf_model("qwen3_moe", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16).save_pretrained(tmp_path)
    monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
    plain, _ = load_model(str(tmp_path), torch.float32, "cpu")
    assert fold_norm_weights(plain) == 0
    monkeypatch.delenv("ARCHSERVE_DISABLE_FUSIONS")
    folded, config = load_model(str(tmp_path), torch.float32, "cpu")
    layer, plain_layer = folded.model.layers[0], plain.model.layers[0]
    assert layer.input_layernorm.folded and layer.post_attention_layernorm.folded
    assert torch.equal(layer.input_layernorm.weight,
                       torch.ones_like(plain_layer.input_layernorm.weight))
    g = plain_layer.post_attention_layernorm.weight
    torch.testing.assert_close(layer.mlp.experts.w13, plain_layer.mlp.experts.w13 * g)
    torch.testing.assert_close(layer.mlp.gate.weight, plain_layer.mlp.gate.weight * g)
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight,
                               plain_layer.self_attn.qkv_proj.weight
                               * plain_layer.input_layernorm.weight)
    logits = [PagedSequences.for_config(config).run(model, {0: [1, 5, 9, 2]})
              for model in (folded, plain)]
    torch.testing.assert_close(*logits, rtol=1e-5, atol=1e-5)
    plain_layer.self_attn.qkv_proj.quant = object()      # as a quantized layer holds
    assert float_matrices(plain_layer.self_attn.qkv_proj) is None
    assert fold_norm_weights(plain) == 2 * len(plain.model.layers) - 1


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {}),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16))],
    ids=["llama", "qwen3_moe", "qwen2_moe-shared-expert"])
def test_blocks_that_add_the_residual_keep_the_model(tmp_path, monkeypatch, model_type,
                                                     overrides):
    """The decoder layers as a GPU decode runs them: o_proj and down_proj add the residual
    in their GEMM (a routine's ``linear_add``, torch here) and the MoE adds it where it sums
    the slots (a backend's ``add``; not past Qwen2-MoE's shared expert), returning the
    residual None. The logits are those of the model without the fusion."""
    from archserve.kernels.elementwise import dispatch
    from archserve.loader.loader import load_model
    from archserve.models.layers.moe import FusedMoE
    from models.helpers import PagedSequences, tiny_hf_model
    tiny_hf_model(model_type, **overrides).save_pretrained(tmp_path)
    monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
    plain, config = load_model(str(tmp_path), torch.float32, "cpu")
    expected = PagedSequences.for_config(config).run(plain, {0: [1, 5, 9, 2]})
    monkeypatch.delenv("ARCHSERVE_DISABLE_FUSIONS")
    model, _ = load_model(str(tmp_path), torch.float32, "cpu")
    monkeypatch.setattr(dispatch, "fusion_enabled", lambda name, device: True)
    adds = []

    class Adding(AddingRoutine):
        def linear_add(self, x, weight, bias, add):
            adds.append("gemm")
            return super().linear_add(x, weight, bias, add)
    linear_layers.set_linear_routine(Adding(None))
    for experts in (m for m in model.modules() if isinstance(m, FusedMoE)):
        impl = experts.impl()

        def forward(*args, add=None, _forward=impl.forward, **kwargs):
            out = _forward(*args, **kwargs)
            if add is None:
                return out
            adds.append("moe")
            return out + add
        monkeypatch.setattr(impl, "forward", forward, raising=False)
        monkeypatch.setattr(impl, "adds_residual", True, raising=False)
    got = PagedSequences.for_config(config).run(model, {0: [1, 5, 9, 2]})
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    layers = len(model.model.layers)
    assert adds.count("gemm") == (2 * layers if model_type == "llama" else layers)
    assert adds.count("moe") == (layers if model_type == "qwen3_moe" else 0)
