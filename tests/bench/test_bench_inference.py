"""``attnlab bench inference``: each part end to end on tiny sizes (the real run trains
its text models once and takes minutes; here tiny untrained models stand in)."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from attnlab.bench import inference as bench
from attnlab.nn import Decoder, DecoderConfig
from attnlab.train.textmodels import TextModels


def tiny_models():
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope", max_positions=128
    )
    target = Decoder(cfg).eval()
    draft = Decoder(cfg.replace(n_layers=1)).eval()
    return TextModels(
        None, target, draft, torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(1)), 0.0
    )


def test_decode_speed_runs_both_and_they_agree():
    rows = bench.decode_speed(reps=1, new_tokens=8, shapes=((1, 64, 256, 2),))
    r = rows[0]
    assert r["attnlab_tok_s"] > 0 and r["transformers_tok_s"] > 0
    assert r["ratio"] == pytest.approx(r["attnlab_tok_s"] / r["transformers_tok_s"])
    assert 1e-2 < r["ratio"] < 1e2, r  # the same weights decoding the same tokens: within two orders of magnitude
    assert (r["batch"], r["prompt"], r["new_tokens"]) == (2, 64, 8)
    assert r["same_tokens"] == "16/16"  # same weights, greedy: the same continuation


def test_cache_memory_reports_every_kind_with_sane_ratios():
    rows = {r["cache"]: r for r in bench.cache_memory(n_tokens=512, n_layers=1, n_kv_heads=2, d_head=32)}
    assert rows["dynamic float32"]["vs_float32"] == pytest.approx(1.0)
    assert rows["dynamic bfloat16"]["vs_float32"] == pytest.approx(0.5)
    assert rows["quantized int8"]["vs_float32"] < 0.5 < 1.0
    assert rows["quantized int2"]["bytes"] < rows["quantized int4"]["bytes"] < rows["quantized int8"]["bytes"]
    assert rows["streaming 4+252"]["bytes"] == 2 * 2 * 256 * 32 * 4  # bounded at sinks + window tokens
    assert "paged float32 (block 16)" in rows


def test_quality_tables_run_on_tiny_models():
    tm = tiny_models()
    q = bench.quantized_perplexity(tm, n_tokens=256)
    assert [r["cache"].split()[0] for r in q] == ["float32", "int8", "int4", "int2"]
    assert all(math.isfinite(r["ppl"]) for r in q)
    assert abs(q[1]["delta_ppl"]) < abs(q[3]["delta_ppl"]) + 1e-6  # int8 no worse than int2
    s = bench.streaming_table(tm, n_tokens=40)
    assert len(s) == 4 and all(math.isfinite(r["ppl"]) for r in s)
    sp = bench.speculative_table(tm, new_tokens=8, prompts=1)
    assert all(r["equals_greedy"] for r in sp[2:])


def test_paged_waste_is_under_a_block_per_sequence():
    w = bench.paged_waste(n_seqs=8)
    assert 0 <= w["waste_blocks_per_sequence"] < 1


def test_streaming_generation_keeps_the_cache_bounded():
    # 8 prompt tokens + 24 fill the 2 + 30 slots; 240 tokens wrap the window 7 times and run
    # past the model's 128 positions (the first mark, 60, is already past the fill)
    g = bench.streaming_generation(tiny_models(), n_tokens=240, sinks=2, window=30)
    assert g["tokens"] == 240 and g["tok_s"] > 0
    assert [m["tokens"] for m in g["marks"]] == [60, 120, 240]
    sizes = {m["cache_bytes"] for m in g["marks"]}
    assert len(sizes) == 1  # the same bytes at 60, 120 and 240 tokens
