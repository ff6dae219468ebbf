// A tiered table's whole-table operations, over RAM and disk together: exports (whole,
// by key range, a delta in pages), checkpoints, import, removal and eviction
// (tiered_table.h). Its row operations (bring back, spill, compact, prefetch) are in
// tiered_table.cc.

#include <algorithm>
#include <climits>
#include <iterator>
#include <numeric>
#include <utility>
#include <vector>

#include "custom_ops/cc/core/tiered_table.h"

namespace tfpsx {
namespace {

// `batch` ordered by key.
RecordBatch SortedByKey(const RecordBatch& batch) {
  std::vector<int64_t> order(static_cast<size_t>(batch.size()));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return batch.keys[a] < batch.keys[b]; });
  RecordBatch out;
  out.width = batch.width;
  for (int64_t o : order)
    out.Add(batch.keys[o], batch.steps[o], batch.freqs[o], batch.rows.data() + o * batch.width);
  return out;
}

}  // namespace

template <typename Fn>
void TieredTable::ForEachDiskRow(Fn&& fn) {
  for (int32_t seg : store_.segments()) {
    store_.Scan(seg, [&](int64_t record, int64_t key, int64_t step, uint32_t freq,
                         const float* row) { fn(seg, record, key, step, freq, row); });
  }
}

void TieredTable::RebuildIndex() {
  CheckIndex();
  const int64_t gr = store_.group_records();
  int64_t buckets = KeyIndex::BucketsFor(store_.live_rows(), first_buckets_);
  try {
    for (;;) {
      index_.Reset(buckets);  // the old one's memory goes first: RAM stays bounded
      bool full = false;
      for (int32_t seg : store_.segments()) {
        store_.Scan(seg, [&](int64_t record, int64_t key, int64_t, uint32_t, const float*) {
          if (!full && !index_.Insert(key, seg, record % gr)) full = true;
        });
        if (full) break;
      }
      if (!full) break;
      buckets += buckets / 2;  // a place not found at 60% load: rare, try larger
    }
  } catch (const std::exception& e) {
    index_error_ = std::string("rebuilding it failed: ") + e.what();
    throw;
  }
  ++index_rebuilds_;
}

void TieredTable::AppendRows(const RecordBatch& rows, ExportedRows* out) const {
  const int64_t dim = hot_->dim(), width = hot_->row_width();
  for (int64_t i = 0; i < rows.size(); ++i) {
    const float* row = rows.rows.data() + i * width;
    out->keys.push_back(rows.keys[i]);
    out->values.insert(out->values.end(), row, row + dim);
    out->slots.insert(out->slots.end(), row + dim, row + width);
    out->freq.push_back(rows.freqs[i]);
    out->step.push_back(rows.steps[i]);
  }
}

ExportedRows TieredTable::MergeByKey(ExportedRows a, ExportedRows b, int64_t dim, int slots) {
  // Both sorted by key, no key in both (a row is in RAM or on disk).
  if (b.keys.empty()) return a;
  if (a.keys.empty()) return b;
  ExportedRows out;
  const int64_t sw = slots * dim;
  size_t i = 0, j = 0;
  auto take = [&](const ExportedRows& from, size_t k) {
    out.keys.push_back(from.keys[k]);
    out.values.insert(out.values.end(), from.values.begin() + k * dim,
                      from.values.begin() + (k + 1) * dim);
    out.slots.insert(out.slots.end(), from.slots.begin() + k * sw,
                     from.slots.begin() + (k + 1) * sw);
    out.freq.push_back(from.freq[k]);
    out.step.push_back(from.step[k]);
  };
  while (i < a.keys.size() || j < b.keys.size()) {
    if (j == b.keys.size() || (i < a.keys.size() && a.keys[i] < b.keys[j])) {
      take(a, i++);
    } else {
      take(b, j++);
    }
  }
  return out;
}

ExportedRows TieredTable::DiskRowsSince(int64_t since_step) {
  RecordBatch disk;
  disk.width = hot_->row_width();
  ForEachDiskRow([&](int32_t, int64_t, int64_t key, int64_t step, uint32_t freq,
                     const float* row) {
    if (step >= since_step) disk.Add(key, step, freq, row);
  });
  ExportedRows out;
  AppendRows(SortedByKey(disk), &out);
  return out;
}

ExportedRows TieredTable::ExportSince(int64_t since_step) {
  return MergeByKey(hot_->ExportSince(since_step), DiskRowsSince(since_step), hot_->dim(),
                    hot_->options().num_slots);
}

void TieredTable::PeekRows(const std::vector<int64_t>& keys, ExportedRows* out) {
  std::vector<SegmentStore::Request> requests = Lookups(keys.data(), static_cast<int64_t>(keys.size()));
  RecordBatch rows;
  rows.width = hot_->row_width();
  std::vector<int64_t> found_at;
  if (!requests.empty()) store_.ReadMany(&requests, &rows, &found_at);
  AppendRows(SortedByKey(rows), out);
}

std::vector<int64_t> TieredTable::PageBounds(int64_t max_rows) const {
  if (max_rows <= 0) max_rows = PageRows();
  if (Size() <= max_rows) return {};
  std::vector<std::pair<int64_t, int64_t>> marks;
  store_.ForEachGroup([&](int64_t key, int64_t rows) { marks.emplace_back(key, rows); });
  // RAM's keys sampled, each standing for `stride` rows: a few marks a page.
  const int64_t stride = std::max<int64_t>(1, max_rows / 64);
  for (int64_t key : hot_->Keys(stride)) marks.emplace_back(key, stride);
  return tfpsx::PageBounds(std::move(marks), max_rows);
}

ExportedRows TieredTable::ExportRange(int64_t lo, int64_t hi) {
  RecordBatch disk;
  disk.width = hot_->row_width();
  for (int32_t seg : store_.segments()) {
    store_.ScanRange(seg, lo, hi, [&](int64_t, int64_t key, int64_t step, uint32_t freq,
                                      const float* row) { disk.Add(key, step, freq, row); });
  }
  ExportedRows cold;
  AppendRows(SortedByKey(disk), &cold);
  return MergeByKey(hot_->ExportRange(lo, hi), std::move(cold), hot_->dim(),
                    hot_->options().num_slots);
}

void TieredTable::ArmTracking() {
  hot_->ArmTracking();
  tracking_ = true;
  dirty_on_disk_.clear();
  removed_on_disk_.clear();
}

CheckpointRows TieredTable::CheckpointExport(bool full) {
  if (!full) {
    CheckpointRows delta = BeginDelta();
    if (delta.complete) delta.rows = DeltaRange(INT64_MIN, INT64_MAX);
    delta_keys_.clear();
    return delta;
  }
  CheckpointRows hot = hot_->CheckpointExport(true);
  tracking_ = true;
  dirty_on_disk_.clear();
  removed_on_disk_.clear();
  hot.rows = MergeByKey(std::move(hot.rows), DiskRowsSince(INT64_MIN), hot_->dim(),
                        hot_->options().num_slots);
  return hot;
}

CheckpointRows TieredTable::BeginDelta() {
  CheckpointRows hot = hot_->CheckpointDeltaKeys();
  std::vector<int64_t> dirty(dirty_on_disk_.begin(), dirty_on_disk_.end());
  std::vector<int64_t> evicted(removed_on_disk_.begin(), removed_on_disk_.end());
  dirty_on_disk_.clear();
  removed_on_disk_.clear();
  delta_keys_.clear();
  if (!hot.complete || !tracking_) {
    hot.complete = false;
    hot.removed.clear();
    hot.rows = ExportedRows();
    return hot;
  }
  std::sort(dirty.begin(), dirty.end());
  std::merge(hot.rows.keys.begin(), hot.rows.keys.end(), dirty.begin(), dirty.end(),
             std::back_inserter(delta_keys_));
  delta_keys_.erase(std::unique(delta_keys_.begin(), delta_keys_.end()), delta_keys_.end());
  hot.rows = ExportedRows();
  // RAM's "removed" counts a key that left it; one that is live on disk now is not gone.
  ExportedRows on_disk;
  PeekRows(hot.removed, &on_disk);
  std::vector<int64_t> removed;
  std::set_difference(hot.removed.begin(), hot.removed.end(), on_disk.keys.begin(),
                      on_disk.keys.end(), std::back_inserter(removed));
  removed.insert(removed.end(), evicted.begin(), evicted.end());
  std::sort(removed.begin(), removed.end());
  removed.erase(std::unique(removed.begin(), removed.end()), removed.end());
  hot.removed = std::move(removed);
  return hot;
}

std::vector<int64_t> TieredTable::DeltaBounds(int64_t max_rows) const {
  if (max_rows <= 0) max_rows = PageRows();
  std::vector<int64_t> bounds;
  for (size_t i = static_cast<size_t>(max_rows); i < delta_keys_.size();
       i += static_cast<size_t>(max_rows)) {
    bounds.push_back(delta_keys_[i]);  // sorted, unique, above the first key
  }
  return bounds;
}

ExportedRows TieredTable::DeltaRange(int64_t lo, int64_t hi) {
  const auto first = std::lower_bound(delta_keys_.begin(), delta_keys_.end(), lo);
  const auto last = std::upper_bound(first, delta_keys_.end(), hi);
  const std::vector<int64_t> keys(first, last);
  ExportedRows ram = hot_->ExportKeys(keys.data(), static_cast<int64_t>(keys.size()));
  std::vector<int64_t> cold;  // the rest: on disk, or removed since (then in no row)
  std::set_difference(keys.begin(), keys.end(), ram.keys.begin(), ram.keys.end(),
                      std::back_inserter(cold));
  ExportedRows disk;
  PeekRows(cold, &disk);
  return MergeByKey(std::move(ram), std::move(disk), hot_->dim(), hot_->options().num_slots);
}

std::string TieredTable::Import(const int64_t* keys, int64_t n, const float* values,
                                const float* slots, int64_t slots_len, const int64_t* freq,
                                const int64_t* step, bool clear_first) {
  const int64_t dim = hot_->dim(), sw = hot_->options().num_slots * dim;
  if (slots_len != 0 && slots_len != n * sw) {
    return "slots must hold n*num_slots*dim=" + std::to_string(n * sw) +
           " floats (or none), got " + std::to_string(slots_len);
  }
  if (clear_first) {
    store_.DropAll();
    index_.Reset(first_buckets_);
    index_error_.clear();
    dirty_on_disk_.clear();
    removed_on_disk_.clear();
    tracking_ = false;
    const std::string error = hot_->Import(nullptr, 0, nullptr, nullptr, 0, nullptr, nullptr, true);
    if (!error.empty()) return error;
    hot_->TrimMemory();
  }
  // In pieces that fit above the high-water mark, each settled before the next.
  const int64_t piece = std::max<int64_t>(1, KeysPerPiece() / 2);
  for (int64_t at = 0; at < n; at += piece) {
    const int64_t m = std::min(piece, n - at);
    if (!clear_first) FaultIn(keys + at, m);
    const std::string error =
        hot_->Import(keys + at, m, values + at * dim, slots_len ? slots + at * sw : nullptr,
                     slots_len ? m * sw : 0, freq ? freq + at : nullptr,
                     step ? step + at : nullptr, false);
    if (!error.empty()) return error;
    Settle();
  }
  return "";
}

int64_t TieredTable::Remove(const int64_t* keys, int64_t n) {
  int64_t removed = hot_->Remove(keys, n);
  // The disk rows are read only to be killed: in pieces, so that their copies stay small.
  const int64_t piece = std::max<int64_t>(1, kSpillBytes / RecordBytes());
  for (int64_t at = 0; at < n && store_.live_rows() > 0; at += piece) {
    RecordBatch rows;
    std::vector<uint8_t> dirty;
    ReadOut(Missing(keys + at, std::min(piece, n - at)), &rows, &dirty);
    for (int64_t key : rows.keys)
      if (tracking_) removed_on_disk_.insert(key);
    removed += rows.size();
  }
  return removed;
}

int64_t TieredTable::EvictOlderThan(int64_t min_step) {
  int64_t removed = hot_->EvictOlderThan(min_step);
  ForEachDiskRow([&](int32_t seg, int64_t record, int64_t key, int64_t step, uint32_t,
                     const float*) {
    if (step >= min_step) return;
    store_.MarkDead(seg, record);
    index_.Erase(key, seg, record % store_.group_records());
    dirty_on_disk_.erase(key);
    if (tracking_) removed_on_disk_.insert(key);
    ++evicted_;
    ++removed;
  });
  return removed;
}

int64_t TieredTable::EvictToTopN(int64_t keep) {
  std::vector<std::pair<uint32_t, int64_t>> all;  // (freq, key)
  hot_->Frequencies(&all);
  ForEachDiskRow([&](int32_t, int64_t, int64_t key, int64_t, uint32_t freq, const float*) {
    all.emplace_back(freq, key);
  });
  if (keep < 0) keep = 0;
  if (static_cast<int64_t>(all.size()) <= keep) return 0;
  // As HashTable::EvictToTopN: the most frequent stay, the smaller key on ties.
  std::nth_element(all.begin(), all.begin() + keep, all.end(),
                   [](const auto& a, const auto& b) {
                     return a.first != b.first ? a.first > b.first : a.second < b.second;
                   });
  std::vector<int64_t> victims;
  for (size_t i = static_cast<size_t>(keep); i < all.size(); ++i) victims.push_back(all[i].second);
  all.clear();
  all.shrink_to_fit();
  std::sort(victims.begin(), victims.end());
  int64_t removed = hot_->EvictKeys(victims.data(), static_cast<int64_t>(victims.size()));
  // The rest are on disk: read out (killed there) and dropped.
  RecordBatch rows;
  std::vector<uint8_t> dirty;
  ReadOut(Missing(victims.data(), static_cast<int64_t>(victims.size())), &rows, &dirty);
  for (int64_t key : rows.keys)
    if (tracking_) removed_on_disk_.insert(key);
  evicted_ += rows.size();
  return removed + rows.size();
}

}  // namespace tfpsx
