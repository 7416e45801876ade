"""A CPU's vector ISA in the capability model: /proc/cpuinfo's flags to features, the
names doctor and explain print."""

from __future__ import annotations

from archserve.platform.detect import cpu_flags, detect
from archserve.platform.device import ALL_CPU_ISA, features_for

ZEN4 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                  "avx512_bf16"})
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_int8", "amx_tile"}


def test_flags_to_features():
    assert features_for("cpu", None).cpu_isa() == []
    assert features_for("cpu", None, cpu_flags=frozenset({"avx2"})).cpu_isa() == []  # no FMA
    haswell = features_for("cpu", None, cpu_flags=frozenset({"avx2", "fma", "avx"}))
    assert haswell.cpu_isa() == ["AVX2"]
    # AVX-512 F alone (Knights Landing) lacks BW/VL: not the AVX-512 torch's kernels use.
    knl = features_for("cpu", None, cpu_flags=frozenset({"avx2", "fma", "avx512f"}))
    assert knl.cpu_isa() == ["AVX2"]
    assert features_for("cpu", None, cpu_flags=ZEN4).cpu_isa() == list(ALL_CPU_ISA[:4])
    assert features_for("cpu", None, cpu_flags=SAPPHIRE_RAPIDS).cpu_isa() == list(ALL_CPU_ISA)


def test_the_host_cpu_reports_its_flags():
    device = detect()
    if device.platform != "cpu":
        return
    flags = cpu_flags()
    assert device.features.avx2 == ({"avx2", "fma"} <= flags)
    assert device.features.amx == ({"amx_bf16", "amx_int8", "amx_tile"} <= flags)
