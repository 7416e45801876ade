"""Doctor (seed 001 §4.1-4.2): is this machine fit to run archserve, and how would it run?

Device and memory, the driver / runtime / torch-build verdict, the arch-list
verdict, every toolchain finding with its remedy, and for each op kind the backend
selection would choose here - with the reason every other backend was not chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from archserve.kernels.catalog import default_registry
from archserve.kernels.registry import BackendError, LibraryAssumption
from archserve.kernels.specs import AttentionSpec, LinearSpec, MoESpec
from archserve.models.registry import op_kinds_of_supported_architectures
from archserve.platform.decision import Decision
from archserve.platform.device import DeviceInfo
from archserve.platform.emulation import emulation_refusal, emulation_summary, narrow
from archserve.platform.profiles import get_profile
from archserve.platform.toolchain import Finding, arch_verdict, diagnose, three_layer_verdict
from archserve.quant.config import explain_quant_config
from archserve.quant.plan import (
    keeps_gguf_quantized,
    lm_head_decision,
    lm_head_spec,
    plan_quantization,
)
from archserve.routing.dtypes import resolve_dtype
from archserve.routing.explain import (
    DEEPSEEK_V3_MLA,
    DEEPSEEK_V32_INDEXER,
    Route,
    device_dict,
    explain_op,
)

# Op kinds the engine cannot run without; MLA and MoE only matter for such models.
REQUIRED_OPS = ("attention", "linear")


@dataclass
class OpReport:
    route: Route | None
    error: str | None = None
    others: list[tuple[str, str]] = field(default_factory=list)   # not tried: (name, why)

    def to_dict(self) -> dict[str, Any]:
        out = self.route.to_dict() if self.route else {"backend": None}
        out["error"] = self.error
        out["others"] = [{"backend": n, "reason": r} for n, r in self.others]
        return out


@dataclass
class DoctorReport:
    device: DeviceInfo
    decisions: list[Decision]
    toolchain_ok: bool
    toolchain_text: str
    arch_ok: bool
    arch_text: str
    findings: list[Finding]
    ops: dict[str, OpReport]
    blockers: list[str]

    @property
    def can_run(self) -> bool:
        return not self.blockers

    def to_dict(self) -> dict[str, Any]:
        tc = self.device.toolchain
        host = self.device.emulated_on
        return {
            "device": {**device_dict(self.device),
                       "memory_bytes": self.device.memory_bytes,
                       "multiprocessor_count": self.device.multiprocessor_count,
                       "emulated_on": None if host is None else device_dict(host)},
            "versions": {"torch": tc.torch_version, "driver": tc.driver_version,
                         "driver_cuda": tc.driver_cuda_version, "runtime": tc.runtime_version,
                         "torch_arch_list": list(tc.torch_arch_list),
                         "libraries": dict(tc.libraries)},
            "toolchain": {"ok": self.toolchain_ok, "text": self.toolchain_text},
            "arch": {"ok": self.arch_ok, "text": self.arch_text},
            "findings": [{"code": f.code, "severity": f.severity, "title": f.title,
                          "detail": f.detail, "remedy": f.remedy} for f in self.findings],
            "decisions": [d.to_dict() for d in self.decisions],
            "ops": {op: r.to_dict() for op, r in self.ops.items()},
            "can_run": self.can_run,
            "blockers": self.blockers,
        }


def _representative_specs(device: DeviceInfo, dtype: str = "auto"
                          ) -> tuple[list[Decision], dict[str, Any]]:
    dtype, decisions = resolve_dtype(device, dtype)
    return decisions, {
        "attention": AttentionSpec(head_size=128, dtype=dtype),
        "mla_attention": AttentionSpec(dtype=dtype, **DEEPSEEK_V3_MLA),
        "linear": LinearSpec(dtype=dtype),
        "moe": MoESpec(dtype=dtype),
    }


def _op_report(device: DeviceInfo, op: str, spec: Any, libraries: LibraryAssumption
               ) -> OpReport:
    try:
        route = explain_op(device, op, spec, libraries)
    except BackendError as exc:
        return OpReport(None, str(exc))
    tried = {r.backend for r in route.rejected} | {route.backend}
    others = []
    for name, backend in default_registry().backends(op).items():
        if name in tried:
            continue
        reason = backend.check(device, spec, libraries)
        others.append((name, reason or f"could run; {route.backend} comes first"))
    return OpReport(route, None, others)


# The quantized layer kinds a checkpoint of each loadable scheme typically holds.
QUANT_ROWS = {"linear fp8 W8A8": "fp8", "linear fp8 block": "fp8_block",
              "linear int8 W8A8": "w8a8_int8", "linear int4 W4A16 (AWQ/GPTQ)": "awq",
              "linear GGUF blocks": "gguf"}


def _quant_reports(device: DeviceInfo, dtype: Any, libraries: LibraryAssumption
                   ) -> dict[str, OpReport]:
    reports = {}
    for label, scheme in QUANT_ROWS.items():
        gguf = scheme == "gguf"
        config = explain_quant_config(None, scheme, is_gguf=gguf,
                                      keep_gguf_quantized=keeps_gguf_quantized(device, dtype))
        if config is None:   # a GGUF file expanded at load runs on the dense route
            reports[label] = _op_report(device, "linear", LinearSpec(dtype=dtype), libraries)
            continue
        layer = plan_quantization(device, config, dtype, libraries).layers[0]
        reports[label] = (_op_report(device, "linear", layer.spec, libraries)
                          if layer.error is None else OpReport(None, layer.error))
    return reports


def run_doctor(device: DeviceInfo, libraries: LibraryAssumption = "installed",
               tensor_parallel_size: int = 1, model=None, num_devices: int | None = None,
               emulate: str | None = None, dtype: str = "auto") -> DoctorReport:
    """``model`` (a ModelSummary) and ``num_devices`` (None: unknown, a simulated device)
    let it check a tensor-parallel layout too. ``emulate``: a profile to run ``device``
    with (``--emulate-device``): its routes, this device's toolchain, or why it cannot.
    ``dtype``: the model dtype the routes are for (``--dtype``; auto: the device's default)."""
    refused = None
    if emulate is not None:
        profile = get_profile(emulate)
        refused = emulation_refusal(device, profile)
        if refused is None:
            device = narrow(device, profile)
    silicon = device.emulated_on or device     # what torch and the driver really drive
    toolchain_ok, toolchain_text = three_layer_verdict(silicon)
    arch_ok, arch_text = arch_verdict(silicon)
    decisions, specs = _representative_specs(device, dtype)
    if device.emulated_on is not None:
        decisions.insert(0, Decision("device", f"emulate {device.id}", device.describe(),
                                     emulation_summary(device)))
    used = op_kinds_of_supported_architectures()
    ops = {}
    for op, spec in specs.items():
        ops[op] = (_op_report(device, op, spec, libraries) if op in used else OpReport(
            None, f"not loadable in this build: no supported architecture has {op} layers"))
    ops.update(_quant_reports(device, specs["linear"].dtype, libraries))
    head = lm_head_spec(device, specs["linear"].dtype)
    ops["linear LM head"] = _op_report(device, "linear", head, libraries)
    if ops["linear LM head"].route is not None:
        head_decision = lm_head_decision(head, ops["linear LM head"].route.backend)
        decisions += [head_decision] if head_decision is not None else []
    # Sparse MLA (DeepSeek-V3.2, GLM-5): its own backends, on the same op kind.
    ops["mla_attention sparse (DSA)"] = _op_report(
        device, "mla_attention", replace(specs["mla_attention"], mla_sparse=True,
                                         **DEEPSEEK_V32_INDEXER), libraries)
    blockers = [f"{op}: {ops[op].error}" for op in REQUIRED_OPS if ops[op].error]
    if refused is not None:
        blockers.insert(0, f"cannot emulate {emulate}: {refused}")
    if device.is_gpu and not toolchain_ok:
        # torch cannot drive this GPU (wrong build, runtime newer than the driver, ...).
        blockers.append(f"the toolchain cannot run on {device.describe()}: see findings")
    if tensor_parallel_size > 1:
        blockers += _parallel_layout(device, tensor_parallel_size, model, num_devices, decisions)
    return DoctorReport(device, decisions, toolchain_ok, toolchain_text, arch_ok, arch_text,
                        diagnose(silicon), ops, blockers)



def _parallel_layout(device: DeviceInfo, size: int, model, num_devices: int | None,
                     decisions: list[Decision]) -> list[str]:
    """Blockers of a tensor-parallel layout; what each rank holds goes to ``decisions``."""
    from archserve.distributed.layout import (
        comm_backend,
        device_count_problem,
        layout_decision,
        layout_problems,
    )
    device_type = "cuda" if device.is_gpu else "cpu"
    blockers = []
    if num_devices is not None:
        problem = device_count_problem(size, device_type, num_devices)
        if problem:
            blockers.append(f"tensor parallel: {problem}")
    if model is None:
        decisions.append(Decision("tensor parallel", str(size),
                                  f"{size} ranks, {comm_backend(device_type)}",
                                  "give --model to see what each rank holds"))
        return blockers
    problems = layout_problems(model, size)
    if problems:
        return blockers + [f"tensor parallel: {p}" for p in problems]
    decisions.append(layout_decision(model, size, device_type))
    return blockers
