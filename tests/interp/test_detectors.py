"""Head detectors: on hand-built heads they find what was built; on random patterns they equal
a plain per-row loop over their definitions."""

import pytest
import torch
from handbuilt import handbuilt_model, repeated_tokens

from attnlab.interp import detectors as D


@pytest.fixture(scope="module")
def scores():
    model = handbuilt_model()
    ids = repeated_tokens(T=7, B=3)
    return D.detect(model, ids, value_weighted_too=True)


def test_handbuilt_heads_are_found(scores):
    prev, sink, dup, ind = (scores[k].scores for k in ("previous_token", "sink", "duplicate_token", "induction"))
    assert prev[0, 0] > 0.99 and prev[0, [1, 2, 3]].max() < 0.2
    assert sink[0, 1] > 0.99 and sink[0, [0, 2, 3]].max() < 0.2
    assert dup[0, 2] > 0.99 and dup[0, [0, 1, 3]].max() < 0.3
    assert ind[1, 0] > 0.99 and ind[1, 1:].max() < 0.3 and ind[0].max() < 0.3
    assert scores["previous_token"].heads() == [(0, 0)]
    assert scores["induction"].heads(0.9) == [(1, 0)]
    assert scores["sink"].top(1)[0][:2] == (0, 1)


def test_positional_offset(scores):
    model = handbuilt_model()
    from attnlab.interp import capture

    ids = repeated_tokens(T=7, B=2, seed=3)
    with capture(model, layers=[0]) as cap:
        model(ids)
    score, off = D.positional(cap.pattern(0))
    assert off[0] == 1 and off[3] == 2 and score[3] > 0.99


def test_value_weighting_removes_the_sink(scores):
    # the sink head's value at position 0 is zero: raw mass ~1, value-weighted mass 0
    assert scores["sink"].scores[0, 1] > 0.99
    assert scores["sink_vw"].scores[0, 1] < 1e-6
    # heads whose values all have equal norm are unchanged by value weighting
    torch.testing.assert_close(scores["previous_token_vw"].scores[0, 0], scores["previous_token"].scores[0, 0])


def _naive(p, tokens, kind, k=1, d=1):
    B, H, Nq, Nk = p.shape
    out = torch.zeros(H, dtype=torch.float64)
    for h in range(H):
        tot, n = 0.0, 0
        for b in range(B):
            t = tokens[b].tolist()
            for r in range(Nq):
                i = r + Nk - Nq
                if kind == "prev":
                    keys = [i - d] if i >= d else None
                elif kind == "dup":
                    keys = [j for j in range(i) if t[j] == t[i]] or None
                elif kind == "ind":
                    keys = [j for j in range(1, i) if t[j - 1] == t[i]] or None
                else:
                    keys = list(range(k)) if i >= k else None
                if keys is None:
                    continue
                tot += float(p[b, h, r, keys].sum())
                n += 1
        out[h] = tot / n if n else 0.0
    return out


@pytest.mark.parametrize("Nq", [12, 5])
def test_detectors_equal_their_definitions(Nq):
    torch.manual_seed(0)
    B, H, Nk = 2, 3, 12
    p = torch.rand(B, H, Nq, Nk, dtype=torch.float64)
    qpos = torch.arange(Nk - Nq, Nk).view(-1, 1)
    p = p * (torch.arange(Nk).view(1, -1) <= qpos)
    p = p / p.sum(-1, keepdim=True)
    tokens = torch.randint(0, 4, (B, Nk))
    torch.testing.assert_close(D.previous_token(p), _naive(p, tokens, "prev"))
    torch.testing.assert_close(D.offset_mass(p, 3), _naive(p, tokens, "prev", d=3))
    torch.testing.assert_close(D.duplicate_token(p, tokens), _naive(p, tokens, "dup"))
    torch.testing.assert_close(D.induction(p, tokens), _naive(p, tokens, "ind"))
    torch.testing.assert_close(D.sink(p, 2), _naive(p, tokens, "sink", k=2))
    # custom with the previous-token template equals previous_token over the same rows
    prev_tpl = lambda qp, kp: kp == qp - 1  # noqa: E731
    if Nq < Nk:
        torch.testing.assert_close(D.custom(p, prev_tpl), D.previous_token(p))


def test_value_weighted_rows_sum_to_one_and_gqa():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(2, 4, 6, 6), -1)
    v = torch.randn(2, 2, 6, 5)
    w = D.value_weighted(p, v)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
    n = v.norm(dim=-1)
    want = p[:, 3] * n[:, 1].unsqueeze(1)  # head 3 reads kv head 1
    torch.testing.assert_close(w[:, 3], want / want.sum(-1, keepdim=True))


def test_errors():
    p = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    with pytest.raises(ValueError, match="pattern"):
        D.previous_token(p[0])
    with pytest.raises(ValueError, match="tokens"):
        D.induction(p, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="k"):
        D.sink(p, 0)
    with pytest.raises(ValueError, match="template"):
        D.custom(p, torch.ones(3, 3))
    with pytest.raises(ValueError, match="detectors"):
        D.detect(handbuilt_model(), repeated_tokens(), detectors=("nope",))
