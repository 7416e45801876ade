"""When a sequence is done: token-level stop rules, and the text-level stop-string search.

Token rules run right after a token is appended (``check_stop``). Stop strings need
the detokenized text, so the engine calls ``find_stop_string`` after detokenizing and
truncates the output text itself (vLLM semantics: the text ends just before the stop
string, or just after it with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Collection

from archserve.engine.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, eos_token_ids: Collection[int], max_model_len: int) -> bool:
    """Set ``seq``'s finished status and stop reason if its newest token ends it.

    Order: stop tokens first (EOS unless ``ignore_eos``, then ``stop_token_ids``; neither
    before ``min_tokens`` outputs), then length (``max_tokens``, ``max_model_len``). A
    stop token that is also the last allowed token therefore reports "stop".
    """
    params = seq.sampling_params
    token = seq.last_token_id
    if seq.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None  # vLLM reports EOS as finish_reason "stop", no stop_reason
            return True
        if token in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = token
            return True
    if reached_length_limit(seq, max_model_len):
        seq.status = SequenceStatus.FINISHED_LENGTH
        return True
    return False


def reached_length_limit(seq: Sequence, max_model_len: int) -> bool:
    """``max_tokens`` outputs or ``max_model_len`` tokens (pending ones count too)."""
    limit = seq.sampling_params.max_tokens
    return ((limit is not None and seq.num_output_tokens >= limit)
            or seq.num_tokens >= max_model_len)


def find_stop_string(text: str, new_text_len: int, stop_strings: list[str]
                     ) -> tuple[int, str] | None:
    """Earliest stop string that overlaps the newest ``new_text_len`` characters of ``text``.

    Returns ``(index, matched)`` with ``index`` where ``matched`` starts in ``text``, or
    None. Only matches touching the new text are considered: older text was checked in
    earlier steps. Truncate with ``text[:index]``, or ``text[:index + len(matched)]``
    when the request sets ``include_stop_str_in_output``.
    """
    if not stop_strings or new_text_len <= 0:
        return None
    best: tuple[int, str] | None = None
    new_start = len(text) - new_text_len
    for stop in stop_strings:
        # A match touching the new text starts at most len(stop) - 1 characters before it.
        index = text.find(stop, max(0, new_start - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
