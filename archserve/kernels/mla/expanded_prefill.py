"""MLA prefill in the expanded form: the latent turned into per-head keys and values, then
the standard Triton prefill kernel (kernels/attention/triton_prefill.py).

Absorbed attention costs (L + R) + L multiply-adds per query-key pair and head (1088 for
DeepSeek), the expanded form (nope + R) + v (320): for a prompt attending to itself the
expansion (once per context token) is soon paid back. The prefilling sequences' contexts,
cached prefixes included, are read from the latent cache, expanded with W_UK / W_UV and laid
out contiguously in a scratch paged cache of one block per EXPANDED_BLOCK tokens; the prefill
kernel then runs causally over it as over any cache. Values are zero-padded to the key head
size (the kernel has one head size; the padded columns are dropped).

The scratch holds 2 x H x head values per context token (DeepSeek-V3, 128 heads: 96 KiB),
memory the start-up's activation profile (short contexts) does not see in proportion to a
long cached prefix; so it is a workspace of at most EXPANDED_WORKSPACE_BYTES. Sequences whose
contexts fit together share a launch (when all fit, one launch as for any cache); a longer
context is attended in windows of the workspace's size, one launch each with the kernel's key
window and LSE output, and the windows' partial attentions are merged by their LSEs in
float32. Only the query rows at or past a window's first key take part in it.

This runs in eager steps only (a step with a prompt is never a CUDA graph), so it may read
the host copies of the lengths.
"""

from __future__ import annotations

import numpy as np
import torch

from archserve.kernels.attention.triton_prefill import prefill_attention

EXPANDED_BLOCK = 16
# Windows start on multiples of the prefill kernel's largest key tile (BLOCK_N 128), so only
# a window's last tile and the causal diagonal's pay for masks.
WINDOW_ALIGN = 128
# The scratch of expanded keys and values, at most (the expansion adds one chunk's einsum
# output, under half as much again). 256 MiB is ~2.7k tokens of DeepSeek-V3's 128 heads: a
# window's launch still fills the GPU (its work is query rows x window keys) and the launch
# count of a 128k context stays ~50, while the KV pool, sized after the profile, loses little.
EXPANDED_WORKSPACE_BYTES = 256 << 20


def workspace_tokens(num_heads: int, head: int, dtype: torch.dtype) -> int:
    """Context tokens the workspace holds expanded: a multiple of WINDOW_ALIGN (at least one)."""
    per_token = 2 * num_heads * head * dtype.itemsize
    return max(WINDOW_ALIGN, EXPANDED_WORKSPACE_BYTES // per_token // WINDOW_ALIGN * WINDOW_ALIGN)


def gather_latent(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                  k_scale: float, dtype: torch.dtype, first: int = 0) -> torch.Tensor:
    """Context rows ``first`` to ``seq_lens[i]`` of each sequence given, in order, as ``dtype``
    [rows, L+R]."""
    block_size = kv_cache.shape[2]
    seq_index = np.repeat(np.arange(len(seq_lens)), [n - first for n in seq_lens])
    positions = np.concatenate([np.arange(first, n) for n in seq_lens])
    device = kv_cache.device
    seq_t = torch.from_numpy(seq_index).to(device)
    pos_t = torch.from_numpy(positions).to(device)
    blocks = block_tables[seq_t, pos_t // block_size].long()
    offsets = pos_t % block_size
    # Indexed by block and offset: the latent may be a view of wider rows (sparse MLA's).
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # Index the bytes: float8 indexing is not implemented on every device.
        rows = kv_cache.view(torch.uint8)[0, blocks, offsets, 0].view(kv_cache.dtype)
        return (rows.float() * k_scale).to(dtype)
    return kv_cache[0, blocks, offsets, 0].to(dtype)


def launch_groups(seq_lens: list[int], window: int) -> list[tuple[int, int]]:
    """Runs [i, j) of consecutive sequences whose block-rounded contexts fit ``window`` tokens
    together (one launch each); a context longer than that alone, as [i, i + 1)."""
    groups: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(seq_lens):
        rows = -(-n // EXPANDED_BLOCK) * EXPANDED_BLOCK
        if i > start and used + rows > window:
            groups.append((start, i))
            start, used = i, 0
        used += rows
    groups.append((start, len(seq_lens)))
    return groups


def merge_partial(acc: torch.Tensor, lse: torch.Tensor, part: torch.Tensor,
                  part_lse: torch.Tensor) -> None:
    """Fold one window's attention ``part`` [T, H, v] (normalised over its keys, log
    denominator ``part_lse`` [T, H]) into the running float32 ``acc`` / ``lse``, in place."""
    total = torch.logaddexp(lse, part_lse)
    # A row that has seen no key on either side stays empty (exp(-inf - -inf) would be NaN).
    base = total.masked_fill(total == float("-inf"), 0.0)
    acc.mul_(torch.exp(lse - base).unsqueeze(-1))
    acc.addcmul_(part, torch.exp(part_lse - base).unsqueeze(-1))
    lse.copy_(total)


class _Expansion:
    """The scratch paged cache and what expands latent rows into it."""

    def __init__(self, kv_cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                 head: int, tokens: int, k_scale: float, dtype: torch.dtype):
        self.kv_cache, self.w_uk, self.w_uv, self.k_scale = kv_cache, w_uk, w_uv, k_scale
        num_heads = w_uk.shape[0]
        # Zeros once: the padded columns are never written, rows are rewritten per launch.
        self.scratch = torch.zeros(2, tokens, num_heads, head, dtype=dtype,
                                   device=kv_cache.device)
        self.paged = self.scratch.view(2, -1, EXPANDED_BLOCK, num_heads, head)

    def expand(self, block_tables: torch.Tensor, seq_lens: list[int], rows: np.ndarray,
               first: int = 0) -> None:
        """Context rows ``first``.. of the sequences, expanded, into scratch rows ``rows``;
        each product is written into its columns (no concatenated or padded copy)."""
        kv_rank, nope, v_head = self.w_uk.shape[2], self.w_uk.shape[1], self.w_uv.shape[1]
        latent = gather_latent(self.kv_cache, block_tables, seq_lens, self.k_scale,
                               self.scratch.dtype, first)
        rows_t = torch.from_numpy(rows).to(self.scratch.device)
        keys, values = self.scratch[0], self.scratch[1]
        keys[..., :nope].index_copy_(
            0, rows_t, torch.einsum("nl,hdl->nhd", latent[:, :kv_rank], self.w_uk))
        rope = latent[:, None, kv_rank:]
        keys[..., nope:nope + rope.shape[-1]].index_copy_(
            0, rows_t, rope.expand(-1, keys.shape[1], -1))
        values[..., :v_head].index_copy_(
            0, rows_t, torch.einsum("nl,hvl->nhv", latent[:, :kv_rank], self.w_uv))


def expanded_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                     w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                     k_scale: float = 1.0, window: int | None = None) -> torch.Tensor:
    """Causal attention of the rows of some sequences (back to back, ``query_lens`` each, the
    last of ``seq_lens`` positions) over their latent contexts -> [T, H, v].

    ``window``: context tokens expanded at once (a multiple of EXPANDED_BLOCK; default
    ``workspace_tokens``)."""
    num_heads, nope, _ = w_uk.shape
    v_head, rope = w_uv.shape[1], q_pe.shape[-1]
    head = max(nope + rope, v_head)
    dtype, device = q_nope.dtype, q_nope.device
    window = window or workspace_tokens(num_heads, head, dtype)
    if window % EXPANDED_BLOCK:
        raise ValueError(f"the expansion window ({window}) must be a multiple of "
                         f"{EXPANDED_BLOCK}")

    query = torch.cat((q_nope, q_pe.to(dtype)), -1)
    if query.shape[-1] < head:
        query = torch.nn.functional.pad(query, (0, head - query.shape[-1]))
    query = query.contiguous()
    out = torch.empty_like(query)
    blocks = [-(-n // EXPANDED_BLOCK) for n in seq_lens]
    expansion = _Expansion(kv_cache, w_uk, w_uv, head,
                           min(window, sum(blocks) * EXPANDED_BLOCK), k_scale, dtype)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    for i, j in launch_groups(seq_lens, window):
        if blocks[i] * EXPANDED_BLOCK > window:
            _attend_in_windows(expansion, query, out, block_tables[i:i + 1], query_lens[i],
                               seq_lens[i], int(starts[i]), window, scale, v_head)
            continue
        lens = seq_lens[i:j]
        first_block = np.concatenate([[0], np.cumsum(blocks[i:j])[:-1]]).astype(np.int64)
        expansion.expand(block_tables[i:j], lens, np.concatenate(
            [first_block[k] * EXPANDED_BLOCK + np.arange(n) for k, n in enumerate(lens)]))
        tables = np.zeros((j - i, max(blocks[i:j])), dtype=np.int32)
        for k, n in enumerate(blocks[i:j]):
            tables[k, :n] = first_block[k] + np.arange(n)
        q0, q1 = int(starts[i]), int(starts[j])
        prefill_attention(query[q0:q1], expansion.paged, torch.from_numpy(tables).to(device),
                          torch.tensor(lens, dtype=torch.int32, device=device),
                          torch.from_numpy(starts[i:j + 1] - starts[i]).to(device),
                          out[q0:q1], num_seqs=j - i, max_query_len=max(query_lens[i:j]),
                          scale=scale)
    return out[..., :v_head]


def _attend_in_windows(expansion: _Expansion, query: torch.Tensor, out: torch.Tensor,
                       block_table: torch.Tensor, query_len: int, seq_len: int, q0: int,
                       window: int, scale: float, v_head: int) -> None:
    """One sequence's rows ``q0``.. of ``out``, its context attended ``window`` keys a launch."""
    device, num_heads = query.device, query.shape[1]
    prefix = seq_len - query_len
    acc = torch.zeros(query_len, num_heads, v_head, dtype=torch.float32, device=device)
    lse = torch.full((query_len, num_heads), float("-inf"), device=device)
    part_lse = torch.empty_like(lse)
    # Window w's logical blocks map onto the scratch from its first block: one table serves
    # every window (keys outside the launch's window are never read).
    width = -(-seq_len // EXPANDED_BLOCK)
    table = (torch.arange(width, dtype=torch.int32, device=device)
             % (window // EXPANDED_BLOCK)).view(1, -1)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    for lo in range(0, seq_len, window):
        hi = min(lo + window, seq_len)
        expansion.expand(block_table, [hi], np.arange(hi - lo), first=lo)
        # Rows before the window's first key see none of it: left out (the kernel takes the
        # last rows of a sequence, so their positions stay right).
        skip = max(0, lo - prefix)
        rows = query_len - skip
        part = out[q0 + skip:q0 + query_len]
        prefill_attention(query[q0 + skip:q0 + query_len], expansion.paged, table, lens,
                          torch.tensor([0, rows], dtype=torch.int32, device=device), part,
                          num_seqs=1, max_query_len=rows, scale=scale, key_window=(lo, hi),
                          lse=part_lse[skip:])
        merge_partial(acc[skip:], lse[skip:], part[..., :v_head], part_lse[skip:])
    out[q0:q0 + query_len, :, :v_head] = acc.to(out.dtype)
