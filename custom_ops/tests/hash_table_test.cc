// Native unit tests of the TF-free table core: g++ -O2 -pthread, no TensorFlow.
// Built and run by `make native-test` (and so by `make test`).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/optimizer_registry.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx_test::failures;

tfpsx::TableOptions Opts(int64_t dim, int slots = 0) {
  tfpsx::TableOptions o;
  o.dim = dim;
  o.num_slots = slots;
  o.slot_init.assign(slots, 0.f);
  o.init = tfpsx::InitKind::kNormal;
  o.init_b = 0.1f;
  o.seed = 42;
  return o;
}

void TestRandomOpsAgainstReference() {
  tfpsx::HashTable t(Opts(3));
  std::map<int64_t, std::vector<float>> ref;
  std::mt19937_64 rng(7);
  for (int it = 0; it < 200000; ++it) {
    const int64_t key = static_cast<int64_t>(rng() % 5000) - 2500;  // negatives too
    const int op = rng() % 3;
    if (op == 0) {
      std::vector<float> v = {float(it), float(-it), 0.5f};
      t.Insert(&key, 1, v.data(), it);
      ref[key] = v;
    } else if (op == 1) {
      CHECK(t.Remove(&key, 1) == static_cast<int64_t>(ref.erase(key)));
    } else {
      float out[3];
      bool found;
      t.Find(&key, 1, out, &found);
      auto r = ref.find(key);
      CHECK(found == (r != ref.end()));
      if (found) CHECK(out[0] == r->second[0] && out[1] == r->second[1]);
    }
  }
  CHECK(t.Size() == static_cast<int64_t>(ref.size()));
  auto e = t.Export();
  CHECK(e.keys.size() == ref.size());
  size_t i = 0;
  for (auto& kv : ref) {  // sorted like the export
    CHECK(e.keys[i] == kv.first && e.values[i * 3 + 1] == kv.second[1]);
    ++i;
  }
}

void TestDeterministicInitializer() {
  tfpsx::HashTable a(Opts(5)), b(Opts(5));
  float ra[5], rb[5];
  a.InitialRow(123456789, ra);
  b.InitialRow(123456789, rb);
  for (int j = 0; j < 5; ++j) CHECK(ra[j] == rb[j]);
  int64_t keys[2] = {1, 2};
  float out[10];
  a.FindOrInsert(keys, 2, 0, out);
  CHECK(out[0] != out[5]);  // different keys, different rows
  // Statistics of the normal initializer over many keys: mean ~0, stddev ~0.1.
  double sum = 0, sq = 0;
  const int n = 20000;
  for (int k = 0; k < n; ++k) {
    a.InitialRow(k, ra);
    for (int j = 0; j < 5; ++j) sum += ra[j], sq += ra[j] * ra[j];
  }
  const double mean = sum / (5 * n), sd = std::sqrt(sq / (5 * n) - mean * mean);
  CHECK(std::fabs(mean) < 0.005 && std::fabs(sd - 0.1) < 0.005);
}

void TestAdmissionAndEviction() {
  auto o = Opts(2);
  o.min_frequency = 3;
  tfpsx::HashTable t(o);
  int64_t key = 9;
  float out[2], init[2];
  t.InitialRow(key, init);
  for (int i = 0; i < 2; ++i) {
    t.FindOrInsert(&key, 1, i, out);
    CHECK(t.Size() == 0 && out[0] == init[0]);
  }
  CHECK(t.pending_admission() == 1);
  t.FindOrInsert(&key, 1, 5, out);
  CHECK(t.Size() == 1 && t.admitted() == 1 && t.pending_admission() == 0);
  // A gradient for a key not yet admitted creates nothing.
  int64_t fresh = 10;
  float g[2] = {1, 1};
  const float lr = 0.1f;
  tfpsx::FindOptimizer("sgd")->apply(t, &fresh, 1, g, &lr, 6);
  CHECK(t.Size() == 1);

  tfpsx::HashTable u(Opts(2));
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < 100; ++k) keys.push_back(k);
  std::vector<float> vals(200, 1.f);
  u.Insert(keys.data(), 50, vals.data(), 1);        // keys 0..49 at step 1
  u.Insert(keys.data() + 50, 50, vals.data(), 10);  // keys 50..99 at step 10
  CHECK(u.EvictOlderThan(5) == 50 && u.Size() == 50 && u.evicted() == 50);
  for (int rep = 0; rep < 3; ++rep) u.FindOrInsert(keys.data() + 90, 10, 11, vals.data());
  CHECK(u.EvictToTopN(10) == 40 && u.Size() == 10 && u.evicted() == 90);
  bool found[10];
  float out10[20];
  u.Find(keys.data() + 90, 10, out10, found);
  for (bool f : found) CHECK(f);
}

void TestOptimizers() {
  int64_t key = 1;
  float g[1] = {0.5f};
  {
    tfpsx::HashTable t(Opts(1));
    float w0;
    t.InitialRow(key, &w0);
    const float lr = 0.1f;
    tfpsx::FindOptimizer("sgd")->apply(t, &key, 1, g, &lr, 1);
    float w;
    t.Find(&key, 1, &w, nullptr);
    CHECK(std::fabs(w - (w0 - 0.05f)) < 1e-7);
  }
  {
    auto o = Opts(1, 1);
    o.slot_init = {0.1f};
    tfpsx::HashTable t(o);
    float w0;
    t.InitialRow(key, &w0);
    const float hparams[] = {0.1f, 0.f};  // lr, epsilon
    tfpsx::FindOptimizer("adagrad")->apply(t, &key, 1, g, hparams, 1);
    float w;
    t.Find(&key, 1, &w, nullptr);
    CHECK(std::fabs(w - (w0 - 0.1f * 0.5f / std::sqrt(0.1f + 0.25f))) < 1e-6);
    auto e = t.Export();
    CHECK(std::fabs(e.slots[0] - 0.35f) < 1e-6);
  }
}

void TestConcurrentUpdates() {
  tfpsx::HashTable t(Opts(4));
  const int threads = 4, per = 20000;
  std::vector<std::thread> pool;
  for (int th = 0; th < threads; ++th) {
    pool.emplace_back([&, th] {
      std::vector<float> out(4), one(4, 1.f);
      for (int i = 0; i < per; ++i) {
        const int64_t key = i % 1000;  // all threads hit the same keys
        t.Accumulate(&key, 1, one.data(), i);
        t.Find(&key, 1, out.data(), nullptr);
        const int64_t own = 1000000 + th * per + i;  // and each inserts its own
        t.FindOrInsert(&own, 1, i, out.data());
        if (i % 3 == 0) t.Remove(&own, 1);
      }
    });
  }
  for (auto& th : pool) th.join();
  int64_t removed_per_thread = (per + 2) / 3;
  CHECK(t.Size() == 1000 + threads * (per - removed_per_thread));
  // Each shared key received threads * per / 1000 accumulations of 1 on top of its init.
  for (int64_t key = 0; key < 1000; key += 97) {
    float row[4], init[4];
    t.Find(&key, 1, row, nullptr);
    t.InitialRow(key, init);
    CHECK(std::fabs(row[2] - init[2] - threads * per / 1000) < 1e-3);
  }
}

void TestImportAndChanged() {
  tfpsx::HashTable a(Opts(2, 1));
  std::vector<int64_t> keys = {5, 3, 8};
  std::vector<float> vals = {1, 2, 3, 4, 5, 6};
  a.Insert(keys.data(), 3, vals.data(), 7);
  auto e = a.Export();
  tfpsx::HashTable b(Opts(2, 1));
  CHECK(b.Import(e.keys.data(), 3, e.values.data(), e.slots.data(), e.slots.size(),
                 e.freq.data(), e.step.data(), true) == "");
  auto f = b.Export();
  CHECK(f.keys == e.keys && f.values == e.values && f.step == e.step && f.freq == e.freq);
  CHECK(b.Import(e.keys.data(), 3, e.values.data(), e.slots.data(), 5, nullptr, nullptr,
                 false) != "");
  CHECK(a.TakeChanged(1).empty());  // registers reader 1
  int64_t k = 3;
  float d[2] = {1, 1};
  a.Accumulate(&k, 1, d, 9);
  std::vector<int64_t> changed = a.TakeChanged(1);
  CHECK(changed.size() == 1 && changed[0] == 3);
  CHECK(a.TakeChanged(1).empty());
  CHECK(a.ExportSince(9).keys.size() == 1);
  // A push that skips its own reader: marked for every other reader only.
  CHECK(a.TakeChanged(2).empty());  // registers reader 2
  a.Accumulate(&k, 1, d, 10, /*skip_reader=*/1);
  CHECK(a.TakeChanged(1).empty());
  changed = a.TakeChanged(2);
  CHECK(changed.size() == 1 && changed[0] == 3);
}

// GEO's parallel pushes of one row (the others: the pushes since the pusher's last take):
// 'mean' keeps the row at the mean of the pushes, 'scaled' adds delta / (1 + others).
void TestCombinedPushes() {
  auto zeros = Opts(2);
  zeros.init = tfpsx::InitKind::kZeros;
  using C = tfpsx::HashTable::Combine;
  int64_t k = 7;
  float a[2] = {4, 8};
  float b[2] = {2, 2};
  float row[2];
  tfpsx::HashTable t(zeros);
  for (int64_t reader : {1, 2, 3}) CHECK(t.TakeChanged(reader).empty());  // registers
  t.FindOrInsert(&k, 1, 1, row);  // a lookup creating the row marks it, not as a push
  t.Accumulate(&k, 1, a, 1, /*skip_reader=*/1, C::kMean);  // nobody else pushed: whole
  t.Find(&k, 1, row, nullptr);
  CHECK(row[0] == 4 && row[1] == 8);
  t.Accumulate(&k, 1, b, 1, /*skip_reader=*/2, C::kMean);  // one other since: the mean
  t.Find(&k, 1, row, nullptr);
  CHECK(row[0] == 3 && row[1] == 5);
  t.Accumulate(&k, 1, b, 1, /*skip_reader=*/3, C::kMean);  // two others: of three
  t.Find(&k, 1, row, nullptr);
  CHECK(std::abs(row[0] - 8.f / 3) < 1e-6f && std::abs(row[1] - 4) < 1e-6f);
  CHECK(t.TakeChanged(1).size() == 1);  // taking resets the reader's pushes
  t.Accumulate(&k, 1, b, 1, /*skip_reader=*/1, C::kMean);  // none since: whole
  t.Find(&k, 1, row, nullptr);
  CHECK(std::abs(row[0] - 14.f / 3) < 1e-6f && std::abs(row[1] - 6) < 1e-6f);

  tfpsx::HashTable s(zeros);
  for (int64_t reader : {1, 2, 3}) CHECK(s.TakeChanged(reader).empty());
  s.Accumulate(&k, 1, a, 1, /*skip_reader=*/1, C::kScaled);  // whole
  s.Accumulate(&k, 1, a, 1, /*skip_reader=*/2, C::kScaled);  // half
  s.Accumulate(&k, 1, b, 1, /*skip_reader=*/3, C::kScaled);  // a third
  s.Find(&k, 1, row, nullptr);
  CHECK(std::abs(row[0] - (6 + 2.f / 3)) < 1e-6f && std::abs(row[1] - (12 + 2.f / 3)) < 1e-6f);
  CHECK(s.TakeChanged(2).size() == 1);
  s.Accumulate(&k, 1, b, 1, /*skip_reader=*/2, C::kScaled);  // none since its take: whole
  s.Find(&k, 1, row, nullptr);
  CHECK(std::abs(row[0] - (8 + 2.f / 3)) < 1e-6f);
  std::vector<int64_t> changed = s.TakeChanged(1);  // marked for the pusher's readers only
  CHECK(changed.size() == 1 && changed[0] == 7);

  tfpsx::HashTable u(zeros);
  for (int64_t reader : {1, 2}) CHECK(u.TakeChanged(reader).empty());
  u.Accumulate(&k, 1, a, 1, /*skip_reader=*/1, C::kSum);  // summed: marked, not counted
  u.Accumulate(&k, 1, b, 1, /*skip_reader=*/2, C::kMean);  // so this one stays whole
  u.Find(&k, 1, row, nullptr);
  CHECK(row[0] == 6 && row[1] == 10);
  CHECK(u.TakeChanged(2).size() == 1);
}

void TestValidate() {
  auto o = Opts(0);
  CHECK(tfpsx::ValidateOptions(o).find("dim must be > 0") != std::string::npos);
  o = Opts(4);
  o.num_stripes = 3;
  CHECK(!tfpsx::ValidateOptions(o).empty());
  CHECK(tfpsx::ValidateOptions(Opts(4)).empty());
}

void TestTableFull() {
  auto o = Opts(2);
  o.num_stripes = 1;
  o.max_stripe_rows = 10;
  tfpsx::HashTable t(o);
  std::vector<int64_t> keys(10);
  for (int i = 0; i < 10; ++i) keys[i] = i * 7;
  std::vector<float> values(20, 1.f);
  t.Insert(keys.data(), 10, values.data(), 1);
  const int64_t extra = 1000;
  bool threw = false;
  try {
    t.Insert(&extra, 1, values.data(), 2);
  } catch (const std::length_error& e) {
    threw = std::string(e.what()).find("at most 10 keys") != std::string::npos;
  }
  CHECK(threw);
  CHECK(t.Size() == 10);
  std::vector<float> out(20);
  std::vector<char> found(10);
  t.Find(keys.data(), 10, out.data(), reinterpret_cast<bool*>(found.data()));
  CHECK(out[19] == 1.f && found[9]);
  o.max_stripe_rows = 0;
  CHECK(tfpsx::ValidateOptions(o).find("max_stripe_rows") != std::string::npos);
}

void TestReservedCapacity() {
  auto o = Opts(4);
  o.capacity = 20000;
  tfpsx::HashTable t(o);
  const int64_t reserved = t.ReservedBytes();
  CHECK(reserved >= 20000 * (20 + 4 * 4));  // index plus the rows' memory, mapped up front
  std::vector<int64_t> keys(20000);
  for (int64_t i = 0; i < 20000; ++i) keys[i] = i * 1000003 + 7;
  std::vector<float> values(keys.size() * 4);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  t.Insert(keys.data(), 20000, values.data(), 1);
  CHECK(t.Size() == 20000);
  CHECK(t.ReservedBytes() == reserved);  // neither an index nor a row block grew
  std::vector<float> out(values.size());
  t.Find(keys.data(), 20000, out.data(), nullptr);
  CHECK(out == values);
  // A restore (import replacing every row) keeps the reservation.
  const tfpsx::ExportedRows e = t.Export();
  CHECK(t.Import(e.keys.data(), 20000, e.values.data(), nullptr, 0, e.freq.data(),
                 e.step.data(), /*clear_first=*/true)
            .empty());
  CHECK(t.Size() == 20000 && t.ReservedBytes() == reserved);
  t.Find(keys.data(), 20000, out.data(), nullptr);
  CHECK(out == values);
  // Past the reservation the table grows as any other.
  std::vector<int64_t> more(40000);
  for (int64_t i = 0; i < 40000; ++i) more[i] = -(i + 1);
  std::vector<float> zeros(more.size() * 4, 0.f);
  t.Insert(more.data(), 40000, zeros.data(), 2);
  CHECK(t.Size() == 60000 && t.ReservedBytes() > reserved);
  t.Find(keys.data(), 20000, out.data(), nullptr);
  CHECK(out == values);
  o.capacity = -1;
  CHECK(tfpsx::ValidateOptions(o).find("capacity must be in 0..") != std::string::npos);
}

// The memory a table maps grows with the rows it holds, whatever their width: a few
// rows of dim 100,000 with Adam's two slots (1.2 MB each) used to map 614 MB per row (a
// 512-row chunk each), a table of narrow rows maps little more than it holds.
void TestMemoryFollowsRows() {
  const int64_t wide_record = 20 + 3 * 100000 * 4;
  tfpsx::HashTable wide(Opts(100000, 2));
  CHECK(wide.UsedBytes() == 0 && wide.ReservedBytes() == 0);
  std::vector<int64_t> keys = {1, 2, 3};
  std::vector<float> rows(3 * 100000);
  wide.FindOrInsert(keys.data(), 3, 1, rows.data());
  CHECK(wide.UsedBytes() >= 3 * wide_record && wide.UsedBytes() < 3 * wide_record + 4096);
  CHECK(wide.ReservedBytes() >= wide.UsedBytes());
  CHECK(wide.ReservedBytes() < 3 * (wide_record + 4096) + 4096);
  std::vector<int64_t> more(47);
  for (int64_t i = 0; i < 47; ++i) more[i] = 100 + i;
  std::vector<float> more_rows(47 * 100000);
  wide.FindOrInsert(more.data(), 47, 1, more_rows.data());
  CHECK(wide.Size() == 50);
  // Blocks grow by ~1/16 of what is mapped: at most that much and one chunk not used yet.
  CHECK(wide.ReservedBytes() < (wide.UsedBytes() + wide_record) * 16 / 15 + 50 * 4096);

  // Narrow rows (dim 16, no slots: 84-byte records): at 100,000 rows the table holds
  // what its rows take plus ~1/16 (the newest block's rest) and a chunk per stripe.
  tfpsx::HashTable narrow(Opts(16));
  std::vector<int64_t> many(100000);
  for (int64_t i = 0; i < 100000; ++i) many[i] = i * 7919;
  std::vector<float> out(many.size() * 16);
  narrow.FindOrInsert(many.data(), 100000, 1, out.data());
  const int64_t records = 100000 * 84;
  CHECK(narrow.UsedBytes() > records && narrow.UsedBytes() < records + 100000 * 12);
  CHECK(narrow.ReservedBytes() >= narrow.UsedBytes());
  CHECK(narrow.ReservedBytes() < (narrow.UsedBytes() + 64 * 512 * 84 + (64 << 10)) * 16 / 15);
  // A small table maps little: one 64 KiB block for a first row.
  tfpsx::HashTable small(Opts(16));
  small.FindOrInsert(many.data(), 1, 1, out.data());
  CHECK(small.ReservedBytes() - small.UsedBytes() < (64 << 10) + 64 * 16 * 4);
}

bool SameRows(const tfpsx::ExportedRows& a, const tfpsx::ExportedRows& b) {
  return a.keys == b.keys && a.values == b.values && a.slots == b.slots && a.freq == b.freq &&
         a.step == b.step;
}

// Applies one checkpoint export to `replica` the way a restore does: removed keys out,
// rows in (a full one replaces everything).
void ApplyCheckpoint(tfpsx::HashTable& replica, const tfpsx::CheckpointRows& c, bool full) {
  if (!c.removed.empty())
    replica.Remove(c.removed.data(), static_cast<int64_t>(c.removed.size()));
  const auto& r = c.rows;
  CHECK(replica.Import(r.keys.data(), static_cast<int64_t>(r.keys.size()), r.values.data(),
                       r.slots.data(), static_cast<int64_t>(r.slots.size()), r.freq.data(),
                       r.step.data(), full) == "");
}

// Random lookups, inserts, optimizer updates, removals and both evictions between
// checkpoint exports: a full export plus every delta since, replayed into a new table,
// equals a full export of the same moment, bit for bit; and a delta holds only what
// changed.
void TestCheckpointDeltas() {
  tfpsx::TableOptions o = Opts(4, 1);
  o.num_stripes = 8;
  tfpsx::HashTable t(o), replica(o);
  std::mt19937_64 rng(11);
  std::vector<float> out(4 * 64), grads(4 * 64, 0.5f);
  {
    const auto unarmed = t.CheckpointExport(/*full=*/false);
    CHECK(!unarmed.complete && unarmed.rows.keys.empty());
  }
  int64_t step = 0;
  for (int round = 0; round < 12; ++round) {
    const bool full = round % 4 == 0;
    for (int op = 0; op < 40; ++op, ++step) {
      std::vector<int64_t> keys;
      const int64_t span = round < 6 ? 500 : 2000;  // later rounds grow the table
      for (int i = 0; i < 16; ++i) keys.push_back(static_cast<int64_t>(rng() % span));
      std::sort(keys.begin(), keys.end());
      keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
      const int64_t n = static_cast<int64_t>(keys.size());
      switch (rng() % 5) {
        case 0: t.FindOrInsert(keys.data(), n, step, out.data()); break;  // freq counts
        case 1: t.Insert(keys.data(), n, grads.data(), step); break;
        case 2:
          t.ApplyGradients(keys.data(), n, grads.data(), step, [](float* row, const float* g) {
            for (int j = 0; j < 4; ++j) { row[4 + j] += g[j] * g[j]; row[j] -= 0.1f * g[j]; }
          });
          break;
        case 3: t.Remove(keys.data(), n / 2); break;
        default: t.Find(keys.data(), n, out.data(), nullptr); break;  // no write
      }
    }
    if (round == 5) t.EvictOlderThan(step - 60);
    if (round == 9) t.EvictToTopN(300);
    const tfpsx::ExportedRows truth = t.Export();
    const tfpsx::CheckpointRows c = t.CheckpointExport(full);
    CHECK(c.complete);
    if (full) CHECK(SameRows(c.rows, truth));
    if (!full) CHECK(c.rows.keys.size() < truth.keys.size());
    ApplyCheckpoint(replica, c, full);
    CHECK(SameRows(replica.Export(), truth));
  }
  // Nothing written since: an empty delta; a clear disarms tracking.
  const auto idle = t.CheckpointExport(false);
  CHECK(idle.complete && idle.rows.keys.empty() && idle.removed.empty());
  const tfpsx::ExportedRows all = t.Export();
  CHECK(t.Import(all.keys.data(), static_cast<int64_t>(all.keys.size()), all.values.data(),
                 all.slots.data(), static_cast<int64_t>(all.slots.size()), all.freq.data(),
                 all.step.data(), /*clear_first=*/true) == "");
  CHECK(!t.CheckpointExport(false).complete);
  CHECK(!t.CheckpointExport(false).complete);  // still no base: only a full one arms it
  CHECK(t.CheckpointExport(true).complete);
  CHECK(t.CheckpointExport(false).complete);
}

}  // namespace

// A worker cache's bookkeeping: CacheFind touches only present keys (frequency, step),
// inserts nothing and marks nothing changed; CacheVictims picks the lowest frequency,
// then the oldest step (LFU), or the oldest step, then the lowest frequency (LRU), the
// larger key first on ties, and removes nothing.
void TestCacheFindAndVictims() {
  tfpsx::HashTable t(Opts(2));
  std::vector<int64_t> keys = {10, 20, 30, 40};
  std::vector<float> vals = {1, 1, 2, 2, 3, 3, 4, 4};
  t.Insert(keys.data(), 4, vals.data(), /*step=*/1);
  t.TakeChanged(0);  // register a reader
  float out[6];
  bool found[3];
  const int64_t probe[3] = {20, 99, 40};
  t.CacheFind(probe, 3, /*step=*/7, out, found);
  CHECK(found[0] && !found[1] && found[2]);
  CHECK(out[0] == 2 && out[4] == 4);
  float init[2];
  t.InitialRow(99, init);
  CHECK(out[2] == init[0] && out[3] == init[1]);
  CHECK(t.Size() == 4);                 // a miss is not inserted
  CHECK(t.TakeChanged(0).empty());      // touching is not a change
  t.CacheFind(probe, 1, /*step=*/8, out, found);  // 20 again
  // freq: 10 -> 1, 20 -> 3, 30 -> 1, 40 -> 2 ; step: 10 -> 1, 20 -> 8, 30 -> 1, 40 -> 7
  auto lfu = t.CacheVictims(3, /*by_step=*/false);
  CHECK((lfu == std::vector<int64_t>{30, 10, 40}));
  auto lru = t.CacheVictims(2, /*by_step=*/true);
  CHECK((lru == std::vector<int64_t>{30, 10}));
  const int64_t late = 10;
  t.Insert(&late, 1, vals.data(), /*step=*/9);  // 10: freq 1, but the newest: 30 goes first
  CHECK((t.CacheVictims(1, false) == std::vector<int64_t>{30}));
  CHECK((t.CacheVictims(2, true) == std::vector<int64_t>{30, 40}));
  CHECK(t.CacheVictims(0, false).empty());
  CHECK(t.CacheVictims(99, true).size() == 4);
  CHECK(t.Size() == 4);                 // choosing removes nothing
}

// GEO's shared optimizer state: rows read and pushed with their slots.
void TestRowsWithSlots() {
  auto o = Opts(2, 1);
  o.slot_init = {0.1f};
  tfpsx::HashTable t(o);
  CHECK(t.row_width() == 4);
  const int64_t keys[2] = {7, 8};
  float init7[2], init8[2];
  t.InitialRow(7, init7);
  t.InitialRow(8, init8);
  // Missing: the initial value and slot_init; nothing inserted.
  float rows[8];
  bool found[2];
  t.FindWithSlots(keys, 2, rows, found);
  CHECK(!found[0] && !found[1] && t.Size() == 0);
  CHECK(rows[0] == init7[0] && rows[1] == init7[1] && rows[2] == 0.1f && rows[3] == 0.1f);
  CHECK(rows[4] == init8[0] && rows[7] == 0.1f);
  // Adagrad on key 7, then a push of [value | accumulator] deltas to both keys.
  const float g[2] = {0.5f, -1.f};
  const float hparams[] = {0.1f, 0.f};
  tfpsx::FindOptimizer("adagrad")->apply(t, keys, 1, g, hparams, 1);
  t.FindWithSlots(keys, 1, rows, found);
  CHECK(found[0] && std::fabs(rows[2] - 0.35f) < 1e-6 && std::fabs(rows[3] - 1.1f) < 1e-6);
  t.TakeChanged(3);  // a reader that watches the pushes
  const float d[8] = {1.f, 2.f, 0.25f, 0.5f, -1.f, 0.f, 0.5f, 0.f};
  float before[4];
  std::copy(rows, rows + 4, before);
  t.AccumulateWithSlots(keys, 2, d, 5, /*skip_reader=*/-1);
  t.FindWithSlots(keys, 2, rows, found);
  for (int j = 0; j < 4; ++j) CHECK(std::fabs(rows[j] - (before[j] + d[j])) < 1e-6);
  CHECK(found[1] && std::fabs(rows[4] - (init8[0] - 1.f)) < 1e-6 && rows[5] == init8[1]);
  CHECK(std::fabs(rows[6] - 0.6f) < 1e-6 && rows[7] == 0.1f);
  auto changed = t.TakeChanged(3);
  std::sort(changed.begin(), changed.end());
  CHECK(changed == std::vector<int64_t>({7, 8}));
  // The value part alone, as Find reads it.
  float values[4];
  t.Find(keys, 2, values, nullptr);
  CHECK(values[0] == rows[0] && values[1] == rows[1] && values[2] == rows[4]);
  // Rows written whole with their slots: a present key and a new one, exactly.
  const int64_t put[2] = {8, 9};
  const float whole[8] = {3.f, -3.f, 0.75f, 2.5f, 1e-7f, 7.f, 0.f, 9.f};
  t.InsertWithSlots(put, 2, whole, 6);
  t.FindWithSlots(put, 2, rows, found);
  CHECK(found[0] && found[1]);
  for (int j = 0; j < 8; ++j) CHECK(rows[j] == whole[j]);
  changed = t.TakeChanged(3);
  std::sort(changed.begin(), changed.end());
  CHECK(changed == std::vector<int64_t>({8, 9}));
}

int main() {
  TestRandomOpsAgainstReference();
  TestDeterministicInitializer();
  TestAdmissionAndEviction();
  TestOptimizers();
  TestConcurrentUpdates();
  TestImportAndChanged();
  TestCombinedPushes();
  TestValidate();
  TestTableFull();
  TestReservedCapacity();
  TestMemoryFollowsRows();
  TestCheckpointDeltas();
  TestCacheFindAndVictims();
  TestRowsWithSlots();
  return tfpsx_test::Finish("hash_table_test");
}
