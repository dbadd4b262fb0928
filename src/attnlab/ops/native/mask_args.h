// The mask arguments masking.h's Mask reads beyond the band, lengths, ids and keep vector
// (kernel.cpp's mask_of): the band positions and a BlockMask's tiles, checked and attached.
//
//     ext = [qpos (B|1, Nq) int64, kpos (Nk) int64,                     band positions
//            states (Bm, Hm, nqb, nkb) int8, tile_id (nqb, nkb) int32,  a BlockMask's tiles
//            bits (T, Bp, Hp, tbq, ceil(tbk / 32)) int32]               its partial tiles' bits
//
// An absent entry is an empty tensor.  block = [tbq, tbk]: the BlockMask's tiles (the kernel's
// own, bq x bk, are best: then a kernel tile is one BlockMask tile; any other is read correctly).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "masking.h"

inline bool mask_arg(const std::vector<at::Tensor>& ext, size_t i) {
  return ext.size() > i && ext[i].defined() && ext[i].numel() > 0;
}

inline void mask_extra(Mask& mk, const std::vector<at::Tensor>& ext, const std::vector<int64_t>& block, int64_t B,
                       int64_t H, int64_t Nq, int64_t Nk) {
  TORCH_CHECK(ext.size() == 0 || ext.size() == 5, "attnlab native: mask extras are [qpos, kpos, states, tile_id, bits]");
  if (mask_arg(ext, 0)) {
    const at::Tensor& t = ext[0];
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 2 &&
                    (t.size(0) == 1 || t.size(0) == B) && t.size(1) == Nq,
                "attnlab native: qpos must be a contiguous int64 (B|1, Nq) tensor");
    mk.qpos = t.data_ptr<int64_t>();
    mk.qpos_bs = t.size(0) == 1 ? 0 : Nq;
  }
  if (mask_arg(ext, 1)) {
    const at::Tensor& t = ext[1];
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 && t.size(0) == Nk,
                "attnlab native: kpos must be a contiguous int64 (Nk,) tensor");
    mk.kpos = t.data_ptr<int64_t>();
  }
  const bool tiles = mask_arg(ext, 2);
  TORCH_CHECK(tiles == mask_arg(ext, 3) && tiles == mask_arg(ext, 4),
              "attnlab native: tile states, tile ids and bits come together");
  if (!tiles) return;
  TORCH_CHECK(!mk.has_left && !mk.has_right && mk.kv_len == nullptr && mk.q_ids == nullptr && mk.keep == nullptr &&
                  mk.qpos == nullptr && mk.kpos == nullptr,
              "attnlab native: a BlockMask's tiles come alone (its predicate holds every clause)");
  TORCH_CHECK(block.size() == 2 && block[0] > 0 && block[1] > 0, "attnlab native: the BlockMask's tiles [tbq, tbk]");
  const int64_t bq = block[0], bk = block[1];
  const int64_t nqb = (Nq + bq - 1) / bq, nkb = (Nk + bk - 1) / bk, W = (bk + 31) / 32;
  const at::Tensor &st = ext[2], &id = ext[3], &bits = ext[4];
  TORCH_CHECK(st.scalar_type() == at::kChar && st.is_contiguous() && st.dim() == 4 &&
                  (st.size(0) == 1 || st.size(0) == B) && (st.size(1) == 1 || st.size(1) == H) &&
                  st.size(2) == nqb && st.size(3) == nkb,
              "attnlab native: tile states must be a contiguous int8 (B|1, H|1, nqb, nkb) tensor at tiles [tbq, tbk]");
  TORCH_CHECK(id.scalar_type() == at::kInt && id.is_contiguous() && id.dim() == 2 && id.size(0) == nqb &&
                  id.size(1) == nkb,
              "attnlab native: tile ids must be a contiguous int32 (nqb, nkb) tensor");
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.is_contiguous() && bits.dim() == 5 &&
                  (bits.size(1) == 1 || bits.size(1) == B) && (bits.size(2) == 1 || bits.size(2) == H) &&
                  bits.size(3) == bq && bits.size(4) == W,
              "attnlab native: tile bits must be a contiguous int32 (T, B|1, H|1, bq, ceil(bk/32)) tensor");
  const int64_t T = bits.size(0);
  const int32_t* ip = id.data_ptr<int32_t>();
  const int8_t* sp = st.data_ptr<int8_t>();
  for (int64_t x = 0; x < nqb * nkb; ++x) {
    TORCH_CHECK(ip[x] < T, "attnlab native: a tile id past the bits");
    bool partial = false;
    for (int64_t y = 0; y < st.size(0) * st.size(1); ++y) partial = partial || sp[y * nqb * nkb + x] == 1;
    TORCH_CHECK(!partial || ip[x] >= 0, "attnlab native: a partial tile without bits");
  }
  mk.states = sp;
  mk.tbq = bq;
  mk.tbk = bk;
  mk.tnkb = nkb;
  mk.st_bs = st.size(0) == 1 ? 0 : st.size(1) * nqb * nkb;
  mk.st_hs = st.size(1) == 1 ? 0 : nqb * nkb;
  mk.tile_id = ip;
  mk.bits = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  mk.W = W;
  mk.bits_hs = bits.size(2) == 1 ? 0 : bq * W;
  mk.bits_bs = bits.size(1) == 1 ? 0 : bits.size(2) * bq * W;
  mk.bits_ts = bits.size(1) * bits.size(2) * bq * W;
}
