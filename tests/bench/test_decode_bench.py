"""``attnlab bench decode`` on a tiny ragged batch: every timing and ratio is there, and the
native paged and int8 outputs agree with the padded SDPA call (int8 to its quantization)."""

from __future__ import annotations

import math

import torch

from attnlab.bench import decode
from attnlab.ops.native import build


def test_bench_decode_runs_and_its_outputs_agree():
    row = decode.run(seqs=3, lo=20, hi=70, heads=4, kv_heads=2, dim=16, reps=1, dtype=torch.float32)
    for key in ("paged_native_s", "int8_native_s", "sdpa_folded_s", "sdpa_gqa_s", "paged_ratio", "int8_ratio"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["sdpa_s"] == min(row["sdpa_folded_s"], row["sdpa_gqa_s"])
    assert row["paged_err"] < 1e-5  # the same keys, float32
    assert 1e-4 < row["int8_err"] < 0.05  # int8 groups of 32: quantized, but close
    assert row["kernel"] == build.status()
