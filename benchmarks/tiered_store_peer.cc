// The disk tier's store against RocksDB behind the same interface (issue 41's peer), and
// both against the table all in RAM, in the table core (no TensorFlow): one process per
// run, built and driven by benchmarks/tiered_table.py (--peer).
//
// The same RAM table (tfpsx::HashTable, 16 stripes, Adagrad), the same steps (lookup by
// FindOrInsert, then Adagrad on the unique keys) and the same policy around each
// operation: its keys not in RAM are brought back whole first (FaultIn), and after it,
// above 90% of ram_bytes, the least recently updated rows leave whole down to 75%
// (Settle; victims chosen stripe by stripe with HashTable::StripeVictims, the
// operation's own keys kept). Only where the rows go differs:
//
//   ours     tfpsx::TieredTable (custom_ops/cc/core/tiered_table.h): segment files, the
//            cuckoo index of disk rows in RAM;
//   rocksdb  RocksDB (librocksdb-dev): a row is a value under its key; a fault-in is one
//            MultiGet of the missing keys and a WriteBatch of their deletes, a spill one
//            WriteBatch of puts. Bloom filters of 10 bits a key, 4 KiB blocks, no
//            compression, no WAL (ours has none: a restart restores its checkpoint), an
//            LRU block cache of 4 MiB, 4 MiB memtables. What RocksDB holds in RAM (its
//            table readers' index and filter blocks, memtables, block cache) counts
//            against ram_bytes as our index does;
//   ours_prefetch  ours, the next batch prefetched on a second thread while a step runs
//            (TieredTable's Prefetch: its reads without the table's lock);
//   ram      no tier (the rows all in RAM).
//
// Prints one JSON line: steps/s, rows faulted and spilled per step, the store's RAM, the
// peak RSS during the stream less the RSS before the table existed, bytes written to
// disk per byte spilled.
//
//   tiered_store_peer STORE DIR RAM_MB FILL DIM STEPS BATCH

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/optimizer_registry.h"
#include "custom_ops/cc/core/record_batch.h"
#include "custom_ops/cc/core/tiered_table.h"
#ifdef TFPSX_PEER_ROCKSDB
#include "rocksdb/cache.h"
#include "rocksdb/db.h"
#include "rocksdb/filter_policy.h"
#include "rocksdb/statistics.h"
#include "rocksdb/table.h"
#include "rocksdb/write_batch.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMix = 0x9E3779B97F4A7C15ULL;  // i -> i * kMix: scrambled keys
constexpr double kHigh = 0.9, kLow = 0.75;        // TierOptions' defaults

int64_t Scrambled(int64_t i) { return static_cast<int64_t>(static_cast<uint64_t>(i) * kMix); }

// What a tier does around an operation on keys (TieredTable's own calls).
struct Tier {
  virtual ~Tier() = default;
  virtual void FaultIn(const int64_t* keys, int64_t n) = 0;
  virtual void Settle(const int64_t* keys, int64_t n) = 0;
  virtual int64_t RamBytes() = 0;        // counted against ram_bytes
  virtual int64_t BytesWritten() = 0;    // to disk, all of it
  virtual int64_t BytesSpilled() = 0;    // of rows moved to disk
  virtual int64_t RowsFaulted() = 0;
  virtual int64_t RowsSpilled() = 0;
};

struct Ours : Tier {
  tfpsx::TieredTable t;
  Ours(tfpsx::HashTable* hot, const std::string& dir, int64_t ram) : t(hot, {dir, ram}) { t.Open(); }
  void FaultIn(const int64_t* k, int64_t n) override { t.FaultIn(k, n); }
  void Settle(const int64_t* k, int64_t n) override { t.Settle(k, n); }
  int64_t RamBytes() override { return t.RamBytes(); }
  int64_t BytesWritten() override { return t.Stats().bytes_written; }
  int64_t BytesSpilled() override { return t.Stats().bytes_spilled; }
  int64_t RowsFaulted() override { return t.Stats().rows_faulted; }
  int64_t RowsSpilled() override { return t.Stats().rows_spilled; }
};

#ifdef TFPSX_PEER_ROCKSDB
struct Rocks : Tier {
  tfpsx::HashTable* hot;
  const int64_t ram, width, record;
  std::unique_ptr<rocksdb::DB> db;
  std::shared_ptr<rocksdb::Cache> cache;
  std::shared_ptr<rocksdb::Statistics> stats;
  int64_t live = 0, faulted = 0, spilled = 0, bytes_spilled = 0;

  Rocks(tfpsx::HashTable* h, const std::string& dir, int64_t ram_bytes)
      : hot(h), ram(ram_bytes), width(h->row_width()), record(20 + 4 * h->row_width()) {
    rocksdb::Options o;
    o.create_if_missing = true;
    o.compression = rocksdb::kNoCompression;
    o.write_buffer_size = 4 << 20;
    o.max_write_buffer_number = 2;
    o.max_background_jobs = 1;  // the machine has 2 cores, the steps take one
    o.statistics = stats = rocksdb::CreateDBStatistics();
    rocksdb::BlockBasedTableOptions t;
    t.block_size = 4096;
    t.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
    t.block_cache = cache = rocksdb::NewLRUCache(4 << 20);
    o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
    rocksdb::DB* raw = nullptr;
    const rocksdb::Status s = rocksdb::DB::Open(o, dir, &raw);
    if (!s.ok()) { std::fprintf(stderr, "rocksdb open: %s\n", s.ToString().c_str()); std::exit(2); }
    db.reset(raw);
  }
  static std::string Key(int64_t k) { return std::string(reinterpret_cast<const char*>(&k), 8); }
  int64_t Prop(const char* name) {
    uint64_t v = 0;
    db->GetIntProperty(name, &v);
    return static_cast<int64_t>(v);
  }
  int64_t RamBytes() override {
    return hot->ResidentBytes() + Prop("rocksdb.estimate-table-readers-mem") +
           Prop("rocksdb.cur-size-all-mem-tables") + static_cast<int64_t>(cache->GetUsage());
  }
  int64_t BytesWritten() override {
    return static_cast<int64_t>(stats->getTickerCount(rocksdb::FLUSH_WRITE_BYTES) +
                                stats->getTickerCount(rocksdb::COMPACT_WRITE_BYTES));
  }
  int64_t BytesSpilled() override { return bytes_spilled; }
  int64_t RowsFaulted() override { return faulted; }
  int64_t RowsSpilled() override { return spilled; }

  void FaultIn(const int64_t* keys, int64_t n) override {
    if (n == 0 || live == 0) return;
    std::unique_ptr<bool[]> present(new bool[n]);
    hot->Present(keys, n, present.get());
    std::vector<int64_t> missing;
    for (int64_t i = 0; i < n; ++i)
      if (!present[i]) missing.push_back(keys[i]);
    std::sort(missing.begin(), missing.end());
    missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
    if (missing.empty()) return;
    const size_t m = missing.size();
    std::vector<std::string> names(m);
    std::vector<rocksdb::Slice> slices(m);
    for (size_t i = 0; i < m; ++i) slices[i] = names[i] = Key(missing[i]);
    std::vector<rocksdb::PinnableSlice> values(m);
    std::vector<rocksdb::Status> status(m);
    db->MultiGet(rocksdb::ReadOptions(), db->DefaultColumnFamily(), m, slices.data(),
                 values.data(), status.data(), /*sorted_input=*/false);
    tfpsx::RecordBatch rows;
    rows.width = width;
    rocksdb::WriteBatch dead;
    for (size_t i = 0; i < m; ++i) {
      if (!status[i].ok()) continue;
      const char* p = values[i].data();
      int64_t step;
      uint32_t freq;
      std::memcpy(&step, p, 8);
      std::memcpy(&freq, p + 8, 4);
      rows.Add(missing[i], step, freq, reinterpret_cast<const float*>(p + 12));
      dead.Delete(slices[i]);
    }
    if (rows.size() == 0) return;
    Write(&dead);
    hot->PutRows(rows, std::vector<uint8_t>(rows.size(), 0));
    live -= rows.size();
    faulted += rows.size();
  }

  void Settle(const int64_t* keep, int64_t n_keep) override {
    if (RamBytes() <= static_cast<int64_t>(kHigh * ram)) return;
    std::vector<int64_t> kept(keep, keep + n_keep);
    std::sort(kept.begin(), kept.end());
    const int64_t per_row = record + 8;
    for (int round = 0; round < 4; ++round) {  // as TieredTable::Spill
      const int64_t excess = RamBytes() - static_cast<int64_t>(kLow * ram), size = hot->Size();
      if (excess <= 0 || size == 0) break;
      const int64_t want = (excess + per_row - 1) / per_row;
      std::vector<int64_t> victims;
      for (int s = 0; s < hot->num_stripes(); ++s) {
        const int64_t share = (want * hot->StripeSize(s) + size - 1) / size;
        int64_t taken = 0;
        for (int64_t k : hot->StripeVictims(s, share + static_cast<int64_t>(kept.size()))) {
          if (taken == share) break;
          if (std::binary_search(kept.begin(), kept.end(), k)) continue;
          victims.push_back(k);
          ++taken;
        }
      }
      if (victims.empty()) break;
      tfpsx::RecordBatch rows;
      rows.width = width;
      std::vector<uint8_t> dirty;
      hot->TakeRows(victims.data(), static_cast<int64_t>(victims.size()), &rows, &dirty);
      rocksdb::WriteBatch puts;
      std::string value(static_cast<size_t>(12 + 4 * width), '\0');
      for (int64_t i = 0; i < rows.size(); ++i) {
        std::memcpy(&value[0], &rows.steps[i], 8);
        std::memcpy(&value[8], &rows.freqs[i], 4);
        std::memcpy(&value[12], rows.rows.data() + i * width, 4 * width);
        puts.Put(Key(rows.keys[i]), value);
      }
      Write(&puts);
      live += rows.size();
      spilled += rows.size();
      bytes_spilled += rows.size() * record;
      hot->TrimMemory();
    }
    ::malloc_trim(0);
  }

  void Write(rocksdb::WriteBatch* batch) {
    rocksdb::WriteOptions w;
    w.disableWAL = true;
    const rocksdb::Status s = db->Write(w, batch);
    if (!s.ok()) { std::fprintf(stderr, "rocksdb write: %s\n", s.ToString().c_str()); std::exit(2); }
  }
};
#endif

// A field of /proc/self/status, kB (VmRSS, VmHWM).
int64_t StatusKb(const char* field) {
  FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  int64_t kb = 0;
  const size_t len = std::strlen(field);
  while (f != nullptr && std::fgets(line, sizeof(line), f)) {
    if (std::strncmp(line, field, len) == 0 && line[len] == ':') kb = std::atoll(line + len + 1);
  }
  if (f != nullptr) std::fclose(f);
  return kb;
}

// Resets VmHWM to the current RSS (the peak from here).
void ResetPeak() {
  FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f != nullptr) {
    std::fputs("5", f);
    std::fclose(f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s ours|ours_prefetch|rocksdb|ram DIR RAM_MB FILL DIM STEPS BATCH\n", argv[0]);
    return 2;
  }
  const std::string store = argv[1], dir = argv[2];
  const int64_t ram = std::atoll(argv[3]) << 20, dim = std::atoll(argv[5]);
  const double fill = std::atof(argv[4]);
  const int steps = std::atoi(argv[6]), batch = std::atoi(argv[7]);

  const int64_t record = 20 + 4 * 2 * dim, rows = static_cast<int64_t>(fill * ram / record);
  // Zipf(1.1) over the filled ids (an inverse CDF over a finite support), 1% new ids.
  std::vector<double> cdf(static_cast<size_t>(rows));
  double total = 0;
  for (int64_t i = 0; i < rows; ++i) cdf[i] = total += std::pow(i + 1.0, -1.1);
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> u01(0, 1);
  int64_t fresh = rows;
  std::vector<std::vector<int64_t>> feeds(20 + steps, std::vector<int64_t>(batch));
  for (auto& f : feeds) {
    for (int i = 0; i < batch; ++i)
      f[i] = Scrambled(std::lower_bound(cdf.begin(), cdf.end(), u01(gen) * total) - cdf.begin());
    for (int i = 0; i < batch / 100; ++i) f[i] = Scrambled(fresh++);
  }
  std::vector<double>().swap(cdf);

  // The table's memory: the process's RSS from here (the feeds made before it).
  const int64_t base_kb = StatusKb("VmRSS");
  tfpsx::TableOptions o;
  o.dim = dim;
  o.num_slots = 1;
  o.slot_init = {0.1f};
  o.init = tfpsx::InitKind::kNormal;
  o.init_b = 0.01f;
  o.seed = 7;
  o.num_stripes = 16;  // a tiered shard's
  tfpsx::HashTable hot(o);
  std::unique_ptr<Tier> tier;
  if (store == "ours" || store == "ours_prefetch") tier.reset(new Ours(&hot, dir, ram));
#ifdef TFPSX_PEER_ROCKSDB
  else if (store == "rocksdb") tier.reset(new Rocks(&hot, dir, ram));
#endif
  else if (store != "ram") { std::fprintf(stderr, "unknown store %s\n", store.c_str()); return 2; }

  const tfpsx::OptimizerInfo* adagrad = tfpsx::FindOptimizer("adagrad");
  const float hp[2] = {0.05f, 1e-7f};
  std::vector<float> out, grads;
  int64_t step = 0;
  auto train = [&](std::vector<int64_t> keys) {
    const int64_t n = static_cast<int64_t>(keys.size());
    out.resize(static_cast<size_t>(n * dim));
    if (tier) tier->FaultIn(keys.data(), n);
    hot.FindOrInsert(keys.data(), n, step, out.data());
    if (tier) tier->Settle(keys.data(), n);
    std::sort(keys.begin(), keys.end());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    const int64_t u = static_cast<int64_t>(keys.size());
    grads.resize(static_cast<size_t>(u * dim));
    for (int64_t i = 0; i < u * dim; ++i) grads[i] = 0.01f * std::sin(out[i % (n * dim)]);
    if (tier) tier->FaultIn(keys.data(), u);
    adagrad->apply(hot, keys.data(), u, grads.data(), hp, step);
    if (tier) tier->Settle(keys.data(), u);
    ++step;
  };

  std::mutex mu;  // the table's lock (TableResource::tier_mu)
  int64_t prefetched = 0;  // rows the prefetches brought back
  const bool ahead = store == "ours_prefetch";
  // A step with the next batch's prefetch beside it: planned under the lock first (the
  // op's first part), read by a second thread while the step runs, placed after.
  auto stream = [&](int first, int end) {
    for (int i = first; i < end; ++i) {
      std::thread coming;
      if (ahead && i + 1 < end) {
        tfpsx::TieredTable& t = static_cast<Ours*>(tier.get())->t;
        auto p = std::make_shared<tfpsx::TieredTable::Prefetch>();
        {
          std::lock_guard<std::mutex> lock(mu);
          *p = t.PlanPrefetch(feeds[i + 1].data(), static_cast<int64_t>(feeds[i + 1].size()));
        }
        coming = std::thread([&t, &mu, &prefetched, p] {
          if (p->keys.empty()) return;
          tfpsx::TieredTable::ReadPrefetch(p.get());
          std::lock_guard<std::mutex> lock(mu);
          prefetched += t.PlacePrefetch(p.get());
          t.Settle(p->keys.data(), static_cast<int64_t>(p->keys.size()));
        });
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        train(feeds[i]);
      }
      if (coming.joinable()) coming.join();
    }
  };

  auto t0 = Clock::now();
  for (int64_t at = 0; at < rows; at += 8192) {
    std::vector<int64_t> keys;
    for (int64_t i = at; i < std::min(rows, at + 8192); ++i) keys.push_back(Scrambled(i));
    train(keys);
  }
  const double fill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  stream(0, 20);  // warm: the stream's hot rows in RAM
  ResetPeak();
  const int64_t f0 = tier ? tier->RowsFaulted() : 0, s0 = tier ? tier->RowsSpilled() : 0;
  const int64_t p0 = prefetched;
  const int64_t w0 = tier ? tier->BytesWritten() : 0, b0 = tier ? tier->BytesSpilled() : 0;
  t0 = Clock::now();
  stream(20, 20 + steps);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  const double spilled = tier ? static_cast<double>(tier->BytesSpilled() - b0) : 0;
  std::printf(
      "RESULT {\"store\": \"%s\", \"rows\": %lld, \"fill_s\": %.2f, \"steps_per_s\": %.2f, "
      "\"faulted_per_step\": %.1f, \"prefetched_per_step\": %.1f, \"spilled_per_step\": %.1f, \"ram_rows\": %lld, "
      "\"tier_ram_bytes\": %lld, \"peak_rss_kb\": %lld, \"written_per_spilled\": %.3f}\n",
      store.c_str(), static_cast<long long>(rows), fill_s, steps / took,
      tier ? double(tier->RowsFaulted() - f0) / steps : 0.0, double(prefetched - p0) / steps,
      tier ? double(tier->RowsSpilled() - s0) / steps : 0.0,
      static_cast<long long>(hot.Size()),
      static_cast<long long>(tier ? tier->RamBytes() : hot.ResidentBytes()),
      static_cast<long long>(StatusKb("VmHWM") - base_kb),
      spilled > 0 ? (tier->BytesWritten() - w0) / spilled : 0.0);
  return 0;
}
