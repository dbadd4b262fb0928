"""A KV cache quantized to int8, int4 or int2 in the KIVI manner, read by split-KV decode.

Per layer the cache holds two parts, in position order::

    positions  0 ........................ n_groups·G ............... seen
               | quantized groups of G tokens |  float window (newest)  |

* **Keys per channel.**  Each group of ``G = group_size`` consecutive tokens gets, for
  every (batch, kv head, channel), a scale and a zero taken from the min/max over the G
  tokens (key outliers live in a few channels, so per-channel groups keep them apart).
* **Values per token.**  Each (batch, kv head, token) gets a scale and a zero per run of
  ``value_group`` channels (default ``G`` when it divides ``Dv``, else the whole head).
* **Codes** are asymmetric min/max, round-to-nearest (:mod:`attnlab.cache.quantize`, which
  also bounds the error: ``|x - x̂| <= scale/2`` for every element), packed into uint8:
  int8 one code a byte, int4 two, int2 four.  Scales and zeros are ``scale_dtype``
  (float16 by default, as in KIVI).
* **Window.**  The newest tokens stay in the input dtype.  After each update, while the
  window holds at least ``residual + G`` tokens its oldest G are quantized as one group;
  so at least the newest ``min(seen, residual)`` tokens are always exact, the window
  never exceeds ``residual + G - 1`` tokens, and a group is only quantized when it is
  whole.  ``residual=0`` keeps fewer than G float tokens.

``update`` returns a :class:`QuantizedKV` view.  Its ``attend`` walks the quantized
groups a run at a time (``piece_tokens`` tokens, dequantized on the fly: the temporary
memory is one run, never the whole cache), then the float tail, and combines the partial
results exactly with :func:`attnlab.ops.decode.split_kv_attention` (``merge_states``).
On CPU with the native extension built (no score mod, a mask the native kernel implements,
no gradient wanted) ``attend`` is one call of ``attnlab::native_quantized_decode`` instead,
which dequantises the packed groups into float32 tiles as it reads them (the same math,
never rounded to the cache's dtype); ``attend_split`` is the pieces path, its reference.
The tail of the view returned by ``update`` is the float window *as it was before this
update plus the new tokens*: tokens quantized by this very update are attended in full
precision one last time (prefill attention is exact, as in KIVI); later views read their
quantized form.  Same contract as the op: GQA, masks and score mods at absolute
positions (every piece carries its ``kv_offset``, the view its ``q_offset``), LSE.

Memory (:meth:`QuantizedCache.nbytes`) counts the bytes of the tokens held: packed
codes, scales and zeros (``scale_dtype``) and the float window; the growable buffers
may hold up to 2× slack on top (capacity doubling), which ``nbytes`` does not count.
Per element of K and V with ``D = Dv``, float16 scales, ``G = value_group = 32``:
int8 1.125 bytes, int4 0.625, int2 0.375 (float32: 4, bfloat16: 2), i.e. 0.28×, 0.16×,
0.094× float32, plus the window.

>>> import torch
>>> from attnlab.cache.quantized import QuantizedCache
>>> cache = QuantizedCache(n_layers=1, bits=4, group_size=8, residual=8)
>>> kv = cache.update(0, torch.randn(1, 2, 21, 16), torch.randn(1, 2, 21, 16))
>>> cache.n_groups(0), cache.window_length(0), cache.seen
(1, 13, 21)
>>> kv.attend(torch.randn(1, 4, 21, 16)).shape      # GQA 4:2, all 21 tokens as queries
torch.Size([1, 4, 21, 16])
"""

from __future__ import annotations

import torch

from attnlab.cache.base import KV, Cache, DenseKV
from attnlab.cache.quantize import BITS, SCALE_DTYPES, dequantize, pack, packed_size, quantize, unpack
from attnlab.ops.args import scale_arg
from attnlab.ops.decode import split_kv_attention
from attnlab.ops.dispatch import attention
from attnlab.ops.native import decode_ops
from attnlab.validate import nonneg_int, positive_int

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STORE = ("kc", "ks", "kz", "vc", "vs", "vz")


def _append(buf, new, used):
    """Write ``new`` at ``buf[:, :, used:]``, growing ``buf`` along dim 2 by doubling."""
    need = used + new.shape[2]
    if buf is None or need > buf.shape[2]:
        cap = max(need, 2 * (0 if buf is None else buf.shape[2]))
        grown = new.new_empty(*new.shape[:2], cap, *new.shape[3:])
        if used:
            grown[:, :, :used] = buf[:, :, :used]
        buf = grown
    buf[:, :, used:need] = new
    return buf


class _Layer:
    """One layer's state: geometry, the quantized store and the float window."""

    def __init__(self, k, v, group_size, value_group):
        self.G = group_size
        self.B, self.Hkv, _, self.D = k.shape
        self.Dv = v.shape[3]
        self.dtype, self.device = k.dtype, k.device
        self.gv = value_group
        self.n_groups = 0
        self.kc = self.ks = self.kz = self.vc = self.vs = self.vz = None
        self.wk = k.new_empty(self.B, self.Hkv, 0, self.D)
        self.wv = v.new_empty(self.B, self.Hkv, 0, self.Dv)

    def clone(self):
        c = _Layer.__new__(_Layer)
        c.__dict__.update(self.__dict__)
        for name in _STORE:  # only what is used: the copy has no slack
            t = getattr(self, name)
            if t is not None:
                used = self.n_groups if name in ("ks", "kz") else self.n_groups * self.G
                setattr(c, name, t[:, :, :used].clone())
        c.wk, c.wv = self.wk.clone(), self.wv.clone()
        return c


class QuantizedKV(KV):
    """One layer's keys/values: quantized groups ``[0, n_groups·G)`` read a run at a time,
    then a float tail ``k_tail, v_tail`` whose first key sits at ``n_groups·G``."""

    def __init__(self, cache: QuantizedCache, st: _Layer, n_groups: int, k_tail, v_tail, q_offset=None):
        self.bits, self.G, self.piece_groups = cache.bits, cache.group_size, cache.piece_groups
        self.st = {name: getattr(st, name) for name in _STORE}  # buffers are only ever appended to
        self.B, self.Hkv, self.D, self.Dv, self.gv, self.dtype = st.B, st.Hkv, st.D, st.Dv, st.gv, st.dtype
        self.n_groups, self.k_tail, self.v_tail, self.q_offset = n_groups, k_tail, v_tail, q_offset
        self.tail_offset = n_groups * self.G

    @property
    def length(self) -> int:
        """Keys in the view."""
        return self.tail_offset + self.k_tail.shape[2]

    def dequantize(self, g0: int, g1: int):
        """Keys ``(B, Hkv, (g1-g0)·G, D)`` and values of quantized groups ``[g0, g1)``."""
        if not 0 <= g0 <= g1 <= self.n_groups:
            raise ValueError(f"dequantize: groups [{g0}, {g1}) outside [0, {self.n_groups})")
        s = self.st
        B, H, G, D, Dv, gv = self.B, self.Hkv, self.G, self.D, self.Dv, self.gv
        n, t0, t1 = g1 - g0, g0 * G, g1 * G
        if n == 0:
            return self.k_tail.new_empty(B, H, 0, D), self.v_tail.new_empty(B, H, 0, Dv)
        kc = unpack(s["kc"][:, :, t0:t1], self.bits, D).view(B, H, n, G, D)
        k = dequantize(kc, s["ks"][:, :, g0:g1, None], s["kz"][:, :, g0:g1, None], self.dtype)
        vc = unpack(s["vc"][:, :, t0:t1], self.bits, Dv).view(B, H, n * G, Dv // gv, gv)
        v = dequantize(vc, s["vs"][:, :, t0:t1, :, None], s["vz"][:, :, t0:t1, :, None], self.dtype)
        return k.view(B, H, n * G, D), v.view(B, H, n * G, Dv)

    def pieces(self):
        """``(k, v, kv_offset)`` per run of at most ``piece_groups`` groups, then the tail;
        each run is dequantized when the generator reaches it."""
        for g0 in range(0, self.n_groups, self.piece_groups):
            g1 = min(self.n_groups, g0 + self.piece_groups)
            yield (*self.dequantize(g0, g1), g0 * self.G)
        yield self.k_tail, self.v_tail, self.tail_offset

    def attend(self, q, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False):
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"attend: expected q (B, H, Nq, D), got {tuple(getattr(q, 'shape', ()))}")
        q_offset = self.length - q.shape[2] if self.q_offset is None else self.q_offset
        if self.length and q.shape[0] == self.B and q.shape[3] == self.D and q.shape[1] % self.Hkv == 0:
            s, _why = decode_ops.plan(
                q, self.dtype, mask, score_mod, backend, self.B, (self.k_tail, self.v_tail), scale
            )
            if s is not None:
                out, lse = self._attend_native(q, s, scale_arg(scale, self.D), q_offset)
                return (out, lse) if return_lse else out
        return self.attend_split(
            q, mask=mask, score_mod=score_mod, scale=scale, backend=backend, return_lse=return_lse, q_offset=q_offset
        )

    def _attend_native(self, q, s, scale, q_offset):
        st, B, H = self.st, self.B, self.Hkv
        if self.n_groups:
            codes = [st[name] for name in _STORE]
        else:  # nothing quantized yet: typed placeholders the kernel never reads
            u8, sd = torch.uint8, torch.float16
            codes = [
                torch.empty(B, H, 0, packed_size(self.D, self.bits), dtype=u8),
                torch.empty(B, H, 0, self.D, dtype=sd),
                torch.empty(B, H, 0, self.D, dtype=sd),
                torch.empty(B, H, 0, packed_size(self.Dv, self.bits), dtype=u8),
                torch.empty(B, H, 0, self.Dv // self.gv, dtype=sd),
                torch.empty(B, H, 0, self.Dv // self.gv, dtype=sd),
            ]
        return torch.ops.attnlab.native_quantized_decode(
            q,
            *codes,
            self.k_tail,
            self.v_tail,
            self.n_groups,
            self.G,
            self.gv,
            self.bits,
            int(q_offset),
            None if s.kv_len is None else s.kv_len.to(torch.long),
            scale,
            decode_ops.band_of(s),
            int(s.sinks),
            int(decode_ops.SPLIT),
        )

    def attend_split(
        self, q, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False, q_offset=None
    ):
        """The split-KV path: runs of groups dequantized and attended with :func:`attnlab.attention`,
        merged exactly (any mask or score mod, autograd; the native path's reference)."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"attend: expected q (B, H, Nq, D), got {tuple(getattr(q, 'shape', ()))}")
        if q_offset is None:
            q_offset = self.length - q.shape[2] if self.q_offset is None else self.q_offset
        if self.length == 0:  # nothing to split: the op's empty-key semantics (0, -inf)
            return attention(
                q,
                self.k_tail,
                self.v_tail,
                mask=mask,
                score_mod=score_mod,
                scale=scale,
                q_offset=q_offset,
                kv_offset=0,
                return_lse=return_lse,
                backend=backend,
            )
        return split_kv_attention(
            q,
            self.pieces(),
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=q_offset,
            backend=backend,
            return_lse=return_lse,
        )

    def dense(self) -> DenseKV:
        """All keys/values dequantized into dense tensors (for inspection: this is the
        cache-sized copy that :meth:`attend` avoids)."""
        k, v = self.dequantize(0, self.n_groups)
        return DenseKV(
            torch.cat([k, self.k_tail], 2), torch.cat([v, self.v_tail], 2), kv_offset=0, q_offset=self.q_offset
        )


class QuantizedCache(Cache):
    """KV cache with KIVI-style int8/int4/int2 groups and a float window of the newest tokens.

    Args:
        n_layers: layers.
        bits: 8, 4 or 2.
        group_size: ``G``, tokens per key group (keys: one scale/zero per channel per group).
        residual: ``R``, the newest tokens always kept in float (default ``G``); the
            window holds between ``R`` and ``R + G - 1`` tokens once ``seen >= R``.
        value_group: channels per value scale/zero (per token).  Default ``G`` when it
            divides ``Dv``, else ``Dv`` (one scale/zero per token and head).
        scale_dtype: dtype of scales and zeros: float16 (default), bfloat16 or float32.
        piece_tokens: tokens dequantized at a time by ``attend`` (rounded down to whole
            groups, at least one): the bound on its temporary memory.
    """

    def __init__(
        self,
        n_layers: int,
        *,
        bits: int = 4,
        group_size: int = 32,
        residual: int | None = None,
        value_group: int | None = None,
        scale_dtype: torch.dtype = torch.float16,
        piece_tokens: int = 512,
    ):
        super().__init__(n_layers)
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
            raise ValueError(f"QuantizedCache: bits must be one of {BITS}, got {bits!r}")
        self.bits = bits
        self.group_size = positive_int(group_size, "QuantizedCache: group_size")
        self.residual = group_size if residual is None else nonneg_int(residual, "QuantizedCache: residual")
        self.value_group = None if value_group is None else positive_int(value_group, "QuantizedCache: value_group")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"QuantizedCache: scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
        self.scale_dtype = scale_dtype
        self.piece_groups = max(1, positive_int(piece_tokens, "QuantizedCache: piece_tokens") // group_size)
        self.layers: list[_Layer | None] = [None] * n_layers

    @classmethod
    def for_model(cls, model, **kwargs) -> QuantizedCache:
        """A cache with one slot per layer of an :class:`attnlab.nn.Decoder`."""
        return cls(model.cfg.n_layers, **kwargs)

    # -- the interface ------------------------------------------------------------------
    def seen_at(self, layer):
        st = self.layers[layer]
        return 0 if st is None else st.n_groups * self.group_size + st.wk.shape[2]

    @property
    def length(self) -> int:
        return self.seen_at(0)

    def n_groups(self, layer: int) -> int:
        """Quantized groups held by ``layer``."""
        st = self.layers[layer]
        return 0 if st is None else st.n_groups

    def window_length(self, layer: int) -> int:
        """Float tokens held by ``layer`` (the newest)."""
        st = self.layers[layer]
        return 0 if st is None else st.wk.shape[2]

    def _check(self, layer, k, v):
        self._check_layer(layer, k, v)
        if k.dtype not in _FLOATS or v.dtype != k.dtype or v.device != k.device:
            raise ValueError(
                f"QuantizedCache.update: k and v must share one floating dtype and device, got "
                f"{k.dtype}/{v.dtype} on {k.device}/{v.device}"
            )
        st = self.layers[layer]
        if st is None:
            Dv = v.shape[3]
            gv = self.value_group
            if gv is None:
                gv = self.group_size if Dv % self.group_size == 0 else Dv
            elif Dv % gv:
                raise ValueError(
                    f"QuantizedCache: value_group={gv} does not divide the value head dim Dv={Dv}; "
                    "pass a divisor of Dv or None (G when it divides Dv, else Dv)"
                )
            return _Layer(k, v, self.group_size, gv)
        if (
            (k.shape[0], k.shape[1], k.shape[3], v.shape[3]) != (st.B, st.Hkv, st.D, st.Dv)
            or k.dtype != st.dtype
            or k.device != st.device
        ):
            raise ValueError(
                f"update: new k {tuple(k.shape)} / v {tuple(v.shape)} ({k.dtype}) do not continue the "
                f"cached (B, Hkv, ·, D) = ({st.B}, {st.Hkv}, ·, {st.D}), Dv = {st.Dv} ({st.dtype})"
            )
        return st

    def update(self, layer, k, v) -> QuantizedKV:
        st = self._check(layer, k, v)
        G = self.group_size
        wk, wv = torch.cat([st.wk, k], 2), torch.cat([st.wv, v], 2)
        view = QuantizedKV(self, st, st.n_groups, wk, wv, q_offset=self.seen_at(layer))
        n = max(0, (wk.shape[2] - self.residual) // G)
        if n:  # quantize the oldest n whole groups of the window (all arithmetic before any state changes)
            B, H, D, Dv, T = st.B, st.Hkv, st.D, st.Dv, n * G
            kc, ks, kz = quantize(wk[:, :, :T].reshape(B, H, n, G, D), 3, self.bits, self.scale_dtype)
            vc, vs, vz = quantize(wv[:, :, :T].reshape(B, H, T, Dv // st.gv, st.gv), 4, self.bits, self.scale_dtype)
            new = {
                "kc": pack(kc.view(B, H, T, D), self.bits),
                "ks": ks.squeeze(3),
                "kz": kz.squeeze(3),
                "vc": pack(vc.view(B, H, T, Dv), self.bits),
                "vs": vs.squeeze(4),
                "vz": vz.squeeze(4),
            }
            for name, t in new.items():
                used = st.n_groups if name in ("ks", "kz") else st.n_groups * G
                setattr(st, name, _append(getattr(st, name), t, used))
            st.n_groups += n
        st.wk, st.wv = wk[:, :, n * G :].clone(), wv[:, :, n * G :].clone()  # own, compact copies
        self.layers[layer] = st
        return view

    def view(self, layer: int) -> QuantizedKV:
        """A view of what ``layer`` holds now (quantized groups + window); its queries
        default to the newest positions (``q_offset=None``)."""
        st = self.layers[layer]
        if st is None:
            raise ValueError(f"QuantizedCache.view: layer {layer} holds nothing yet")
        return QuantizedKV(self, st, st.n_groups, st.wk, st.wv)

    def reset(self):
        self.layers = [None] * self.n_layers

    def fork(self) -> QuantizedCache:
        c = QuantizedCache.__new__(QuantizedCache)
        c.__dict__.update(self.__dict__)
        c.layers = [None if st is None else st.clone() for st in self.layers]
        return c

    # -- memory -----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held for the tokens cached: packed codes, scales, zeros and the window
        (buffer slack from capacity doubling not counted)."""
        total = 0
        for st in self.layers:
            if st is None:
                continue
            T, es = st.n_groups * self.group_size, torch.empty(0, dtype=self.scale_dtype).element_size()
            codes = st.B * st.Hkv * T * (packed_size(st.D, self.bits) + packed_size(st.Dv, self.bits))
            scales = 2 * st.B * st.Hkv * (st.n_groups * st.D + T * (st.Dv // st.gv)) * es
            total += codes + scales + (st.wk.numel() + st.wv.numel()) * st.wk.element_size()
        return total

    def dense_nbytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes the same tokens take in a dense cache of ``dtype``."""
        es = torch.empty(0, dtype=dtype).element_size()
        return sum(
            self.seen_at(i) * st.B * st.Hkv * (st.D + st.Dv) * es for i, st in enumerate(self.layers) if st is not None
        )

    def memory_report(self) -> dict:
        """``{"bytes", "float32", "bfloat16", "ratio_float32", "ratio_bfloat16"}``."""
        b, f32, bf16 = self.nbytes(), self.dense_nbytes(torch.float32), self.dense_nbytes(torch.bfloat16)
        return {
            "bytes": b,
            "float32": f32,
            "bfloat16": bf16,
            "ratio_float32": b / f32 if f32 else float("nan"),
            "ratio_bfloat16": b / bf16 if bf16 else float("nan"),
        }

    def __repr__(self):
        r = self.memory_report()
        return (
            f"QuantizedCache(layers={self.n_layers}, bits={self.bits}, group_size={self.group_size}, "
            f"residual={self.residual}, seen={self.seen}, {r['bytes']} bytes = "
            f"{r['ratio_float32']:.3f}× float32, {r['ratio_bfloat16']:.3f}× bfloat16)"
        )
