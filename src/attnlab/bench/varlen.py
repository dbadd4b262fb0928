"""``attnlab bench varlen``: packed variable-length attention against padded torch SDPA.

A ragged batch (16 sequences, lengths spread evenly over 64..2048 by default, causal):
attnlab's :func:`attnlab.varlen_attention` on the packed ``(total, H, D)`` tokens (no
padding; tiles across two sequences are skipped) against
``torch.nn.functional.scaled_dot_product_attention`` on the batch padded to the longest
sequence with a boolean ``attn_mask`` (causal and key padding), forward (and with
``--backward`` forward+backward).  Reported side by side in one run: median time, the
ratio SDPA/varlen, peak extra memory, and the packed inputs' bytes for scale; where the
native CPU kernel is built, ``varlen_attention(backend="native")`` too.

    attnlab bench varlen [--quick] [--reps N] [--seqs 16] [--min 64] [--max 2048]
                         [--heads 8] [--dim 64] [--backward] [--json PATH]
"""

from __future__ import annotations

import json

import torch

from attnlab.bench.measure import memory_supported, peak_extra_bytes, time_call
from attnlab.ops.native import build
from attnlab.ops.varlen import varlen_attention


def ragged_lengths(n: int, lo: int, hi: int) -> list[int]:
    """``n`` lengths spread evenly over ``lo..hi`` (shuffled by a fixed seed)."""
    if n == 1:
        return [hi]
    lens = [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return [lens[i] for i in torch.randperm(n, generator=g).tolist()]


def _padded(q, k, v, lens):
    B, N = len(lens), max(lens)
    H, D = q.shape[1], q.shape[2]
    qp = q.new_zeros(B, H, N, D)
    kp, vp = k.new_zeros(B, k.shape[1], N, D), v.new_zeros(B, v.shape[1], N, v.shape[2])
    s = 0
    for b, n in enumerate(lens):
        qp[b, :, :n] = q[s : s + n].transpose(0, 1)
        kp[b, :, :n] = k[s : s + n].transpose(0, 1)
        vp[b, :, :n] = v[s : s + n].transpose(0, 1)
        s += n
    idx = torch.arange(N)
    keep = idx.view(1, N) < torch.tensor(lens).view(B, 1)
    mask = (idx.view(N, 1) >= idx.view(1, N)).view(1, 1, N, N) & keep.view(B, 1, 1, N)
    return qp, kp, vp, mask


def run(seqs=16, lo=64, hi=2048, heads=8, dim=64, reps=3, backward=False, dtype=torch.float32, memory=True):
    lens = ragged_lengths(seqs, lo, hi)
    total = sum(lens)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(total, heads, dim, generator=g, dtype=dtype)
    k = torch.randn(total, heads, dim, generator=g, dtype=dtype)
    v = torch.randn(total, heads, dim, generator=g, dtype=dtype)
    cu = torch.tensor([0, *lens]).cumsum(0)
    _qp, _kp, _vp, _mask = _padded(q, k, v, lens)

    def ours(backend="flash"):
        if not backward:
            with torch.no_grad():
                return varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend=backend)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        varlen_attention(qq, kk, vv, cu, cu, max(lens), max(lens), causal=True, backend=backend).sum().backward()
        return qq.grad

    def sdpa():
        # the padded batch is built inside the timed call: padding is part of its cost in real code
        if not backward:
            with torch.no_grad():
                a, b, c, m = _padded(q, k, v, lens)
                return torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=m)
        a, b, c, m = _padded(q, k, v, lens)
        a, b, c = (t.requires_grad_() for t in (a, b, c))
        torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=m).sum().backward()
        return a.grad

    row = {
        "seqs": seqs,
        "lengths": lens,
        "total_tokens": total,
        "padded_tokens": seqs * max(lens),
        "heads": heads,
        "dim": dim,
        "dtype": str(dtype).replace("torch.", ""),
        "backward": backward,
    }
    row["varlen_s"] = time_call(ours, reps=reps)
    if q.device.type == "cpu" and build.load() is not None:
        row["varlen_native_s"] = time_call(lambda: ours("native"), reps=reps)
    row["sdpa_padded_s"] = time_call(sdpa, reps=reps)
    row["speedup"] = row["sdpa_padded_s"] / row["varlen_s"]
    row["packed_qkv_bytes"] = 3 * q.numel() * q.element_size()
    if memory and memory_supported():
        row["varlen_peak_extra_bytes"] = peak_extra_bytes(ours)
        row["sdpa_padded_peak_extra_bytes"] = peak_extra_bytes(sdpa)
    return row


def main(
    *,
    seqs: int = 16,
    lo: int = 64,
    hi: int = 2048,
    heads: int = 8,
    dim: int = 64,
    reps: int = 3,
    backward: bool = False,
    json_path: str | None = None,
) -> int:
    """``attnlab bench varlen``: run, print the comparison, write JSON to ``json_path``."""
    row = run(seqs, lo, hi, heads, dim, reps, backward)
    print(
        f"ragged batch: {row['seqs']} sequences, {row['total_tokens']} tokens packed "
        f"({row['padded_tokens']} padded), H={row['heads']} D={row['dim']} {row['dtype']}, causal, "
        f"{'fwd+bwd' if row['backward'] else 'forward'}"
    )
    print(f"  attnlab varlen (packed)   {row['varlen_s'] * 1e3:9.2f} ms")
    if "varlen_native_s" in row:
        print(
            f"  attnlab varlen native     {row['varlen_native_s'] * 1e3:9.2f} ms   -> "
            f"{row['varlen_s'] / row['varlen_native_s']:.2f}x the flash path"
        )
    print(f"  torch SDPA (padded)       {row['sdpa_padded_s'] * 1e3:9.2f} ms   -> varlen is {row['speedup']:.2f}x")
    if "varlen_peak_extra_bytes" in row:
        print(
            f"  peak extra memory: varlen {row['varlen_peak_extra_bytes'] / 2**20:.1f} MiB, padded SDPA "
            f"{row['sdpa_padded_peak_extra_bytes'] / 2**20:.1f} MiB (packed q/k/v: "
            f"{row['packed_qkv_bytes'] / 2**20:.1f} MiB)"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(row, f, indent=1)
    return 0
