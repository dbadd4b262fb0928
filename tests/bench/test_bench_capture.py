"""`attnlab bench capture` on a tiny model: every contender runs, and the memory it reports as kept is
exactly the bytes of the tensors it keeps (counted here from the model's shapes, not from the bench)."""

import pytest

from attnlab.bench import capture as bench


def test_capture_bench_runs_and_kept_memory_is_the_tensors_bytes():
    L, d, H, B, N = 2, 32, 4, 2, 16
    res = bench.run(reps=1, memory=False, shape=(L, d, H, B, N))
    assert set(res["seconds"]) == set(bench.MODES) and all(t > 0 for t in res["seconds"].values())
    assert res["ratio_to_plain"]["plain"] == 1.0
    for m, t in res["seconds"].items():
        assert res["ratio_to_plain"][m] == pytest.approx(t / res["seconds"]["plain"])
    kept = {m: v * 2**20 for m, v in res["kept_mib"].items()}
    f32, V, BN = 4, 4096, B * N
    # run_with_cache without patterns, per layer: ln1 scale (B,N,1) and output, the fused qkv projection that
    # q, k and v are views of (3d), z, attn_out, resid_mid, ln2 scale and output, mlp pre and post (4d each),
    # mlp_out, resid_post (= the next resid_pre: one tensor); plus the embeddings (the position table is
    # one (N, d) tensor seen as (B, N, d)), resid_pre of layer 0, ln_final scale and output, the logits.
    per_layer = (1 + 3 + 1 + 1 + 1 + 1 + 4 + 4 + 1 + 1) * BN * d + 2 * BN
    top = 3 * BN * d + N * d + BN + BN * V
    assert kept["run_with_cache"] == f32 * (L * per_layer + top)
    # + one head's pattern per layer; the cached q and k it is computed from are already counted
    assert kept["run_with_cache + 1 head"] == kept["run_with_cache"] + f32 * L * B * N * N
    # output_attentions: every head of every layer, (B, H, N, N)
    assert kept["output_attentions"] == f32 * L * B * H * N * N
    # capture keeps q, k, v (views of one projection) and z per layer
    assert kept["capture"] == f32 * L * (3 * BN * d + BN * d)
    assert kept["plain"] == 0
    assert "run_with_cache" in bench.summary(res)


def test_summary_says_whether_huge_page_allocations_are_on(monkeypatch):
    res = bench.run(reps=1, memory=False, shape=(1, 16, 2, 1, 8))
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert bench.thp_alloc() is False
    assert "huge-page allocations off" in bench.summary({**res, "thp_alloc": bench.thp_alloc()})
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert "huge-page allocations on" in bench.summary({**res, "thp_alloc": bench.thp_alloc()})


def test_the_kernels_share_is_reported_per_contender():
    # system time and minor page faults per contender (medians): where a kept activation's cost goes
    res = bench.run(reps=1, memory=False, shape=(1, 16, 2, 1, 8))
    faults, sys_s = res["minor_faults"], res["system_seconds"]
    assert set(faults) == set(sys_s) == set(bench.MODES)
    assert all(isinstance(f, int) and f >= 0 for f in faults.values()) and all(t >= 0 for t in sys_s.values())
    lines = bench.summary(res).splitlines()
    assert "sys ms" in lines[1] and "faults" in lines[1]
    row = next(r for r in lines if r.startswith("output_attentions"))
    assert f" {faults['output_attentions']} " in row
