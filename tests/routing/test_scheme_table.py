"""One truth for quantization schemes: `matrix`, `explain --quantization` and the loader read
quant/schemes.py's table, so for every scheme on every device profile they say the same."""

from __future__ import annotations

import pytest

from archserve.platform.profiles import all_profiles
from archserve.quant.config import UnsupportedQuantization, parse_quant_config
from archserve.quant.schemes import SCHEMES, loadable_methods
from archserve.routing.explain import explain_op_request
from archserve.routing.matrix import build_matrix

PROFILES = all_profiles()


@pytest.fixture(scope="module")
def scheme_rows() -> dict[str, dict]:
    matrix = build_matrix(PROFILES)
    return {f["name"]: f for f in matrix["features"] if f["group"] == "Quantization schemes"}


def _explained(scheme: str, device):
    """``explain --op linear --quantization scheme`` on ``device`` (every library assumed,
    as the matrix assumes): the explanation, or the refusal's text."""
    try:
        return explain_op_request(device, "linear", quantization=scheme, libraries="all")
    except ValueError as exc:
        return str(exc)


def test_every_scheme_has_one_matrix_row(scheme_rows: dict[str, dict]) -> None:
    displays = [scheme.display for scheme in SCHEMES.values()]
    assert len(set(displays)) == len(displays)
    assert set(displays) <= set(scheme_rows)


def _refused(explained) -> bool:
    """explain refused the scheme: an error, or an explanation that says it is not loadable
    and routes nothing (vLLM's ideal alone)."""
    if isinstance(explained, str):
        return "not loadable" in explained
    return (explained.not_loadable is not None and "not loadable" in explained.not_loadable
            and all(not route.backend for route in explained.routes))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_matrix_and_explain_agree_on_every_profile(name: str, scheme_rows: dict[str, dict]
                                                   ) -> None:
    """A scheme the table marks loadable: the matrix supports it exactly where explain
    routes it, and names the kernels explain names for its quantized layers (or says the
    weights are dense after load where explain plans none). One it does not mark: explain
    refuses it everywhere, and the matrix shows vLLM's rule as rules only."""
    scheme = SCHEMES[name]
    row = scheme_rows[scheme.display]
    assert row["implemented"] == scheme.loadable
    for device in PROFILES:
        explained = _explained(name, device)
        if not scheme.loadable:
            assert _refused(explained), (name, device.id)
            continue
        routed = not isinstance(explained, str) and explained.not_loadable is None
        assert row["support"][device.id] == routed, (name, device.id, explained)
        if not routed:
            continue
        # The plan's decisions name the backend each kind of quantized layer runs on.
        planned = {d.chosen for d in explained.decisions if d.what == "quantization"}
        backends = {route.backend for route in explained.routes}
        quantized = sorted(backends & planned)
        assert not quantized or quantized == sorted(backends), (name, device.id)
        expected = ", ".join(quantized) if quantized else "dense after load"
        if not quantized and scheme.moe_format is not None:
            # Routed experts alone (MXFP4): the kernel `explain --op moe` routes them to.
            (experts,) = explain_op_request(device, "moe", quantization=name,
                                            libraries="all").routes
            expected = f"experts: {experts.backend}"
        assert row["notes"][device.id] == expected, (name, device.id)


def test_the_loader_reads_the_methods_of_the_table() -> None:
    """Every loadable scheme's checkpoint form parses (GGUF is read from its file); a
    method the table has no loadable entry for is refused, naming the table's methods."""
    for scheme in SCHEMES.values():
        if scheme.loadable and scheme.name != "gguf":
            assert parse_quant_config(scheme.checkpoint) is not None, scheme.name
    assert loadable_methods() == ("awq", "compressed-tensors", "fp8", "gguf", "gptq", "mxfp4")
    with pytest.raises(UnsupportedQuantization) as refused:
        parse_quant_config({"quant_method": "bitsandbytes"})
    assert "loadable: awq, compressed-tensors, fp8, gguf, gptq, mxfp4" in str(refused.value)
