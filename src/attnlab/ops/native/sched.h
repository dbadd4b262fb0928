// attnlab native kernel: dynamic work distribution for one parallel region.
//
// A pass's work items are handed out one at a time by an atomic counter, in an order that
// puts the largest items first (a causal mask's last q blocks see every kv block, its first
// one), so a thread whose core is busy with another process takes fewer items instead of
// holding the region back by its static share, and the last items handed out are the
// shortest (the region's tail is at most one small item).  Usage:
//
//     attnlab_sched::Queue queue(n_items, cost);   // cost(i) -> int64_t, or no cost: i order
//     at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
//       <per-thread buffers>
//       for (int64_t it; queue.pop(it);) work(it);
//     });
//
// Which thread runs an item never changes its result (items are independent and write
// disjoint outputs), so the order is free: results are the same bits for any thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace attnlab_sched {

class Queue {
 public:
  explicit Queue(int64_t n) : n_(n) {}
  // items in order of decreasing cost (ties keep their index order, so neighbours that share
  // operands still run close together)
  template <typename Cost>
  Queue(int64_t n, Cost&& cost) : n_(n), order_(static_cast<size_t>(n)) {
    std::vector<int64_t> c(static_cast<size_t>(n));
    bool same = true;
    for (int64_t i = 0; i < n; ++i) {
      c[i] = cost(i);
      same = same && c[i] == c[0];
    }
    if (same) {
      order_.clear();
      return;
    }
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return c[a] > c[b]; });
  }
  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  // the next item to run; false when every item is taken
  bool pop(int64_t& item) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_) return false;
    item = order_.empty() ? i : order_[i];
    return true;
  }
  int64_t size() const { return n_; }

 private:
  int64_t n_;
  std::vector<int64_t> order_;  // empty: index order
  std::atomic<int64_t> next_{0};
};

}  // namespace attnlab_sched
