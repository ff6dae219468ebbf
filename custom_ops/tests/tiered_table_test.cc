// Native tests of the disk tier (key_index.h, segment_store.h, tiered_table.h): a tiered
// table driven through the same operations as an all-in-RAM one must hold the same rows
// (values, slots, frequencies, steps) at every check, within its RAM budget.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "custom_ops/cc/core/batch_reader.h"
#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/key_index.h"
#include "custom_ops/cc/core/optimizer_registry.h"
#include "custom_ops/cc/core/tiered_table.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx_test::failures;

std::string TempDir(const char* name) {
  char tmpl[] = "/tmp/tfpsx_tier_XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (dir == nullptr) throw std::runtime_error("mkdtemp failed");
  return std::string(dir) + "/" + name;
}

tfpsx::TableOptions Opts(int64_t dim) {
  tfpsx::TableOptions o;
  o.dim = dim;
  o.num_slots = 1;  // Adagrad's accumulator
  o.slot_init = {0.1f};
  o.init = tfpsx::InitKind::kNormal;
  o.init_b = 0.1f;
  o.seed = 7;
  o.num_stripes = 8;  // as a tiered shard's RAM table (fewer partly filled chunks)
  return o;
}

bool SameRows(const tfpsx::ExportedRows& a, const tfpsx::ExportedRows& b) {
  return a.keys == b.keys && a.values == b.values && a.slots == b.slots && a.freq == b.freq &&
         a.step == b.step;
}

// One all-in-RAM table and one tiered, driven alike.
struct Pair {
  tfpsx::HashTable ref{Opts(16)};
  tfpsx::HashTable hot{Opts(16)};
  tfpsx::TieredTable tier;
  const tfpsx::OptimizerInfo* adagrad = tfpsx::FindOptimizer("adagrad");
  int64_t max_ram = 0;

  explicit Pair(int64_t ram_bytes) : tier(&hot, {TempDir("t/part_0"), ram_bytes}) { tier.Open(); }

  // A training step: lookup (find_or_insert), then Adagrad on the unique keys.
  void Step(const std::vector<int64_t>& keys, int64_t step) {
    std::vector<float> out(keys.size() * 16), out_ref(keys.size() * 16);
    const int64_t n = static_cast<int64_t>(keys.size());
    tier.FaultIn(keys.data(), n);
    hot.FindOrInsert(keys.data(), n, step, out.data());
    tier.Settle();
    ref.FindOrInsert(keys.data(), n, step, out_ref.data());
    CHECK(out == out_ref);
    std::vector<int64_t> unique = keys;
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    std::vector<float> grads(unique.size() * 16);
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = 0.01f * static_cast<float>(i % 7) - 0.03f;
    const float hp[2] = {0.05f, 1e-7f};
    const int64_t u = static_cast<int64_t>(unique.size());
    tier.FaultIn(unique.data(), u);
    adagrad->apply(hot, unique.data(), u, grads.data(), hp, step);
    tier.Settle();
    adagrad->apply(ref, unique.data(), u, grads.data(), hp, step);
    max_ram = std::max(max_ram, tier.RamBytes());
  }
};

std::vector<int64_t> ZipfBatch(std::mt19937_64& rng, int64_t n, int64_t universe) {
  // Log-uniform ids (Zipf with exponent 1): small ids hot, a long tail, scrambled.
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int64_t> keys(static_cast<size_t>(n));
  for (auto& k : keys) {
    const double x = std::exp(u(rng) * std::log(static_cast<double>(universe)));
    k = (static_cast<int64_t>(x) - 1) * 2654435761LL;
  }
  return keys;
}

void TestBatchReader() {
  // 600 reads at scattered offsets (more than a ring's 256) come back whole, through
  // io_uring and through pread alike; a read past the end names the file.
  const std::string path = TempDir("reads");
  std::vector<char> data(1 << 20);
  std::mt19937_64 rng(5);
  for (char& c : data) c = static_cast<char>(rng());
  FILE* f = std::fopen(path.c_str(), "wb");
  CHECK(f != nullptr && std::fwrite(data.data(), 1, data.size(), f) == data.size());
  std::fclose(f);
  for (const char* setting : {"1", "0"}) {
    ::setenv("TFPSX_TIER_IO_URING", setting, 1);
    std::thread reader([&] {  // a thread's first batch reads the setting
      const int fd = ::open(path.c_str(), O_RDONLY);
      CHECK(fd >= 0);
      std::vector<tfpsx::FileRead> ops;
      std::vector<std::vector<char>> bufs(600);
      for (size_t i = 0; i < bufs.size(); ++i) {
        const int64_t bytes = 1 + static_cast<int64_t>(rng() % 9000);
        const int64_t offset = static_cast<int64_t>(rng() % (data.size() - bytes));
        bufs[i].resize(static_cast<size_t>(bytes));
        ops.push_back({fd, &path, bufs[i].data(), bytes, offset});
      }
      const int64_t submissions = tfpsx::ReadAll(ops.data(), static_cast<int64_t>(ops.size()));
      // 3 through a ring (256 a submission); a kernel that refuses the ring, or its
      // read opcode after the first submission, reads the rest one pread each.
      CHECK(tfpsx::BatchReadsUseIoUring() ? submissions == 3 : submissions >= 345);
      if (setting[0] == '0') CHECK(!tfpsx::BatchReadsUseIoUring());
      for (size_t i = 0; i < ops.size(); ++i)
        CHECK(std::equal(bufs[i].begin(), bufs[i].end(), data.begin() + ops[i].offset));
      std::vector<char> tail(100);
      tfpsx::FileRead past{fd, &path, tail.data(), 100, static_cast<int64_t>(data.size()) - 10};
      bool named = false;
      try {
        tfpsx::ReadAll(&past, 1);
      } catch (const std::runtime_error& e) {
        named = std::string(e.what()).find(path) != std::string::npos;
      }
      CHECK(named);
      ::close(fd);
    });
    reader.join();
  }
  ::unsetenv("TFPSX_TIER_IO_URING");
  std::printf("batch reads: io_uring %s here\n",
              tfpsx::BatchReadsUseIoUring() ? "used" : "not used");
}

// A batch that fails part way (a file cut short among reads still with the kernel)
// throws only once every read of it is done and its completions are off the ring: the
// thread's next batch reads exactly its own data. Pipes make reads the kernel finishes
// later (a page-cache read finishes inside the submitting call).
void TestBatchReaderAfterAnError() {
  std::thread reader([] {
    if (!tfpsx::BatchReadsUseIoUring()) return;  // pread cannot read a pipe at an offset
    const std::string cut_path = TempDir("cut"), pipe_name = "a pipe";
    const int cut = ::open(cut_path.c_str(), O_RDWR | O_CREAT, 0600);
    CHECK(cut >= 0 && ::write(cut, "0123456789", 10) == 10);
    int first[2], second[2];
    CHECK(::pipe(first) == 0 && ::pipe(second) == 0);
    std::vector<char> cut_buf(4096), first_buf(64, 0), second_buf(64, 0);
    tfpsx::FileRead batch[2] = {{cut, &cut_path, cut_buf.data(), 4096, 0},
                                {first[0], &pipe_name, first_buf.data(), 64, 0}};
    std::thread writer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      CHECK(::write(first[1], std::string(64, 'a').data(), 64) == 64);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      CHECK(::write(second[1], std::string(64, 'b').data(), 64) == 64);
    });
    std::string error;
    try {
      tfpsx::ReadAll(batch, 2);
    } catch (const std::runtime_error& e) {
      error = e.what();
    }
    CHECK(error.find(cut_path) != std::string::npos);
    CHECK(first_buf == std::vector<char>(64, 'a'));  // done before the throw
    tfpsx::FileRead next{second[0], &pipe_name, second_buf.data(), 64, 0};
    std::string then;
    try {
      tfpsx::ReadAll(&next, 1);
    } catch (const std::runtime_error& e) {
      then = e.what();
    }
    CHECK(then.empty());
    CHECK(second_buf == std::vector<char>(64, 'b'));
    writer.join();
    for (int fd : {cut, first[0], first[1], second[0], second[1]}) ::close(fd);
  });
  reader.join();
}

// The candidates of one key: (segment, slot) pairs.
std::vector<std::pair<int32_t, int32_t>> Places(const tfpsx::KeyIndex& index, int64_t key) {
  std::vector<tfpsx::KeyIndex::Candidate> c;
  index.Candidates(&key, 1, &c);
  std::vector<std::pair<int32_t, int32_t>> out;
  for (const auto& x : c) out.emplace_back(x.segment, x.slot);
  return out;
}

void TestKeyIndex() {
  const int64_t n = 400000;
  // Sized for n at the rebuild's load, as TieredTable's rebuild does: it fills to 95%.
  tfpsx::KeyIndex index(tfpsx::KeyIndex::BucketsFor(n));
  auto place = [](int64_t k) { return std::make_pair<int32_t, int32_t>(k % 1000, k % 32); };
  for (int64_t k = 0; k < n; ++k) CHECK(index.Insert(k * 7919, k % 1000, k % 32));
  CHECK(index.size() == n);
  int64_t missing = 0, extra = 0;
  for (int64_t k = 0; k < n; ++k) {
    const auto got = Places(index, k * 7919);
    if (std::find(got.begin(), got.end(), place(k)) == got.end()) ++missing;
    extra += static_cast<int64_t>(got.size()) - 1;
  }
  CHECK(missing == 0);
  CHECK(extra < n / 100);  // fingerprint collisions: a read each, rare
  // Candidates of many keys at once: the same as one by one.
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < 1000; ++k) keys.push_back(k * 7919);
  std::vector<tfpsx::KeyIndex::Candidate> many;
  index.Candidates(keys.data(), static_cast<int64_t>(keys.size()), &many);
  std::vector<std::pair<int32_t, int32_t>> one_by_one, together;
  for (int64_t key : keys) {
    const auto got = Places(index, key);
    one_by_one.insert(one_by_one.end(), got.begin(), got.end());
  }
  for (const auto& c : many) together.emplace_back(c.segment, c.slot);
  CHECK(together == one_by_one && together.size() >= keys.size());
  int64_t never = 0;
  for (int64_t k = 0; k < n; ++k) never += static_cast<int64_t>(Places(index, -k - 1).size());
  CHECK(never < n / 100);  // a key never stored costs (almost) no read
  const double bytes_per_key = static_cast<double>(index.bytes()) / n;
  std::printf("key index: %.2f bytes/key at %.0f%% load, %.4f%% false candidates\n",
              bytes_per_key, 100.0 * n / (index.buckets() * tfpsx::KeyIndex::kWays),
              100.0 * never / n);
  CHECK(bytes_per_key <= 6.8);
  // Full at 95%: Insert refuses, nothing changes; the owner rebuilds it larger.
  int64_t k = n;
  while (index.Insert(k * 7919, 1, 1)) ++k;
  const int64_t full = index.size();
  CHECK(full >= static_cast<int64_t>(0.94 * index.buckets() * tfpsx::KeyIndex::kWays));
  CHECK(!index.Insert(-5, 1, 1) && index.size() == full);
  for (int64_t j = n; j < k; ++j) CHECK(index.Erase(j * 7919, 1, 1));
  // Erase and Relabel match the whole entry: a key's other place is not touched.
  for (int64_t j = 0; j < n; j += 2) CHECK(index.Erase(j * 7919, j % 1000, j % 32));
  CHECK(!index.Erase(0, 0, 0));
  CHECK(index.size() == n / 2);
  CHECK(index.Insert(7919, 1, 1) && index.Insert(7919, 1, 2));  // two places of one key
  CHECK(index.Relabel(7919, 1, 2, 6, 7));
  auto got = Places(index, 7919);
  CHECK(std::find(got.begin(), got.end(), std::make_pair(1, 1)) != got.end());
  CHECK(std::find(got.begin(), got.end(), std::make_pair(6, 7)) != got.end());
  CHECK(std::find(got.begin(), got.end(), std::make_pair(1, 2)) == got.end());
  // A level of 2 buckets filled until it refuses: entries kicked between their buckets
  // (and kicks that failed, undone) leave every key placed still found.
  index.Reset(2);
  int64_t placed = 0;
  while (index.Insert(placed * 7919, placed, placed % 32)) ++placed;
  CHECK(placed >= 1 && index.size() == placed);
  for (int64_t j = 0; j < placed; ++j) {
    const auto at = Places(index, j * 7919);
    CHECK(std::find(at.begin(), at.end(), std::make_pair<int32_t, int32_t>(j, j % 32)) !=
          at.end());
  }
  // Reset empties it at the new size; bad places are named errors.
  index.Reset(100);
  CHECK(index.size() == 0 && index.buckets() == 100 && Places(index, 7919).empty());
  bool threw = false;
  try { index.Insert(1, 0, 32); } catch (const std::out_of_range&) { threw = true; }
  CHECK(threw);
}

void TestTrainsAsInRam() {
  // A 1.2 MB budget, up to 60k keys of 148-byte records (8.9 MB of rows).
  Pair p(1200 * 1000);
  std::mt19937_64 rng(1);
  for (int64_t step = 1; step <= 300; ++step) {
    p.Step(ZipfBatch(rng, 512, 60000), step);
    if (failures) break;
  }
  const tfpsx::TierStats st = p.tier.Stats();
  std::printf("tiered: %ld rows (%ld on disk), RAM %ld of %ld (max %ld), %ld segments, "
              "%ld faulted, %ld spilled, written %ld for %ld spilled bytes, index rebuilt %ld "
              "times\n",
              static_cast<long>(p.tier.Size()), static_cast<long>(st.disk_rows),
              static_cast<long>(st.ram_bytes), 1200L * 1000, static_cast<long>(p.max_ram),
              static_cast<long>(st.segments), static_cast<long>(st.rows_faulted),
              static_cast<long>(st.rows_spilled), static_cast<long>(st.bytes_written),
              static_cast<long>(st.bytes_spilled), static_cast<long>(st.index_rebuilds));
  CHECK(st.disk_rows > p.hot.Size());  // most rows live on disk
  CHECK(st.index_rebuilds > 0);  // it grew with the disk's rows, rebuilt from them
  CHECK(st.rows_faulted > 0);
  CHECK(p.max_ram <= 1200 * 1000);
  CHECK(p.tier.Size() == p.ref.Size());
  CHECK(SameRows(p.tier.ExportSince(INT64_MIN), p.ref.Export()));
  CHECK(SameRows(p.tier.ExportSince(150), p.ref.ExportSince(150)));
  CHECK(st.bytes_written <= 3 * st.bytes_spilled);
  // A read-only lookup finds the rows on disk where they are, larger than RAM's room
  // for a batch, and moves none.
  std::vector<int64_t> keys = ZipfBatch(rng, 20000, 60000);
  for (int64_t i = 0; i < 100; ++i) keys[i] = -1 - i;  // never seen
  const int64_t n = static_cast<int64_t>(keys.size());
  std::vector<float> got(n * 32), want(n * 32);
  std::unique_ptr<bool[]> got_found(new bool[n]), want_found(new bool[n]);
  p.hot.FindWithSlots(keys.data(), n, got.data(), got_found.get());
  p.tier.FindOnDisk(keys.data(), n, 32, got.data(), got_found.get());
  p.ref.FindWithSlots(keys.data(), n, want.data(), want_found.get());
  CHECK(got == want);
  CHECK(std::equal(got_found.get(), got_found.get() + n, want_found.get()));
  CHECK(p.tier.Stats().disk_rows == st.disk_rows);
  // Most disk rows evicted: the next operation's Settle rebuilds the index for the
  // rest, and every row is still found.
  const tfpsx::TierStats grown = p.tier.Stats();
  CHECK(p.tier.EvictToTopN(4000) == p.ref.EvictToTopN(4000));
  p.tier.Settle();
  const tfpsx::TierStats shrunk = p.tier.Stats();
  std::printf("index: %ld bytes for %ld disk rows, then %ld for %ld\n",
              static_cast<long>(grown.index_bytes), static_cast<long>(grown.disk_rows),
              static_cast<long>(shrunk.index_bytes), static_cast<long>(shrunk.disk_rows));
  CHECK(shrunk.index_rebuilds > grown.index_rebuilds);
  CHECK(shrunk.index_bytes < grown.index_bytes);
  CHECK(SameRows(p.tier.ExportSince(INT64_MIN), p.ref.Export()));
  for (int64_t step = 301; step <= 310; ++step) p.Step(ZipfBatch(rng, 512, 60000), step);
  CHECK(SameRows(p.tier.ExportSince(INT64_MIN), p.ref.Export()));
}


void TestPrefetch() {
  // A prefetch brings a coming batch's disk rows into RAM, its reads outside the lock:
  // the next step finds them there, and racing steps (which move, compact and fault
  // rows meanwhile) lose nothing: the table ends with the rows of one trained without.
  Pair p(1200 * 1000);
  std::mt19937_64 rng(3);
  std::vector<std::vector<int64_t>> batches;
  for (int i = 0; i < 240; ++i) batches.push_back(ZipfBatch(rng, 512, 60000));
  for (int64_t step = 1; step <= 40; ++step) p.Step(batches[step - 1], step);
  // One prefetch alone: the batch's disk rows come back, the step faults none of them.
  std::vector<int64_t> next = batches[40];
  tfpsx::TieredTable::Prefetch plan = p.tier.PlanPrefetch(next.data(), 512);
  CHECK(!plan.keys.empty());
  tfpsx::TieredTable::ReadPrefetch(&plan);
  const int64_t placed = p.tier.PlacePrefetch(&plan);
  p.tier.Settle(plan.keys.data(), static_cast<int64_t>(plan.keys.size()));
  CHECK(placed > 0);
  const int64_t faulted = p.tier.Stats().rows_faulted;
  p.Step(next, 41);
  CHECK(p.tier.Stats().rows_faulted == faulted);  // every row of the step was in RAM
  // Racing: a thread prefetches batch s+1 (reads unlocked) while step s runs locked.
  std::mutex mu;
  int64_t raced = 0;
  for (int64_t step = 42; step <= 240 && !failures; ++step) {
    std::thread ahead([&] {
      tfpsx::TieredTable::Prefetch q;
      {
        std::lock_guard<std::mutex> lock(mu);
        q = p.tier.PlanPrefetch(batches[step % 240].data(), 512);
      }
      tfpsx::TieredTable::ReadPrefetch(&q);
      std::lock_guard<std::mutex> lock(mu);
      raced += p.tier.PlacePrefetch(&q);
      p.tier.Settle(q.keys.data(), static_cast<int64_t>(q.keys.size()));
    });
    {
      std::lock_guard<std::mutex> lock(mu);
      p.Step(batches[step - 1], step);
    }
    ahead.join();
  }
  CHECK(raced > 0);
  CHECK(p.max_ram <= 1200 * 1000);
  CHECK(p.tier.Size() == p.ref.Size());
  CHECK(SameRows(p.tier.ExportSince(INT64_MIN), p.ref.Export()));
}

// Applies an incremental checkpoint to the rows of the one before.
tfpsx::ExportedRows Apply(const tfpsx::ExportedRows& base, const tfpsx::CheckpointRows& delta) {
  tfpsx::HashTable t(Opts(16));
  t.Import(base.keys.data(), static_cast<int64_t>(base.keys.size()), base.values.data(),
           base.slots.data(), static_cast<int64_t>(base.slots.size()), base.freq.data(),
           base.step.data(), true);
  t.Remove(delta.removed.data(), static_cast<int64_t>(delta.removed.size()));
  const auto& r = delta.rows;
  t.Import(r.keys.data(), static_cast<int64_t>(r.keys.size()), r.values.data(), r.slots.data(),
           static_cast<int64_t>(r.slots.size()), r.freq.data(), r.step.data(), false);
  return t.Export();
}

void TestCheckpointsAndEviction() {
  Pair p(1000 * 1000);
  std::mt19937_64 rng(2);
  for (int64_t step = 1; step <= 60; ++step) p.Step(ZipfBatch(rng, 512, 200000), step);
  tfpsx::CheckpointRows full = p.tier.CheckpointExport(true);
  p.ref.CheckpointExport(true);
  CHECK(full.complete);
  CHECK(SameRows(full.rows, p.ref.Export()));
  tfpsx::ExportedRows saved = full.rows;
  const tfpsx::ExportedRows first = full.rows;
  for (int round = 0; round < 3; ++round) {
    for (int64_t step = 61 + round * 20; step <= 80 + round * 20; ++step)
      p.Step(ZipfBatch(rng, 512, 200000), step);
    // Removals and evictions on both tiers, between checkpoints.
    std::vector<int64_t> gone = ZipfBatch(rng, 300, 200000);
    const int64_t a = p.tier.Remove(gone.data(), 300);
    CHECK(a == p.ref.Remove(gone.data(), 300));
    const int64_t old = 50 + round * 20;
    CHECK(p.tier.EvictOlderThan(old) == p.ref.EvictOlderThan(old));
    tfpsx::CheckpointRows delta = p.tier.CheckpointExport(false);
    p.ref.CheckpointExport(false);
    CHECK(delta.complete);
    saved = Apply(saved, delta);
    CHECK(SameRows(saved, p.ref.Export()));
    // A delta holds what changed, not the table.
    CHECK(static_cast<int64_t>(delta.rows.keys.size()) < p.ref.Size());
  }
  CHECK(p.tier.EvictToTopN(3000) == p.ref.EvictToTopN(3000));
  CHECK(SameRows(p.tier.ExportSince(INT64_MIN), p.ref.Export()));
  // A restore: the checkpoint's rows, exactly, though they exceed the budget.
  const std::string error = p.tier.Import(
      first.keys.data(), static_cast<int64_t>(first.keys.size()), first.values.data(),
      first.slots.data(), static_cast<int64_t>(first.slots.size()), first.freq.data(),
      first.step.data(), true);
  CHECK(error.empty());
  CHECK(SameRows(p.tier.ExportSince(INT64_MIN), first));
  CHECK(p.tier.RamBytes() <= 1000 * 1000);
  // More rows than the budget holds: some restored straight to disk.
  CHECK(static_cast<int64_t>(first.keys.size()) * 148 > 1000 * 1000);
  CHECK(p.tier.Stats().disk_rows > 0);
}

void Append(const tfpsx::ExportedRows& from, tfpsx::ExportedRows* to) {
  to->keys.insert(to->keys.end(), from.keys.begin(), from.keys.end());
  to->values.insert(to->values.end(), from.values.begin(), from.values.end());
  to->slots.insert(to->slots.end(), from.slots.begin(), from.slots.end());
  to->freq.insert(to->freq.end(), from.freq.begin(), from.freq.end());
  to->step.insert(to->step.end(), from.step.begin(), from.step.end());
}

// A paged export (a full checkpoint, a serving export) reads the table in key ranges:
// the pages together are the export, each about max_rows rows, none moved; a paged full
// checkpoint is the base of the next delta as a whole one is.
void TestPagedExport() {
  Pair p(1000 * 1000);
  std::mt19937_64 rng(5);
  for (int64_t step = 1; step <= 60; ++step) p.Step(ZipfBatch(rng, 512, 200000), step);
  CHECK(p.tier.Stats().disk_rows > 2 * p.hot.Size());  // most rows on disk
  const tfpsx::TierStats before = p.tier.Stats();
  const int64_t max_rows = 2000;
  p.tier.ArmTracking();
  p.ref.ArmTracking();
  const std::vector<int64_t> bounds = p.tier.PageBounds(max_rows);
  CHECK(static_cast<int64_t>(bounds.size()) + 1 >= p.tier.Size() / max_rows);
  CHECK(std::is_sorted(bounds.begin(), bounds.end()));
  CHECK(std::adjacent_find(bounds.begin(), bounds.end()) == bounds.end());
  tfpsx::ExportedRows all;
  const int64_t slack = before.segments * 28 + max_rows / 64;  // a group a segment, a sample
  int64_t largest = 0;
  for (size_t page = 0; page <= bounds.size(); ++page) {
    const int64_t lo = page == 0 ? INT64_MIN : bounds[page - 1];
    const int64_t hi = page == bounds.size() ? INT64_MAX : bounds[page] - 1;
    const tfpsx::ExportedRows rows = p.tier.ExportRange(lo, hi);
    largest = std::max<int64_t>(largest, static_cast<int64_t>(rows.keys.size()));
    CHECK(rows.keys.empty() || (rows.keys.front() >= lo && rows.keys.back() <= hi));
    Append(rows, &all);
  }
  CHECK(largest <= max_rows + slack);
  CHECK(SameRows(all, p.ref.Export()));
  CHECK(p.tier.Stats().rows_faulted == before.rows_faulted);  // nothing came back to RAM
  CHECK(p.tier.Stats().disk_rows == before.disk_rows);
  CHECK(p.tier.ExportRange(5, 4).keys.empty());
  // The RAM table alone: whole when not asked to page, by range as the tier.
  CHECK(SameRows(p.ref.ExportRange(INT64_MIN, INT64_MAX), p.ref.Export()));
  // A paged full export with training and removals between its pages (spills, rows
  // brought back): each page is a moment of its own, and what changed after the first
  // is in the next delta, so the two restore exactly.
  p.tier.ArmTracking();
  const std::vector<int64_t> again = p.tier.PageBounds(max_rows / 4);
  tfpsx::ExportedRows paged;
  int64_t step = 61;
  for (size_t page = 0; page <= again.size(); ++page) {
    const tfpsx::ExportedRows rows = p.tier.ExportRange(
        page == 0 ? INT64_MIN : again[page - 1],
        page == again.size() ? INT64_MAX : again[page] - 1);
    Append(rows, &paged);
    if (page % 3 == 0) p.Step(ZipfBatch(rng, 512, 200000), step++);
    if (page % 7 == 0) {
      std::vector<int64_t> gone = ZipfBatch(rng, 100, 200000);
      CHECK(p.tier.Remove(gone.data(), 100) == p.ref.Remove(gone.data(), 100));
    }
  }
  CHECK(step > 70);
  tfpsx::CheckpointRows delta = p.tier.CheckpointExport(false);
  CHECK(delta.complete);
  CHECK(SameRows(Apply(paged, delta), p.ref.Export()));
  // A paged delta, training between its pages too: it and the next delta restore exactly.
  const tfpsx::ExportedRows base = Apply(paged, delta);
  for (int64_t end = step + 10; step < end; ++step) p.Step(ZipfBatch(rng, 512, 200000), step);
  tfpsx::CheckpointRows paged_delta = p.tier.BeginDelta();
  CHECK(paged_delta.complete && paged_delta.rows.keys.empty());
  const std::vector<int64_t> delta_bounds = p.tier.DeltaBounds(300);
  CHECK(delta_bounds.size() >= 3);
  for (size_t page = 0; page <= delta_bounds.size(); ++page) {
    const tfpsx::ExportedRows rows = p.tier.DeltaRange(
        page == 0 ? INT64_MIN : delta_bounds[page - 1],
        page == delta_bounds.size() ? INT64_MAX : delta_bounds[page] - 1);
    CHECK(static_cast<int64_t>(rows.keys.size()) <= 300);
    Append(rows, &paged_delta.rows);
    if (page % 2 == 0) p.Step(ZipfBatch(rng, 512, 200000), step++);
  }
  const tfpsx::CheckpointRows last = p.tier.CheckpointExport(false);
  CHECK(last.complete);
  CHECK(SameRows(Apply(Apply(base, paged_delta), last), p.ref.Export()));
  // One page where the table fits in one.
  CHECK(p.tier.PageBounds(p.tier.Size()).empty());
}

void TestErrors() {
  tfpsx::HashTable hot(Opts(16));
  bool threw = false;
  try {
    tfpsx::TieredTable t(&hot, {"/proc/tfpsx_cannot/part_0", 1 << 20});
    t.Open();
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()).find("/proc/tfpsx_cannot") != std::string::npos;
  }
  CHECK(threw);
  threw = false;
  try {
    tfpsx::TieredTable small(&hot, {TempDir("s/part_0"), 100 * 1000});
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("ram_bytes=100000 is below") != std::string::npos;
  }
  CHECK(threw);
  tfpsx::TieredTable t(&hot, {TempDir("e/part_0"), 1000 * 1000});
  t.Open();
  std::vector<int64_t> keys(5000);
  for (int64_t i = 0; i < 5000; ++i) keys[i] = i;
  threw = false;
  try {
    t.FaultIn(keys.data(), 5000);
  } catch (const std::length_error& e) {
    threw = std::string(e.what()).find("ram_bytes must be at least") != std::string::npos;
  }
  CHECK(threw);
  CHECK(hot.Size() == 0);
}

// A tier folder belongs to one open table: a second opener (another process, or
// another table of this one) is refused, naming the owner, and changes nothing there;
// the folder is free again once the first is gone. Rows and the lock are this user's.
void TestOneOwner() {
  const std::string dir = TempDir("o/part_0");
  tfpsx::HashTable hot(Opts(16));
  auto first = std::make_unique<tfpsx::TieredTable>(&hot, tfpsx::TierOptions{dir, 1200 * 1000});
  first->Open();
  std::vector<int64_t> keys(500);
  std::vector<float> out(500 * 16);
  int64_t next = 0;
  while (first->Stats().disk_rows < 3000) {
    for (auto& k : keys) k = next++;
    hot.FindOrInsert(keys.data(), 500, 1, out.data());
    first->Settle();
  }
  const tfpsx::ExportedRows before = first->ExportSince(INT64_MIN);
  std::vector<std::string> segments;
  for (int32_t n = 0; n < 64; ++n) {
    const std::string path = dir + "/seg_" + std::to_string(n) + ".dat";
    if (::access(path.c_str(), F_OK) == 0) segments.push_back(path);
  }
  CHECK(!segments.empty());
  struct stat st;
  CHECK(::stat(segments[0].c_str(), &st) == 0 && (st.st_mode & 0777) == 0600);
  CHECK(::stat(dir.c_str(), &st) == 0 && (st.st_mode & 0777) == 0700);
  std::string refused;
  {
    tfpsx::HashTable other(Opts(16));
    tfpsx::TieredTable second(&other, {dir, 1200 * 1000});
    try {
      second.Open();
    } catch (const std::runtime_error& e) {
      refused = e.what();
    }
  }
  CHECK(refused.find("in use") != std::string::npos &&
        refused.find("pid " + std::to_string(::getpid())) != std::string::npos &&
        refused.find(dir) != std::string::npos);
  for (const std::string& path : segments) CHECK(::access(path.c_str(), F_OK) == 0);
  CHECK(SameRows(first->ExportSince(INT64_MIN), before));  // every row still read back from disk
  first.reset();  // the owner is gone: the folder is free
  tfpsx::HashTable third_hot(Opts(16));
  tfpsx::TieredTable third(&third_hot, {dir, 1200 * 1000});
  third.Open();
  CHECK(third.Size() == 0);
}

// The key index rebuilt from segments that cannot be read (cut short behind the
// table's back): the rebuild's error goes to its caller, and every later lookup
// throws, naming the lost index, rather than taking a disk row's key for a new one.
void TestLostIndex() {
  tfpsx::HashTable hot(Opts(16));
  const std::string dir = TempDir("l/part_0");
  tfpsx::TieredTable t(&hot, {dir, 1200 * 1000});
  t.Open();
  std::vector<float> out(500 * 16);
  int64_t next = 0;
  auto insert = [&]() {  // 500 new keys: nothing to bring back, so no FaultIn
    std::vector<int64_t> keys(500);
    for (auto& k : keys) k = next++;
    hot.FindOrInsert(keys.data(), 500, 1, out.data());
    t.Settle();
  };
  while (t.Stats().disk_rows < 5000) insert();
  CHECK(t.Stats().index_rebuilds == 0);
  for (int32_t n = 0; n < 64; ++n) {  // every segment file so far, cut to its header
    const std::string path = dir + "/seg_" + std::to_string(n) + ".dat";
    if (::access(path.c_str(), F_OK) == 0) CHECK(::truncate(path.c_str(), 64) == 0);
  }
  std::string first;
  for (int i = 0; i < 200 && first.empty(); ++i) {
    try {
      insert();
    } catch (const std::runtime_error& e) {
      first = e.what();
    }
  }
  CHECK(first.find("cannot read the segment") != std::string::npos);
  std::string then;
  try {  // a read of keys, some of them on disk
    std::vector<int64_t> keys(1000);
    for (int64_t i = 0; i < 1000; ++i) keys[i] = i;
    std::vector<float> rows(1000 * 16);
    std::unique_ptr<bool[]> found(new bool[1000]());
    t.FindOnDisk(keys.data(), 1000, 16, rows.data(), found.get());
  } catch (const std::runtime_error& e) {
    then = e.what();
  }
  CHECK(then.find("lost its index") != std::string::npos &&
        then.find("restore a checkpoint") != std::string::npos);
  // A restore (an import that clears the table) starts a new index: rows spill to disk
  // and come back again.
  CHECK(t.Import(nullptr, 0, nullptr, nullptr, 0, nullptr, nullptr, true).empty());
  CHECK(t.Size() == 0);
  next = 0;
  while (t.Stats().disk_rows < 2000) insert();
  int64_t back = 0;  // a key on disk: not in RAM
  for (bool in_ram = true; in_ram; ++back) hot.Present(&back, 1, &in_ram);
  --back;
  const int64_t faulted = t.Stats().rows_faulted;
  t.FaultIn(&back, 1);
  bool now = false;
  hot.Present(&back, 1, &now);
  CHECK(now && t.Stats().rows_faulted == faulted + 1);
}

}  // namespace

int main() {
  TestBatchReader();
  TestBatchReaderAfterAnError();
  TestKeyIndex();
  TestTrainsAsInRam();
  TestPrefetch();
  TestCheckpointsAndEviction();
  TestPagedExport();
  TestErrors();
  TestOneOwner();
  TestLostIndex();
  return tfpsx_test::Finish("tiered_table_test");
}
