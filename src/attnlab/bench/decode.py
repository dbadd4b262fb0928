"""``attnlab bench decode``: one decode step of a ragged batch, read from a paged and an int8
quantized cache by the native decode kernel, against one dense padded SDPA call.

A batch of 16 sequences (lengths spread evenly over 128..4096 by default), GQA 8:2, D=128,
one new query token each.  Timed side by side in one run (medians of ``reps``):

* ``paged native``: :meth:`PagedKV.attend` on a :class:`PagedCache` of block size 16 (one
  call, the block tables read in place; the tables' tensors are rebuilt each call, as in a
  decode step);
* ``int8 native``: :meth:`QuantizedKV.attend` on an 8-bit :class:`QuantizedCache` (groups of
  32, per-channel key / per-token value scales) holding the batch padded to the longest
  sequence, each row's own length given as ``padding(lengths)`` (its hidden keys are not read);
* ``SDPA padded``: ``torch.nn.functional.scaled_dot_product_attention`` once over the dense
  ``(B, Hkv, N_max, D)`` keys with a boolean key-padding mask, the query heads of a kv head
  folded into its query rows (the fastest form of one GQA decode call; ``enable_gqa=True``
  is timed too and the faster of the two is the anchor);
* for scale, the caches' split-KV paths (one row at a time), where ``--split`` asks.

Ratios are ``SDPA / ours`` (> 1: ours is faster); the issue's targets are paged >= 0.9 and
int8 >= 0.7.

    attnlab bench decode [--quick] [--reps N] [--seqs 16] [--min 128] [--max 4096]
                         [--heads 8] [--kv-heads 2] [--dim 128] [--split] [--json PATH]
"""

from __future__ import annotations

import json

import torch

from attnlab import masks
from attnlab.bench.measure import time_call
from attnlab.bench.varlen import ragged_lengths
from attnlab.cache.paged import PagedCache
from attnlab.cache.quantized import QuantizedCache
from attnlab.ops.native import build

_BLOCK = 16


def _paged(k, v, lens, dtype):
    """A paged cache holding row ``b``'s first ``lens[b]`` keys of ``k, v (B, Hkv, N, D)``."""
    _B, Hkv, _N, D = k.shape
    pc = PagedCache(1, sum(-(-(L + 1) // _BLOCK) for L in lens), Hkv, D, block_size=_BLOCK, dtype=dtype)
    seqs = []
    for b, L in enumerate(lens):
        s, _ = pc.add_sequence()
        pc.select([s]).update(0, k[b : b + 1, :, :L], v[b : b + 1, :, :L])
        seqs.append(s)
    return pc, seqs


def run(seqs=16, lo=128, hi=4096, heads=8, kv_heads=2, dim=128, reps=5, dtype=torch.bfloat16, split=False):
    lens = ragged_lengths(seqs, lo, hi)
    B, N, G = seqs, max(lens), heads // kv_heads
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, kv_heads, N + 1, dim, generator=g).to(dtype)
    v = torch.randn(B, kv_heads, N + 1, dim, generator=g).to(dtype)
    q = torch.randn(B, heads, 1, dim, generator=g).to(dtype)
    # the new token's keys go to position L_b of each row (the paged rows are ragged)
    k_new = torch.stack([k[b, :, L] for b, L in enumerate(lens)])[:, :, None]
    v_new = torch.stack([v[b, :, L] for b, L in enumerate(lens)])[:, :, None]
    pc, ids = _paged(k, v, lens, dtype)
    pkv = pc.select(ids).update(0, k_new, v_new)
    held = torch.tensor([L + 1 for L in lens])
    kd = torch.zeros(B, kv_heads, N + 1, dim, dtype=dtype)
    vd = torch.zeros_like(kd)
    for b, L in enumerate(lens):
        kd[b, :, : L + 1] = torch.cat([k[b, :, :L], k_new[b, :, 0:1]], 1)
        vd[b, :, : L + 1] = torch.cat([v[b, :, :L], v_new[b, :, 0:1]], 1)
    # the quantized cache holds every row padded to N+1: row b sees its first L_b + 1 keys (the
    # newest, at L_b, written at that position above), N+1 - L_b - 1 padding keys hidden
    qc = QuantizedCache(1, bits=8, group_size=32)
    qc.update(0, kd, vd)
    qkv = qc.view(0)  # the stored state (the view update returns reads this update's tokens in float)
    assert qkv.n_groups * 32 >= N + 1 - 64, "the int8 cache should hold all but its float window quantized"
    pad = masks.padding(held)
    keep = (torch.arange(N + 1).view(1, N + 1) < held.view(B, 1)).view(B, 1, 1, N + 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def paged_native():
        pkv._native = None  # the tables' tensors, rebuilt as in every decode step
        return pkv.attend(q)

    def int8_native():
        return qkv.attend(q, mask=pad)

    def sdpa_folded():
        return sdpa(q.view(B, kv_heads, G, dim), kd, vd, attn_mask=keep).view(B, heads, 1, dim)

    def sdpa_gqa():
        return sdpa(q, kd, vd, attn_mask=keep, enable_gqa=True)

    with torch.no_grad():
        ref = sdpa_folded().float()
        row = {
            "seqs": B,
            "lengths": lens,
            "heads": heads,
            "kv_heads": kv_heads,
            "dim": dim,
            "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "kernel": build.status(),
            "paged_err": float((paged_native().float() - ref).abs().max()),
            "int8_err": float((int8_native().float() - ref).abs().max()),
        }
        t = {}
        t["paged_native_s"] = time_call(paged_native, reps=reps)
        t["sdpa_folded_s"] = time_call(sdpa_folded, reps=reps)
        t["int8_native_s"] = time_call(int8_native, reps=reps)
        t["sdpa_gqa_s"] = time_call(sdpa_gqa, reps=reps)
        if split:
            t["paged_split_kv_s"] = time_call(lambda: pkv.attend_split(q), reps=max(1, reps // 2))
            t["int8_split_kv_s"] = time_call(lambda: qkv.attend_split(q, mask=pad), reps=max(1, reps // 2))
    row.update(t)
    anchor = min(t["sdpa_folded_s"], t["sdpa_gqa_s"])
    row["sdpa_s"] = anchor
    row["paged_ratio"] = anchor / t["paged_native_s"]
    row["int8_ratio"] = anchor / t["int8_native_s"]
    return row


def main(*, seqs=16, lo=128, hi=4096, heads=8, kv_heads=2, dim=128, reps=5, split=False, json_path=None) -> int:
    """Run float32 and bfloat16, print the comparison, write JSON to ``json_path``."""
    rows = []
    print(f"decode step: {build.status()}; {torch.get_num_threads()} threads, torch {torch.__version__}")
    for dtype in (torch.float32, torch.bfloat16):
        r = run(seqs, lo, hi, heads, kv_heads, dim, reps, dtype, split)
        rows.append(r)
        print(
            f"{r['dtype']}: {r['seqs']} sequences of {min(r['lengths'])}..{max(r['lengths'])} keys "
            f"({sum(r['lengths'])} held, {r['seqs'] * max(r['lengths'])} padded), H={heads}:{kv_heads} D={dim}, 1 query"
        )
        print(f"  SDPA padded, heads folded   {r['sdpa_folded_s'] * 1e3:9.3f} ms")
        print(f"  SDPA padded, enable_gqa     {r['sdpa_gqa_s'] * 1e3:9.3f} ms")
        print(
            f"  paged native                {r['paged_native_s'] * 1e3:9.3f} ms   -> {r['paged_ratio']:.2f}x SDPA "
            f"(target >= 0.9; max |diff| {r['paged_err']:.1e})"
        )
        print(
            f"  int8 quantized native       {r['int8_native_s'] * 1e3:9.3f} ms   -> {r['int8_ratio']:.2f}x SDPA "
            f"(target >= 0.7; max |diff| {r['int8_err']:.1e}, quantization)"
        )
        if "paged_split_kv_s" in r:
            print(f"  paged split-KV (per row)    {r['paged_split_kv_s'] * 1e3:9.3f} ms")
            print(f"  int8 split-KV (per piece)   {r['int8_split_kv_s'] * 1e3:9.3f} ms")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
