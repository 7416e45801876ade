"""The warm-up-miss watch: Triton variants compiled after start-up are counted and logged."""

from __future__ import annotations

import logging

import pytest

from archserve.kernels import jit_watch


class _Fn:
    name = "_gate_up_kernel"


def test_a_variant_after_startup_is_counted_and_logged_a_few_times(caplog, monkeypatch):
    monkeypatch.setattr(jit_watch, "_compiled", jit_watch.Counter())
    monkeypatch.setattr(jit_watch, "_serving", True)
    with caplog.at_level(logging.WARNING, logger=jit_watch.__name__):
        for _ in range(jit_watch.LOGGED_PER_KERNEL + 2):
            jit_watch.note_compile({"fn": _Fn(), "repr": "_gate_up_kernel[num_warps=4](...)",
                                    "is_manual_warmup": False})
        jit_watch.note_compile({"fn": _Fn(), "is_manual_warmup": True})   # not serving
    assert jit_watch.compiled_after_startup() == {"_gate_up_kernel": 5}
    warnings = [r for r in caplog.records if "_gate_up_kernel" in r.getMessage()]
    assert len(warnings) == jit_watch.LOGGED_PER_KERNEL
    assert "after start-up" in warnings[0].getMessage()
    assert jit_watch.compiled_since({"_gate_up_kernel": 2}) == {"_gate_up_kernel": 3}
    assert jit_watch.compiled_since(jit_watch.compiled_after_startup()) == {}
    jit_watch.starting()   # another engine starts: its compiles are its warm-up
    jit_watch.note_compile({"fn": _Fn(), "is_manual_warmup": False})
    assert jit_watch.compiled_after_startup() == {"_gate_up_kernel": 5}


def test_the_log_names_the_arguments_the_variant_was_specialised_on(caplog, monkeypatch):
    """The hook's ``compile`` payload as Triton's ``_call_hook`` builds it: constants and
    divisibility attributes keyed by (argument index,); the message names the arguments."""
    class _Param:
        def __init__(self, name: str) -> None:
            self.name = name

    class _Jit:
        params = [_Param(n) for n in ("q_ptr", "num_seqs", "max_len", "BLOCK")]

    class _Info:
        name = "_prefill_kernel"
        jit_function = _Jit()

    monkeypatch.setattr(jit_watch, "_compiled", jit_watch.Counter())
    monkeypatch.setattr(jit_watch, "_serving", True)
    payload = {"constants": {(1,): 1, (3,): 64},
               "configs": [{(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}]}
    with caplog.at_level(logging.WARNING, logger=jit_watch.__name__):
        jit_watch.note_compile({"fn": _Info(), "repr": "_prefill_kernel[...](q_ptr: ()",
                                "compile": payload, "is_manual_warmup": False})
    message = caplog.records[-1].getMessage()
    assert "fixed num_seqs=1, BLOCK=64" in message
    assert "divisible by 16: max_len, q_ptr" in message
    assert jit_watch.specialization({"compile": {"configs": 5}}) == ""   # another form


def test_the_hook_goes_in_front_of_the_one_already_there(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    seen = []

    def earlier(*args, **kwargs):
        seen.append(kwargs["repr"])
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", earlier)
    monkeypatch.setattr(jit_watch, "_compiled", jit_watch.Counter())
    monkeypatch.setattr(jit_watch, "_serving", False)
    assert jit_watch.watch_after_startup()
    assert jit_watch.watch_after_startup()            # once: no second wrapper
    hook = knobs.runtime.jit_cache_hook
    assert hook is not earlier and hook.archserve_watch
    assert hook(key=None, repr="k[...]", fn=_Fn(), is_manual_warmup=False) is False
    assert seen == ["k[...]"] and jit_watch.compiled_after_startup() == {"_gate_up_kernel": 1}
