"""A third-party attention backend, loaded by test_selection through a real EntryPoint."""

from __future__ import annotations

from archserve.kernels.registry import Backend


class ToyAttention(Backend):
    name = "TOY_ATTN"
    op = "attention"
    description = "a plug-in that only accepts head size 128"

    def hardware_rule(self, device, spec):  # noqa: ANN001, ANN201 - the Backend signature
        if spec.head_size != 128:
            return "toy kernels need a GPU-sized head of 128"
        return None


def register(registry) -> None:  # noqa: ANN001
    registry.register(ToyAttention())
