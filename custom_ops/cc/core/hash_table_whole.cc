// A table's whole-table operations: exports (whole, since a step, by key range, of
// given keys), incremental checkpoints, import and eviction (hash_table.h). Its row
// operations are in hash_table.cc.

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>
#include <numeric>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "custom_ops/cc/core/hash_table.h"

namespace tfpsx {

void HashTable::AppendRow(const Stripe& s, int64_t r, ExportedRows& out) const {
  out.keys.push_back(s.rows.key(r));
  const float* row = s.rows.row(r);
  out.values.insert(out.values.end(), row, row + options_.dim);
  out.slots.insert(out.slots.end(), row + options_.dim, row + row_width_);
  out.freq.push_back(s.rows.freq(r));
  out.step.push_back(s.rows.step(r));
}

ExportedRows HashTable::SortedByKey(ExportedRows raw) const {
  const int64_t dim = options_.dim, slots = options_.num_slots;
  // Sorted by key so that exports (and so checkpoints) are deterministic. The pairs
  // (key, position) sort in place, without an indirect comparison's cache misses (the
  // sort was a quarter of a 1.9M-row export's time).
  const int64_t n = static_cast<int64_t>(raw.keys.size());
  std::vector<std::pair<int64_t, int64_t>> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = {raw.keys[i], i};
  std::sort(order.begin(), order.end());
  ExportedRows out;
  out.keys.resize(n);
  out.values.resize(n * dim);
  out.slots.resize(n * slots * dim);
  out.freq.resize(n);
  out.step.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t o = order[i].second;
    out.keys[i] = order[i].first;
    std::memcpy(&out.values[i * dim], &raw.values[o * dim], dim * sizeof(float));
    if (slots)
      std::memcpy(&out.slots[i * slots * dim], &raw.slots[o * slots * dim],
                  slots * dim * sizeof(float));
    out.freq[i] = raw.freq[o];
    out.step[i] = raw.step[o];
  }
  return out;
}

ExportedRows HashTable::ExportSince(int64_t since_step) const {
  ExportedRows raw;
  if (since_step == INT64_MIN) {  // every row: room for them, not a growth's copies
    const int64_t n = Size();
    raw.keys.reserve(n);
    raw.values.reserve(n * options_.dim);
    raw.slots.reserve(n * (row_width_ - options_.dim));
    raw.freq.reserve(n);
    raw.step.reserve(n);
  }
  for (int i = 0; i < store_.num_stripes(); ++i) {
    const Stripe& s = store_.stripe(i);
    std::shared_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = 0; r < s.size(); ++r) {
      if (s.rows.step(r) >= since_step) AppendRow(s, r, raw);
    }
  }
  return SortedByKey(std::move(raw));
}

template <typename Emit>
CheckpointRows HashTable::CheckpointPass(bool full, Emit&& emit) {
  CheckpointRows out;
  for (int i = 0; i < store_.num_stripes(); ++i) {
    Stripe& s = store_.stripe(i);
    std::unique_lock<std::shared_mutex> lock(s.mu);
    StripeState& st = stripe_state_[i];
    if (full) {
      for (int64_t r = 0; r < s.size(); ++r) emit(s, r);
    } else if (!st.tracked) {
      out.complete = false;
    } else {
      for (size_t w = 0; w < st.dirty.size(); ++w) {
        for (uint64_t bits = st.dirty[w]; bits != 0; bits &= bits - 1) {
          const int64_t r = static_cast<int64_t>(w * 64) + __builtin_ctzll(bits);
          if (r < s.size()) emit(s, r);
        }
      }
      for (int64_t key : st.removed) {
        if (s.FindRow(key, HashKey(key)) < 0) out.removed.push_back(key);  // not back since
      }
    }
    if (full) st.tracked = true;  // only a full export is a base for deltas
    std::fill(st.dirty.begin(), st.dirty.end(), 0);
    st.removed.clear();
  }
  if (!out.complete) {
    out.removed.clear();
    return out;
  }
  std::sort(out.removed.begin(), out.removed.end());
  return out;
}

CheckpointRows HashTable::CheckpointExport(bool full) {
  ExportedRows raw;
  CheckpointRows out = CheckpointPass(full, [&](const Stripe& s, int64_t r) {
    AppendRow(s, r, raw);
  });
  if (out.complete) out.rows = SortedByKey(std::move(raw));
  return out;
}

CheckpointRows HashTable::CheckpointDeltaKeys() {
  std::vector<int64_t> keys;
  CheckpointRows out = CheckpointPass(false, [&](const Stripe& s, int64_t r) {
    keys.push_back(s.rows.key(r));
  });
  if (out.complete) {
    std::sort(keys.begin(), keys.end());
    out.rows.keys = std::move(keys);
  }
  return out;
}

ExportedRows HashTable::Export() const { return ExportSince(INT64_MIN); }

ExportedRows HashTable::ExportRange(int64_t lo, int64_t hi) const {
  ExportedRows raw;
  for (int i = 0; i < store_.num_stripes(); ++i) {
    const Stripe& s = store_.stripe(i);
    std::shared_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = 0; r < s.size(); ++r) {
      const int64_t key = s.rows.key(r);
      if (key >= lo && key <= hi) AppendRow(s, r, raw);
    }
  }
  return SortedByKey(std::move(raw));
}

ExportedRows HashTable::ExportKeys(const int64_t* keys, int64_t n) const {
  ExportedRows raw;
  store_.ForEachByStripe<false>(keys, n, nullptr, 0, [&](const Stripe& s, int64_t i, uint64_t h) {
    const int64_t r = s.FindRow(keys[i], h);
    if (r >= 0) AppendRow(s, r, raw);
  });
  return SortedByKey(std::move(raw));
}

std::vector<int64_t> HashTable::Keys(int64_t stride) const {
  std::vector<int64_t> keys;
  int64_t seen = 0;
  for (int i = 0; i < store_.num_stripes(); ++i) {
    const Stripe& s = store_.stripe(i);
    std::shared_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = 0; r < s.size(); ++r) {
      if (seen++ % stride == 0) keys.push_back(s.rows.key(r));
    }
  }
  return keys;
}

std::vector<int64_t> PageBounds(std::vector<std::pair<int64_t, int64_t>> marks,
                                int64_t max_rows) {
  std::sort(marks.begin(), marks.end());
  std::vector<int64_t> bounds;
  int64_t rows = 0;
  for (size_t i = 0; i < marks.size(); ++i) {
    const int64_t key = marks[i].first;
    // A page ends before a key, never between two marks of one key.
    if (rows > 0 && rows + marks[i].second > max_rows && key != INT64_MIN &&
        key != marks[i - 1].first) {
      bounds.push_back(key);
      rows = 0;
    }
    rows += marks[i].second;
  }
  return bounds;
}

void HashTable::ArmTracking() {
  for (int i = 0; i < store_.num_stripes(); ++i) {
    std::unique_lock<std::shared_mutex> lock(store_.stripe(i).mu);
    StripeState& st = stripe_state_[i];
    st.tracked = true;
    std::fill(st.dirty.begin(), st.dirty.end(), 0);
    st.removed.clear();
  }
}

std::string HashTable::Import(const int64_t* keys, int64_t n, const float* values,
                              const float* slots, int64_t slots_len, const int64_t* freq,
                              const int64_t* step, bool clear_first) {
  const int64_t dim = options_.dim, num_slots = options_.num_slots;
  if (slots_len != 0 && slots_len != n * num_slots * dim) {
    return "slots must hold n*num_slots*dim=" + std::to_string(n * num_slots * dim) +
           " floats (or none), got " + std::to_string(slots_len);
  }
  if (clear_first) {
    for (int i = 0; i < store_.num_stripes(); ++i) {
      Stripe& s = store_.stripe(i);
      std::unique_lock<std::shared_mutex> lock(s.mu);
      store_.ClearLocked(s);  // a reserved table keeps its index size
      StripeState& st = stripe_state_[i];
      st.pending.clear();
      st.tracked = false;  // a clear is no delta: the next checkpoint must be full
      st.dirty.clear();
      st.removed.clear();
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = HashKey(keys[i]);
    Stripe& s = store_.StripeOf(h);
    std::unique_lock<std::shared_mutex> lock(s.mu);
    int64_t r = s.FindRow(keys[i], h);
    if (r < 0) r = s.AddRow(keys[i], h, options_.max_stripe_rows);
    float* row = s.rows.row(r);
    std::memcpy(row, values + i * dim, dim * sizeof(float));
    for (int k = 0; k < num_slots; ++k) {
      if (slots_len) {
        std::memcpy(row + (k + 1) * dim, slots + (i * num_slots + k) * dim, dim * sizeof(float));
      } else {
        std::fill(row + (k + 1) * dim, row + (k + 2) * dim, options_.slot_init[k]);
      }
    }
    s.rows.set_freq(r, freq ? static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(freq[i], 0),
                                                               UINT32_MAX))
                     : 1);
    s.rows.set_step(r, step ? step[i] : 0);
    MarkRow(s, r);
  }
  changes_.Mark(keys, n);
  return "";
}

int64_t HashTable::EvictOlderThan(int64_t min_step) {
  int64_t removed = 0;
  for (int i = 0; i < store_.num_stripes(); ++i) {
    Stripe& s = store_.stripe(i);
    std::unique_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = s.size() - 1; r >= 0; --r) {
      if (s.rows.step(r) < min_step) {
        RemoveTrackedRow(s, r);
        ++stripe_state_[i].evicted;
        ++removed;
      }
    }
  }
  return removed;
}

void HashTable::Frequencies(std::vector<std::pair<uint32_t, int64_t>>* out) const {
  for (int i = 0; i < store_.num_stripes(); ++i) {
    const Stripe& s = store_.stripe(i);
    std::shared_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = 0; r < s.size(); ++r) out->emplace_back(s.rows.freq(r), s.rows.key(r));
  }
}

int64_t HashTable::EvictToTopN(int64_t keep) {
  std::vector<std::pair<uint32_t, int64_t>> all;  // (freq, key)
  Frequencies(&all);
  if (keep < 0) keep = 0;
  if (static_cast<int64_t>(all.size()) <= keep) return 0;
  // Highest frequency first; on ties the smaller key stays, so the result is deterministic.
  auto better = [](const std::pair<uint32_t, int64_t>& a, const std::pair<uint32_t, int64_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::nth_element(all.begin(), all.begin() + keep, all.end(), better);
  std::vector<int64_t> victims;
  for (size_t i = keep; i < all.size(); ++i) victims.push_back(all[i].second);
  return RemoveKeys(victims.data(), static_cast<int64_t>(victims.size()),
                    /*count_as_evicted=*/true);
}

}  // namespace tfpsx
