// A tiered table's row operations: bring rows back, spill, compact, prefetch (tiered_table.h);
// its whole-table operations (exports, checkpoints, import, eviction) are in
// tiered_table_whole.cc.

#include "custom_ops/cc/core/tiered_table.h"

#include <malloc.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <iterator>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <utility>

namespace tfpsx {
namespace {

// Bytes the set of dirty disk keys takes per key (node, bucket, allocator): an estimate
// that errs high.
constexpr int64_t kDirtyKeyBytes = 48;

// The order of batch's records by key (a segment is a sorted run), without a copy.
std::vector<int64_t> KeyOrder(const RecordBatch& batch) {
  std::vector<int64_t> order(static_cast<size_t>(batch.size()));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return batch.keys[a] < batch.keys[b]; });
  return order;
}

// The key index's first size: an entry for every other row RAM holds, never fewer than
// KeyIndex's default, so that the first spills need no rebuild. What it costs up front:
// 2 bytes per row that fits in RAM (1-2% of ram_bytes at dim 8-16).
int64_t FirstBuckets(int64_t ram_bytes, int64_t record) {
  const int64_t rows = ram_bytes / (record + 8);
  return std::max<int64_t>(KeyIndex::kFirstBuckets, rows / (2 * KeyIndex::kWays));
}

}  // namespace

TieredTable::TieredTable(HashTable* hot, TierOptions options)
    : hot_(hot),
      options_(std::move(options)),
      store_(options_.directory, hot->row_width()),
      index_(FirstBuckets(options_.ram_bytes, 20 + 4 * hot->row_width())),
      first_buckets_(index_.buckets()) {
  if (options_.directory.empty())
    throw std::invalid_argument("a tiered table needs a directory for its disk rows");
  if (options_.ram_bytes <= 0)
    throw std::invalid_argument("ram_bytes must be > 0, got " +
                                std::to_string(options_.ram_bytes));
  if (!(0 < options_.low_water && options_.low_water < options_.high_water &&
        options_.high_water < 1))
    throw std::invalid_argument("the water marks must satisfy 0 < low < high < 1");
  if (options_.ram_bytes < MinRamBytes(*hot))
    throw std::invalid_argument(
        "ram_bytes=" + std::to_string(options_.ram_bytes) + " is below what a shard of rows of " +
        std::to_string(hot->row_width()) + " floats needs at least: " +
        std::to_string(MinRamBytes(*hot)) + " (two chunks of rows per lock stripe, the index)");
}

int64_t TieredTable::MinRamBytes(const HashTable& hot) {
  const int64_t record = RowStore::RecordBytes(hot.row_width());
  const int64_t chunk = record << RowStore::ChunkShift(record);
  return 2 * hot.options().num_stripes * chunk + KeyIndex::kFirstBuckets * KeyIndex::kWays * 4;
}

void TieredTable::Open() { store_.Open(); }

int64_t TieredTable::RamBytes() const {
  return hot_->ResidentBytes() + index_.bytes() + store_.ram_bytes() +
         static_cast<int64_t>(dirty_on_disk_.size() + removed_on_disk_.size()) * kDirtyKeyBytes;
}

void TieredTable::FaultIn(const int64_t* keys, int64_t n) {
  if (n == 0) return;
  const std::vector<int64_t> missing = Missing(keys, n);
  // The batch's rows that are not in RAM (read back, or new) land above the high-water
  // mark before Settle moves others out: they must fit below ram_bytes (a row and its
  // index slot, at most).
  const int64_t m = static_cast<int64_t>(missing.size());
  const int64_t need = m * (RecordBytes() + 8);
  const int64_t room =
      options_.ram_bytes - static_cast<int64_t>(options_.high_water * options_.ram_bytes);
  if (need > room) {
    throw std::length_error(
        "a batch of " + std::to_string(m) + " keys not in RAM needs up to " +
        std::to_string(need) + " bytes of RAM above the table's high-water mark (" +
        std::to_string(static_cast<int>(options_.high_water * 100)) +
        "% of ram_bytes); ram_bytes must be at least " +
        std::to_string(static_cast<int64_t>(need / (1 - options_.high_water)) + 1) +
        " for such batches, got " + std::to_string(options_.ram_bytes));
  }
  if (store_.live_rows() == 0 || m == 0) return;
  RecordBatch rows;
  std::vector<uint8_t> dirty;
  ReadOut(missing, &rows, &dirty);
  hot_->PutRows(rows, dirty);
  rows_faulted_ += rows.size();
}

void TieredTable::FindOnDisk(const int64_t* keys, int64_t n, int64_t width, float* out,
                             bool* found) {
  if (store_.live_rows() == 0) return;
  std::vector<std::pair<int64_t, int64_t>> at;  // (key, position) of the keys not found
  for (int64_t i = 0; i < n; ++i)
    if (!found[i]) at.emplace_back(keys[i], i);
  std::sort(at.begin(), at.end());
  std::vector<int64_t> unique;
  for (const auto& p : at)
    if (unique.empty() || unique.back() != p.first) unique.push_back(p.first);
  // In pieces, so that the rows read at once stay within a spill's buffer.
  const int64_t piece = std::max<int64_t>(1, kSpillBytes / RecordBytes());
  const int64_t full = hot_->row_width();
  for (size_t first = 0; first < unique.size(); first += static_cast<size_t>(piece)) {
    const size_t last = std::min(unique.size(), first + static_cast<size_t>(piece));
    std::vector<SegmentStore::Request> requests = Lookups(unique.data() + first, static_cast<int64_t>(last - first));
    if (requests.empty()) continue;
    RecordBatch rows;
    rows.width = full;
    std::vector<int64_t> found_at;
    store_.ReadMany(&requests, &rows, &found_at);
    for (int64_t r = 0; r < rows.size(); ++r) {
      const int64_t key = rows.keys[r];
      auto it = std::lower_bound(at.begin(), at.end(), std::make_pair(key, INT64_MIN));
      for (; it != at.end() && it->first == key; ++it) {
        std::memcpy(out + it->second * width, rows.rows.data() + r * full,
                    width * sizeof(float));
        found[it->second] = true;
      }
    }
  }
}

std::vector<SegmentStore::Request> TieredTable::Lookups(const int64_t* keys, int64_t n) const {
  CheckIndex();
  std::vector<KeyIndex::Candidate> candidates;
  index_.Candidates(keys, n, &candidates);
  std::vector<SegmentStore::Request> requests;
  requests.reserve(candidates.size());
  for (const auto& c : candidates) requests.push_back({c.key, c.segment, c.slot});
  return requests;
}

void TieredTable::CheckIndex() const {
  if (!index_error_.empty())
    throw std::runtime_error("the tiered table in " + options_.directory +
                             " lost its index of disk rows (" + index_error_ +
                             "): restore a checkpoint");
}

std::vector<int64_t> TieredTable::Missing(const int64_t* keys, int64_t n) const {
  std::unique_ptr<bool[]> present(new bool[n]);
  hot_->Present(keys, n, present.get());
  std::vector<int64_t> missing;
  for (int64_t i = 0; i < n; ++i)
    if (!present[i]) missing.push_back(keys[i]);
  // Unique: a batch reads each key once.
  std::sort(missing.begin(), missing.end());
  missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
  return missing;
}

void TieredTable::ReadOut(const std::vector<int64_t>& missing, RecordBatch* rows,
                          std::vector<uint8_t>* dirty) {
  rows->width = hot_->row_width();
  std::vector<SegmentStore::Request> requests = Lookups(missing.data(), static_cast<int64_t>(missing.size()));
  if (requests.empty()) return;
  SegmentStore::Read read = store_.PlanRead(requests);
  SegmentStore::RunRead(requests, &read);
  TakeLive(&read, rows, dirty);
}

void TieredTable::TakeLive(SegmentStore::Read* read, RecordBatch* rows,
                           std::vector<uint8_t>* dirty) {
  store_.Count(*read);
  rows->width = hot_->row_width();
  const int64_t width = rows->width;
  for (size_t h = 0; h < read->hits.size(); ++h) {
    const SegmentStore::Read::Hit& hit = read->hits[h];
    // Live: a row is in RAM or live on disk, never both; one brought back (or compacted
    // away) since the read was planned is not taken again.
    if (!store_.Live(hit.segment, hit.number, hit.record)) continue;
    const int64_t key = read->rows.keys[h];
    rows->Add(key, read->rows.steps[h], read->rows.freqs[h], read->rows.rows.data() + h * width);
    store_.MarkDead(hit.segment, hit.record);
    index_.Erase(key, hit.segment, hit.record % store_.group_records());
    dirty->push_back(dirty_on_disk_.erase(key) > 0 ? 1 : 0);
  }
}

TieredTable::Prefetch TieredTable::PlanPrefetch(const int64_t* keys, int64_t n) {
  Prefetch p;
  if (n == 0 || store_.live_rows() == 0) return p;
  p.keys = Missing(keys, n);
  if (static_cast<int64_t>(p.keys.size()) > KeysPerPiece()) p.keys.resize(KeysPerPiece());
  p.requests = Lookups(p.keys.data(), static_cast<int64_t>(p.keys.size()));
  p.read = store_.PlanRead(p.requests);
  return p;
}

int64_t TieredTable::PlacePrefetch(Prefetch* p) {
  RecordBatch rows;
  std::vector<uint8_t> dirty;
  TakeLive(&p->read, &rows, &dirty);
  hot_->PutRows(rows, dirty);
  rows_faulted_ += rows.size();
  prefetched_ = p->keys;
  return rows.size();
}

void TieredTable::Settle(const int64_t* keys, int64_t n) {
  if (RamBytes() > static_cast<int64_t>(options_.high_water * options_.ram_bytes))
    Spill(static_cast<int64_t>(options_.low_water * options_.ram_bytes), keys, n);
  Compact();
  // An index grown for far more disk rows than remain (evicted, removed, brought back)
  // is rebuilt for those: its RAM goes back to rows.
  if (index_error_.empty() && index_.buckets() > first_buckets_ &&
      static_cast<double>(index_.size()) <
          KeyIndex::kShrinkLoad * static_cast<double>(index_.buckets() * KeyIndex::kWays))
    RebuildIndex();
  const int64_t now = RamBytes();
  if (now > options_.ram_bytes && !warned_) {
    warned_ = true;
    warning_ = "RAM " + std::to_string(now) + " bytes is over ram_bytes=" +
               std::to_string(options_.ram_bytes) + " with " + std::to_string(hot_->Size()) +
               " rows left in RAM: the index of the " + std::to_string(store_.live_rows()) +
               " rows on disk takes " + std::to_string(index_.bytes() + store_.ram_bytes()) +
               " bytes (4.2-8 a row); raise ram_bytes";
  }
}

std::string TieredTable::TakeWarning() {
  std::string out;
  out.swap(warning_);
  return out;
}

void TieredTable::Spill(int64_t target_bytes, const int64_t* keep, int64_t n_keep) {
  std::vector<int64_t> kept(keep, keep + n_keep);
  kept.insert(kept.end(), prefetched_.begin(), prefetched_.end());
  std::sort(kept.begin(), kept.end());
  kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
  const int64_t per_row = RecordBytes() + 8;  // the record and (about) its index slot
  const int stripes = hot_->num_stripes();
  const int64_t chunk = std::max<int64_t>(1, kSpillBytes / RecordBytes());
  // Rows freed inside a chunk still in use are not given back, so the first estimate
  // may fall short: a few rounds at most.
  for (int round = 0; round < 4; ++round) {
    const int64_t excess = RamBytes() - target_bytes;
    const int64_t size = hot_->Size();
    if (excess <= 0 || size == 0) break;
    const int64_t want = (excess + per_row - 1) / per_row;
    // Chosen stripe by stripe, each its share of `want` (keys spread evenly over the
    // stripes, so this is the table's LRU within a stripe's rounding): the choice costs
    // one stripe's scores at a time, not the table's.
    std::vector<int64_t> victims;
    for (int s = 0; s < stripes; ++s) {
      const int64_t share = (want * hot_->StripeSize(s) + size - 1) / size;
      std::vector<int64_t> some = hot_->StripeVictims(s, share + static_cast<int64_t>(kept.size()));
      int64_t taken = 0;
      for (int64_t k : some) {
        if (taken == share) break;
        if (std::binary_search(kept.begin(), kept.end(), k)) continue;
        victims.push_back(k);
        ++taken;
      }
    }
    if (victims.empty()) break;
    for (size_t at = 0; at < victims.size(); at += static_cast<size_t>(chunk)) {
      const int64_t m = std::min<int64_t>(chunk, static_cast<int64_t>(victims.size() - at));
      RecordBatch batch;
      batch.width = hot_->row_width();
      std::vector<uint8_t> dirty;
      hot_->TakeRows(victims.data() + at, m, &batch, &dirty);
      const std::vector<int64_t> order = KeyOrder(batch);
      int32_t seg;
      try {
        seg = store_.Write(batch, &order);
      } catch (...) {
        hot_->PutRows(batch, dirty);  // nothing lost: the rows stay in RAM
        throw;
      }
      const int64_t gr = store_.group_records();
      for (int64_t at = 0; at < batch.size(); ++at) {
        const int64_t i = order[at];
        // A full index is rebuilt larger from every disk row, this segment's too.
        if (!index_.Insert(batch.keys[i], seg, at % gr)) {
          RebuildIndex();
          break;
        }
      }
      for (int64_t i = 0; i < batch.size(); ++i)
        if (dirty[i]) dirty_on_disk_.insert(batch.keys[i]);
      rows_spilled_ += batch.size();
      bytes_spilled_ += batch.size() * RecordBytes();
    }
    hot_->TrimMemory();
  }
#ifdef __GLIBC__
  // The spill's buffers and the rows' freed slack go back to the system too; malloc
  // keeps freed heap memory resident otherwise.
  ::malloc_trim(0);
#endif
}

void TieredTable::Compact() {
  // The emptiest segments first, those at most half live; at most kSpillBytes of live
  // rows rewritten per call, so one step never waits on a rewrite of everything.
  std::vector<std::pair<double, int32_t>> candidates;
  for (int32_t seg : store_.segments()) {
    const int64_t records = store_.records(seg), live = store_.live(seg);
    if (live == 0) {
      store_.Drop(seg);
    } else if (2 * live <= records) {
      candidates.emplace_back(static_cast<double>(live) / records, seg);
    }
  }
  if (candidates.size() < 2) return;  // one half-empty segment alone is not worth a rewrite
  std::sort(candidates.begin(), candidates.end());
  const int64_t budget = std::max<int64_t>(1, kSpillBytes / RecordBytes());
  std::vector<int32_t> chosen;
  int64_t rows = 0;
  for (const auto& c : candidates) {
    if (!chosen.empty() && rows + store_.live(c.second) > budget) break;
    chosen.push_back(c.second);
    rows += store_.live(c.second);
  }
  if (chosen.size() < 2) return;
  RecordBatch batch;
  batch.width = hot_->row_width();
  std::vector<std::pair<int32_t, int64_t>> from;  // (segment, record)
  for (int32_t seg : chosen) {
    store_.Scan(seg, [&](int64_t record, int64_t key, int64_t step, uint32_t freq,
                         const float* row) {
      batch.Add(key, step, freq, row);
      from.emplace_back(seg, record);
    });
  }
  const std::vector<int64_t> order = KeyOrder(batch);
  const int32_t out = store_.Write(batch, &order);
  const int64_t gr = store_.group_records();
  for (int64_t at = 0; at < batch.size(); ++at) {
    const int64_t i = order[at];
    index_.Relabel(batch.keys[i], from[i].first, from[i].second % gr, out, at % gr);
  }
  for (int32_t seg : chosen) store_.Drop(seg);
}

TierStats TieredTable::Stats() const {
  TierStats s;
  s.ram_bytes = RamBytes();
  s.disk_rows = store_.live_rows();
  s.disk_bytes = store_.disk_bytes();
  s.bytes_written = store_.bytes_written();
  s.bytes_spilled = bytes_spilled_;
  s.bytes_read = store_.bytes_read();
  s.read_calls = store_.read_calls();
  s.rows_spilled = rows_spilled_;
  s.rows_faulted = rows_faulted_;
  s.segments = static_cast<int64_t>(store_.segments().size());
  s.index_bytes = index_.bytes();
  s.index_rebuilds = index_rebuilds_;
  return s;
}

}  // namespace tfpsx
