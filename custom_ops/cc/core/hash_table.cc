#include "custom_ops/cc/core/hash_table.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <type_traits>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace tfpsx {
namespace {

inline uint64_t Mix(uint64_t x) {  // splitmix64's finalizer: a fast, well-spread hash
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t HashKey(int64_t key) { return Mix(static_cast<uint64_t>(key)); }

inline float Uniform01(uint64_t bits) {  // (0, 1]: safe for log()
  return (static_cast<float>(bits >> 40) + 1.0f) * (1.0f / 16777216.0f);
}

constexpr float kMaxLoad = 0.7f;
// Row ids take 24 bits of an index slot (the other 8 are a hash tag).
constexpr int64_t kMaxRowsPerStripe = (int64_t{1} << 24) - 2;

}  // namespace

std::string ValidateOptions(const TableOptions& o) {
  if (o.dim <= 0) return "dim must be > 0, got " + std::to_string(o.dim);
  if (o.num_slots < 0 || o.num_slots > 4)
    return "num_slots must be in 0..4, got " + std::to_string(o.num_slots);
  if (static_cast<int>(o.slot_init.size()) != o.num_slots)
    return "slot_init must have num_slots=" + std::to_string(o.num_slots) + " values, got " +
           std::to_string(o.slot_init.size());
  if (o.min_frequency < 1)
    return "min_frequency must be >= 1, got " + std::to_string(o.min_frequency);
  if (o.max_stripe_rows < 1 || o.max_stripe_rows > kMaxRowsPerStripe)
    return "max_stripe_rows must be in 1.." + std::to_string(kMaxRowsPerStripe) + ", got " +
           std::to_string(o.max_stripe_rows);
  if (o.num_stripes < 1 || (o.num_stripes & (o.num_stripes - 1)) != 0)
    return "num_stripes must be a power of two, got " + std::to_string(o.num_stripes);
  if (o.capacity < 0 || o.capacity / o.num_stripes > o.max_stripe_rows)
    return "capacity must be in 0.." + std::to_string(o.num_stripes * o.max_stripe_rows) +
           " (num_stripes * max_stripe_rows), got " + std::to_string(o.capacity);
  if (o.init == InitKind::kUniform && !(o.init_a < o.init_b))
    return "uniform initializer needs low < high";
  if (o.init == InitKind::kNormal && !(o.init_b >= 0))
    return "normal initializer needs stddev >= 0";
  return "";
}

// Chunks of one table come out of 2 MiB blocks mapped for the table: a chunk a stripe
// gives back is kept for the table's next chunk, and the blocks go back to the system
// with the table (not left in malloc's heap). With TFPSX_TABLE_HUGE_PAGES=1 the blocks
// are madvise'd for transparent huge pages: one page fault per 2 MiB instead of 512.
// Off by default: on this project's VMs it made inserting new keys ~35% faster in the
// native benchmark but 2-3x slower inside a TF process (huge-page faults there were slow
// and erratic), see README.
class ChunkPool {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;

  explicit ChunkPool(size_t chunk_bytes)
      : chunk_bytes_(chunk_bytes),
        block_bytes_((std::max(chunk_bytes, kHugePage) + kHugePage - 1) / kHugePage *
                     kHugePage),
        huge_pages_(HugePagesWanted()) {}
  ~ChunkPool() {
    for (char* b : blocks_) FreeBlock(b);
  }
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

  char* Get() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      char* p = free_.back();
      free_.pop_back();
      return p;
    }
    if (left_ < chunk_bytes_) {
      cur_ = AllocBlock();
      blocks_.push_back(cur_);
      left_ = block_bytes_;
    }
    char* p = cur_;
    cur_ += chunk_bytes_;
    left_ -= chunk_bytes_;
    return p;
  }
  void Put(char* chunk) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(chunk);
  }
  // Maps blocks for at least `chunks` more chunks (whole blocks) and faults their pages
  // in now, so that the chunks Get hands out later cost no page faults.
  void Reserve(int64_t chunks) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t per_block = static_cast<int64_t>(block_bytes_ / chunk_bytes_);
    std::vector<char*> reserved;
    for (int64_t left = chunks; left > 0; left -= per_block) {
      char* block = AllocBlock();
      blocks_.push_back(block);
      Populate(block, block_bytes_);
      for (int64_t c = 0; c < per_block; ++c) reserved.push_back(block + c * chunk_bytes_);
    }
    // Get pops from the back: hand the chunks out in address order.
    free_.insert(free_.end(), reserved.rbegin(), reserved.rend());
  }
  int64_t MappedBytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(blocks_.size() * block_bytes_);
  }

 private:
  char* AllocBlock() {
#ifdef __linux__
    // Over-map by one huge page so the block can start on a huge-page boundary.
    const size_t span = block_bytes_ + kHugePage;
    void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      throw std::runtime_error("could not map " + std::to_string(span) +
                               " bytes for rows: " + std::strerror(errno));
    }
    const uintptr_t base = reinterpret_cast<uintptr_t>(m);
    const uintptr_t start = (base + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
    if (start > base) munmap(m, start - base);
    const uintptr_t end = start + block_bytes_;
    if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
    if (huge_pages_) madvise(reinterpret_cast<void*>(start), block_bytes_, MADV_HUGEPAGE);
    return reinterpret_cast<char*>(start);
#else
    char* p = static_cast<char*>(std::malloc(block_bytes_));
    if (p == nullptr) throw std::bad_alloc();
    return p;
#endif
  }
  static void Populate(char* p, size_t bytes) {
#ifdef __linux__
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux >= 5.14
#endif
    // One call faults the whole range in (cheaper than a trap per page); older kernels
    // say EINVAL, then the pages are touched one by one. Out of memory is an error here
    // rather than a kill later.
    if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
    if (errno != EINVAL) {
      throw std::runtime_error("could not fault in " + std::to_string(bytes) +
                               " bytes of reserved rows: " + std::strerror(errno));
    }
#endif
    for (size_t off = 0; off < bytes; off += 4096) p[off] = 0;
  }
  void FreeBlock(char* b) {
#ifdef __linux__
    munmap(b, block_bytes_);
#else
    std::free(b);
#endif
  }

  static bool HugePagesWanted() {
    const char* v = std::getenv("TFPSX_TABLE_HUGE_PAGES");
    return v != nullptr && std::string(v) == "1";
  }

  const size_t chunk_bytes_;
  const size_t block_bytes_;
  const bool huge_pages_;
  std::mutex mu_;
  std::vector<char*> blocks_;
  std::vector<char*> free_;
  char* cur_ = nullptr;
  size_t left_ = 0;
};

// Rows live in fixed-size chunks of records [key int64 | step int64 | freq uint32 | value
// and slot floats], so that (a) a lookup touches one index slot and one record, with the
// key beside the value, and (b) growth never copies rows nor leaves a doubled vector's
// spare half behind: the slack is at most one chunk per stripe.
class RowStore {
 public:
  static constexpr int64_t kChunkShift = 9;  // 512 records per chunk
  static constexpr int64_t kChunkRows = int64_t{1} << kChunkShift;
  static constexpr int64_t kHeaderBytes = 20;

  explicit RowStore(int64_t row_width)
      : stride_(kHeaderBytes + row_width * static_cast<int64_t>(sizeof(float))) {}
  ~RowStore() { Clear(); }
  RowStore(const RowStore&) = delete;
  RowStore& operator=(const RowStore&) = delete;

  int64_t chunk_bytes() const { return kChunkRows * stride_; }
  // Where chunks come from (set once, before the first Append).
  void set_pool(ChunkPool* pool) { pool_ = pool; }

  int64_t size() const { return size_; }
  char* record(int64_t r) const {
    return chunks_[r >> kChunkShift] + (r & (kChunkRows - 1)) * stride_;
  }
  int64_t key(int64_t r) const { return Load<int64_t>(record(r)); }
  int64_t step(int64_t r) const { return Load<int64_t>(record(r) + 8); }
  uint32_t freq(int64_t r) const { return Load<uint32_t>(record(r) + 16); }
  void set_key(int64_t r, int64_t v) { Store(record(r), v); }
  void set_step(int64_t r, int64_t v) { Store(record(r) + 8, v); }
  void set_freq(int64_t r, uint32_t v) { Store(record(r) + 16, v); }
  float* row(int64_t r) const { return reinterpret_cast<float*>(record(r) + kHeaderBytes); }

  // Appends a zeroed record; returns its id.
  int64_t Append(int64_t key) {
    if ((size_ >> kChunkShift) == static_cast<int64_t>(chunks_.size()))
      chunks_.push_back(pool_->Get());
    const int64_t r = size_++;
    std::memset(record(r), 0, stride_);
    set_key(r, key);
    return r;
  }
  // Copies record src over dst (whole record: key, metadata, row).
  void CopyRecord(int64_t dst, int64_t src) { std::memcpy(record(dst), record(src), stride_); }
  void PopBack() {
    --size_;
    if (static_cast<int64_t>(chunks_.size()) > (size_ >> kChunkShift) + 1) {
      pool_->Put(chunks_.back());
      chunks_.pop_back();
    }
  }
  void Clear() {
    for (char* c : chunks_) pool_->Put(c);
    chunks_.clear();
    size_ = 0;
  }

 private:
  template <typename T>
  static T Load(const char* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }
  template <typename T>
  static void Store(char* p, T v) {
    std::memcpy(p, &v, sizeof(T));
  }

  int64_t stride_;
  int64_t size_ = 0;
  ChunkPool* pool_ = nullptr;
  std::vector<char*> chunks_;
};

struct HashTable::Stripe {
  explicit Stripe(int64_t row_width) : rows(row_width) {}

  mutable std::shared_mutex mu;
  // Index slots: 0 is empty, else (row + 1) << 8 | an 8-bit tag from the key's hash, so
  // a probe passes over other keys' slots without touching their records (255 in 256
  // mismatches are rejected by the tag).
  std::vector<uint32_t> index;
  uint64_t mask = 0;
  RowStore rows;
  std::unordered_map<int64_t, uint32_t> pending;  // admission: sightings so far
  int64_t admitted = 0;
  int64_t evicted = 0;

  static uint32_t TagOf(uint64_t h) { return static_cast<uint32_t>(h >> 32) & 0xff; }
  static uint32_t MakeSlot(int64_t r, uint64_t h) {
    return static_cast<uint32_t>(r + 1) << 8 | TagOf(h);
  }
  static int64_t RowOf(uint32_t slot) { return static_cast<int64_t>(slot >> 8) - 1; }

  int64_t size() const { return rows.size(); }

  static constexpr uint64_t kNoSlot = ~uint64_t{0};

  // The key's row, or -1; on a miss *empty (if given) is the free slot where the probe
  // ended, where AddRow puts the key unless the index grows first.
  int64_t FindRow(int64_t key, uint64_t h, uint64_t* empty = nullptr) const {
    if (index.empty()) {
      if (empty != nullptr) *empty = kNoSlot;
      return -1;
    }
    const uint32_t tag = TagOf(h);
    for (uint64_t pos = h & mask;; pos = (pos + 1) & mask) {
      const uint32_t slot = index[pos];
      if (slot == 0) {
        if (empty != nullptr) *empty = pos;
        return -1;
      }
      if ((slot & 0xff) == tag && rows.key(RowOf(slot)) == key) return RowOf(slot);
    }
  }

  // Second prefetch stage: the index slot was fetched earlier, now fetch the record.
  void PrefetchRecord(uint64_t h) const {
    if (index.empty()) return;
    const uint32_t slot = index[h & mask];
    if (slot != 0 && (slot & 0xff) == TagOf(h)) __builtin_prefetch(rows.record(RowOf(slot)));
  }

  // An empty index of `slots` slots (a power of two, or 0: none yet).
  void ResetIndex(uint64_t slots) {
    index.assign(slots, 0);
    mask = slots == 0 ? 0 : slots - 1;
  }

  void Rehash(uint64_t capacity) {
    ResetIndex(capacity);
    for (int64_t r = 0; r < rows.size(); ++r) {
      const uint64_t h = HashKey(rows.key(r));
      uint64_t pos = h & mask;
      while (index[pos] != 0) pos = (pos + 1) & mask;
      index[pos] = MakeSlot(r, h);
    }
  }

  // Appends a zeroed row for a key known to be absent; returns its row id.
  int64_t AddRow(int64_t key, uint64_t h, int64_t max_rows, uint64_t empty = kNoSlot) {
    if (rows.size() >= max_rows) {
      throw std::length_error("table full: a stripe holds at most " + std::to_string(max_rows) +
                              " keys (max_stripe_rows); use more shards, evict, or raise it");
    }
    const double need = static_cast<double>(rows.size() + 1);
    if (need > kMaxLoad * static_cast<double>(index.size())) {
      uint64_t capacity = std::max<uint64_t>(16, index.size() * 2);
      while (need > kMaxLoad * static_cast<double>(capacity)) capacity *= 2;
      Rehash(capacity);
      empty = kNoSlot;
    }
    const int64_t r = rows.Append(key);
    uint64_t pos = empty != kNoSlot ? empty : h & mask;
    while (index[pos] != 0) pos = (pos + 1) & mask;
    index[pos] = MakeSlot(r, h);
    return r;
  }

  uint64_t SlotOf(int64_t key, int64_t r) const {
    for (uint64_t pos = HashKey(key) & mask;; pos = (pos + 1) & mask) {
      if (RowOf(index[pos]) == r) return pos;
    }
  }

  void RemoveRow(int64_t r) {
    // Backward-shift deletion keeps linear probing chains intact without tombstones.
    uint64_t hole = SlotOf(rows.key(r), r);
    index[hole] = 0;
    for (uint64_t j = (hole + 1) & mask; index[j] != 0; j = (j + 1) & mask) {
      const uint64_t ideal = HashKey(rows.key(RowOf(index[j]))) & mask;
      const bool stays = hole <= j ? (hole < ideal && ideal <= j) : (hole < ideal || ideal <= j);
      if (!stays) {
        index[hole] = index[j];
        index[j] = 0;
        hole = j;
      }
    }
    // Keep rows dense: the last row takes the removed row's place.
    const int64_t last = rows.size() - 1;
    if (r != last) {
      uint32_t& slot = index[SlotOf(rows.key(last), last)];
      slot = static_cast<uint32_t>(r + 1) << 8 | (slot & 0xff);
      rows.CopyRecord(r, last);
    }
    rows.PopBack();
  }
};

HashTable::HashTable(const TableOptions& options)
    : options_(options), row_width_(options.dim * (1 + options.num_slots)) {
  stripes_.reserve(options.num_stripes);
  for (int i = 0; i < options.num_stripes; ++i) stripes_.emplace_back(new Stripe(row_width_));
  pool_ = std::make_unique<ChunkPool>(stripes_[0]->rows.chunk_bytes());
  for (auto& s : stripes_) s->rows.set_pool(pool_.get());
  stripe_shift_ = 64;
  for (int s = options.num_stripes; s > 1; s >>= 1) --stripe_shift_;
  if (options.capacity > 0) Reserve();
}

void HashTable::Reserve() {
  // Keys fall into stripes binomially: give each stripe its share plus 4 standard
  // deviations, so that no stripe outgrows its index before the table holds capacity.
  const double share = static_cast<double>(options_.capacity) / options_.num_stripes;
  const int64_t rows = static_cast<int64_t>(std::ceil(share + 4 * std::sqrt(share)));
  uint64_t slots = 16;
  while (static_cast<double>(rows) > kMaxLoad * static_cast<double>(slots)) slots *= 2;
  // Row memory for capacity rows, plus one chunk per stripe: each stripe's last chunk is
  // partly filled.
  const int64_t chunks =
      (options_.capacity + RowStore::kChunkRows - 1) / RowStore::kChunkRows + options_.num_stripes;
  try {
    for (auto& s : stripes_) s->ResetIndex(slots);
    pool_->Reserve(chunks);
  } catch (const std::exception& e) {
    const int64_t bytes = static_cast<int64_t>(slots * sizeof(uint32_t)) * options_.num_stripes +
                          chunks * stripes_[0]->rows.chunk_bytes();
    throw std::runtime_error("reserving " + std::to_string(options_.capacity) + " rows (" +
                             std::to_string(bytes >> 20) + " MiB) failed: " + e.what());
  }
  reserved_slots_ = slots;
}

HashTable::~HashTable() = default;

HashTable::Stripe& HashTable::StripeOf(uint64_t hash) const {
  return *stripes_[stripe_shift_ == 64 ? 0 : (hash >> stripe_shift_)];
}

template <bool kExclusive, typename Fn>
void HashTable::ForEachByStripe(const int64_t* keys, int64_t n, const float* stream,
                                Fn&& fn) const {
  const int stripes = options_.num_stripes;
  std::vector<uint64_t> hashes(n);
  std::vector<int64_t> start(stripes + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    hashes[i] = HashKey(keys[i]);
    ++start[(stripe_shift_ == 64 ? 0 : hashes[i] >> stripe_shift_) + 1];
  }
  for (int s = 0; s < stripes; ++s) start[s + 1] += start[s];
  // order: key positions grouped by stripe; sorted: their hashes in that order, so the
  // loops below read hashes sequentially (a gather through order was their top stall).
  std::vector<int64_t> order(n);
  std::vector<uint64_t> sorted(n);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = fill[stripe_shift_ == 64 ? 0 : hashes[i] >> stripe_shift_]++;
      order[at] = i;
      sorted[at] = hashes[i];
    }
  }
  constexpr int64_t kAhead = 8;
  auto run = [&](const Stripe& stripe, int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (j + kAhead < end && !stripe.index.empty()) {
        __builtin_prefetch(&stripe.index[sorted[j + kAhead] & stripe.mask]);
      }
      if (j + kAhead / 2 < end) {
        stripe.PrefetchRecord(sorted[j + kAhead / 2]);
        if (stream != nullptr) __builtin_prefetch(stream + order[j + kAhead / 2] * options_.dim);
      }
      fn(stripe, order[j], sorted[j]);
    }
  };
  // A stripe another thread holds is skipped and done after the others, so threads
  // working on parts of one batch do not convoy behind each other from stripe to stripe.
  using Lock = std::conditional_t<kExclusive, std::unique_lock<std::shared_mutex>,
                                  std::shared_lock<std::shared_mutex>>;
  std::vector<int> busy;
  const int first = n > 0 ? static_cast<int>(hashes[0] & (stripes - 1)) : 0;
  for (int t = 0; t < stripes; ++t) {
    const int s = (first + t) & (stripes - 1);
    if (start[s] == start[s + 1]) continue;
    Lock lock(stripes_[s]->mu, std::try_to_lock);
    if (!lock.owns_lock()) {
      busy.push_back(s);
      continue;
    }
    run(*stripes_[s], start[s], start[s + 1]);
  }
  for (int s : busy) {
    Lock lock(stripes_[s]->mu);
    run(*stripes_[s], start[s], start[s + 1]);
  }
}

void HashTable::InitialRow(int64_t key, float* out) const {
  const int64_t dim = options_.dim;
  switch (options_.init) {
    case InitKind::kZeros:
      std::fill(out, out + dim, 0.f);
      return;
    case InitKind::kConstant:
      std::fill(out, out + dim, options_.init_a);
      return;
    default:
      break;
  }
  const uint64_t base = Mix(options_.seed ^ Mix(static_cast<uint64_t>(key)));
  if (options_.init == InitKind::kUniform) {
    const float lo = options_.init_a, span = options_.init_b - options_.init_a;
    for (int64_t j = 0; j < dim; ++j) out[j] = lo + span * (Uniform01(Mix(base + j)) - 0.5f / 16777216.0f);
    return;
  }
  // Normal: Box-Muller, two values per pair of uniforms.
  for (int64_t j = 0; j < dim; j += 2) {
    const float u1 = Uniform01(Mix(base + 2 * j)), u2 = Uniform01(Mix(base + 2 * j + 1));
    const float radius = std::sqrt(-2.f * std::log(u1)) * options_.init_b;
    out[j] = options_.init_a + radius * std::cos(6.2831853071795864f * u2);
    if (j + 1 < dim) out[j + 1] = options_.init_a + radius * std::sin(6.2831853071795864f * u2);
  }
}

void HashTable::Find(const int64_t* keys, int64_t n, float* out, bool* found,
                     bool use_initializer) const {
  const int64_t dim = options_.dim;
  ForEachByStripe<false>(keys, n, nullptr, [&](const Stripe& s, int64_t i, uint64_t h) {
    const int64_t r = s.FindRow(keys[i], h);
    if (r >= 0) {
      std::memcpy(out + i * dim, s.rows.row(r), dim * sizeof(float));
    } else if (use_initializer) {
      InitialRow(keys[i], out + i * dim);
    } else {
      std::fill(out + i * dim, out + (i + 1) * dim, 0.f);
    }
    if (found) found[i] = r >= 0;
  });
}

int64_t HashTable::NewRow(Stripe& s, int64_t key, uint64_t h, uint64_t empty, bool init_value,
                          uint32_t freq) {
  const int64_t dim = options_.dim;
  const int64_t r = s.AddRow(key, h, options_.max_stripe_rows, empty);
  float* row = s.rows.row(r);
  if (init_value) InitialRow(key, row);
  for (int k = 0; k < options_.num_slots; ++k)
    std::fill(row + (k + 1) * dim, row + (k + 2) * dim, options_.slot_init[k]);
  s.rows.set_freq(r, freq);
  ++s.admitted;
  if (!s.pending.empty()) s.pending.erase(key);  // admitted: no longer counted
  return r;
}

void HashTable::FindOrInsert(const int64_t* keys, int64_t n, int64_t step, float* out) {
  const int64_t dim = options_.dim;
  std::vector<int64_t> inserted;
  ForEachByStripe<true>(keys, n, nullptr, [&](const Stripe& cs, int64_t i, uint64_t h) {
    Stripe& s = const_cast<Stripe&>(cs);
    const int64_t key = keys[i];
    uint64_t empty = Stripe::kNoSlot;
    int64_t r = s.FindRow(key, h, &empty);
    if (r < 0) {
      uint32_t seen = 1;
      if (options_.min_frequency > 1) {
        seen = ++s.pending[key];
        if (seen < options_.min_frequency) {
          InitialRow(key, out + i * dim);
          return;
        }
      }
      r = NewRow(s, key, h, empty, /*init_value=*/true, seen);  // may throw: the count stays
      s.rows.set_step(r, step);
      inserted.push_back(key);
    } else if (s.rows.freq(r) != UINT32_MAX) {
      s.rows.set_freq(r, s.rows.freq(r) + 1);
    }
    std::memcpy(out + i * dim, s.rows.row(r), dim * sizeof(float));
  });
  if (!inserted.empty()) MarkChanged(inserted.data(), static_cast<int64_t>(inserted.size()));
}

template <typename Fn>
void HashTable::UpdateRows(const int64_t* keys, int64_t n, const float* stream, int64_t step,
                           bool init_value, Fn&& fn) {
  const bool track = has_readers_.load(std::memory_order_acquire);
  std::vector<int64_t> changed;
  if (track) changed.reserve(n);
  ForEachByStripe<true>(keys, n, stream, [&](const Stripe& cs, int64_t i, uint64_t h) {
    Stripe& s = const_cast<Stripe&>(cs);
    const int64_t key = keys[i];
    uint64_t empty = Stripe::kNoSlot;
    int64_t r = s.FindRow(key, h, &empty);
    if (r < 0) {
      // fn(nullptr, i) decides whether a missing key gets a row (admission).
      if (!fn(nullptr, i)) return;
      r = NewRow(s, key, h, empty, init_value, 1);  // without init_value fn overwrites it
    }
    fn(s.rows.row(r), i);
    s.rows.set_step(r, step);
    if (track) changed.push_back(key);
  });
  if (track) MarkChanged(changed.data(), static_cast<int64_t>(changed.size()));
}

void HashTable::Insert(const int64_t* keys, int64_t n, const float* values, int64_t step) {
  const int64_t dim = options_.dim;
  UpdateRows(keys, n, values, step, /*init_value=*/false, [&](float* row, int64_t i) {
    if (row != nullptr) std::memcpy(row, values + i * dim, dim * sizeof(float));
    return true;
  });
}

void HashTable::Accumulate(const int64_t* keys, int64_t n, const float* deltas, int64_t step) {
  const int64_t dim = options_.dim;
  UpdateRows(keys, n, deltas, step, /*init_value=*/true, [&](float* row, int64_t i) {
    if (row != nullptr) {
      const float* d = deltas + i * dim;
      for (int64_t j = 0; j < dim; ++j) row[j] += d[j];
    }
    return true;
  });
}

int64_t HashTable::Remove(const int64_t* keys, int64_t n) {
  return RemoveKeys(keys, n, /*count_as_evicted=*/false);
}

int64_t HashTable::RemoveKeys(const int64_t* keys, int64_t n, bool count_as_evicted) {
  int64_t removed = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = HashKey(keys[i]);
    Stripe& s = StripeOf(h);
    std::unique_lock<std::shared_mutex> lock(s.mu);
    s.pending.erase(keys[i]);
    const int64_t r = s.FindRow(keys[i], h);
    if (r >= 0) {
      s.RemoveRow(r);
      ++removed;
      if (count_as_evicted) ++s.evicted;
    }
  }
  return removed;
}

ExportedRows HashTable::ExportSince(int64_t since_step) const {
  const int64_t dim = options_.dim, slots = options_.num_slots;
  ExportedRows raw;
  for (const auto& sp : stripes_) {
    const Stripe& s = *sp;
    std::shared_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = 0; r < s.size(); ++r) {
      if (s.rows.step(r) < since_step) continue;
      raw.keys.push_back(s.rows.key(r));
      const float* row = s.rows.row(r);
      raw.values.insert(raw.values.end(), row, row + dim);
      raw.slots.insert(raw.slots.end(), row + dim, row + row_width_);
      raw.freq.push_back(s.rows.freq(r));
      raw.step.push_back(s.rows.step(r));
    }
  }
  // Sort by key so that exports (and so checkpoints) are deterministic.
  std::vector<int64_t> order(raw.keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return raw.keys[a] < raw.keys[b]; });
  ExportedRows out;
  const int64_t n = static_cast<int64_t>(order.size());
  out.keys.resize(n);
  out.values.resize(n * dim);
  out.slots.resize(n * slots * dim);
  out.freq.resize(n);
  out.step.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t o = order[i];
    out.keys[i] = raw.keys[o];
    std::memcpy(&out.values[i * dim], &raw.values[o * dim], dim * sizeof(float));
    if (slots)
      std::memcpy(&out.slots[i * slots * dim], &raw.slots[o * slots * dim],
                  slots * dim * sizeof(float));
    out.freq[i] = raw.freq[o];
    out.step[i] = raw.step[o];
  }
  return out;
}

ExportedRows HashTable::Export() const { return ExportSince(INT64_MIN); }

std::string HashTable::Import(const int64_t* keys, int64_t n, const float* values,
                              const float* slots, int64_t slots_len, const int64_t* freq,
                              const int64_t* step, bool clear_first) {
  const int64_t dim = options_.dim, num_slots = options_.num_slots;
  if (slots_len != 0 && slots_len != n * num_slots * dim) {
    return "slots must hold n*num_slots*dim=" + std::to_string(n * num_slots * dim) +
           " floats (or none), got " + std::to_string(slots_len);
  }
  if (clear_first) {
    for (auto& sp : stripes_) {
      Stripe& s = *sp;
      std::unique_lock<std::shared_mutex> lock(s.mu);
      s.ResetIndex(reserved_slots_);  // a reserved table keeps its index size
      s.rows.Clear();
      s.pending.clear();
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = HashKey(keys[i]);
    Stripe& s = StripeOf(h);
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
  }
  MarkChanged(keys, n);
  return "";
}

void HashTable::MarkChanged(const int64_t* keys, int64_t n) {
  if (!has_readers_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(readers_mu_);
  for (auto& reader : changed_) reader.second.insert(keys, keys + n);
}

std::vector<int64_t> HashTable::TakeChanged(int64_t reader) {
  std::lock_guard<std::mutex> lock(readers_mu_);
  std::vector<int64_t> out;
  auto it = changed_.find(reader);
  if (it == changed_.end()) {
    changed_[reader];  // registered from now on
    has_readers_.store(true, std::memory_order_release);
    return out;
  }
  out.assign(it->second.begin(), it->second.end());
  std::sort(out.begin(), out.end());
  it->second.clear();
  return out;
}

template <typename Fn>
void HashTable::ApplyGrads(const int64_t* keys, int64_t n, const float* grads, int64_t step,
                           Fn&& update) {
  const int64_t dim = options_.dim;
  // With admission on, only admitted keys train; an unseen key's gradient is dropped.
  const bool create = options_.min_frequency <= 1;
  UpdateRows(keys, n, grads, step, /*init_value=*/true, [&](float* row, int64_t i) {
    if (row == nullptr) return create;
    update(row, grads + i * dim);
    return true;
  });
}

void HashTable::ApplySgd(const int64_t* keys, int64_t n, const float* grads, float lr,
                         int64_t step) {
  const int64_t dim = options_.dim;
  ApplyGrads(keys, n, grads, step, [&](float* row, const float* g) {
    for (int64_t j = 0; j < dim; ++j) row[j] -= lr * g[j];
  });
}

void HashTable::ApplyAdagrad(const int64_t* keys, int64_t n, const float* grads, float lr,
                             float eps, int64_t step) {
  const int64_t dim = options_.dim;
  ApplyGrads(keys, n, grads, step, [&](float* row, const float* g) {
    float* acc = row + dim;
    for (int64_t j = 0; j < dim; ++j) {
      acc[j] += g[j] * g[j];
      row[j] -= lr * g[j] / (std::sqrt(acc[j]) + eps);
    }
  });
}

void HashTable::ApplyAdam(const int64_t* keys, int64_t n, const float* grads, float lr,
                          float beta1, float beta2, float eps, int64_t step) {
  // Lazy Adam as TF applies it to sparse rows: bias correction from the global step.
  const int64_t dim = options_.dim;
  const double t = static_cast<double>(std::max<int64_t>(step, 1));
  const float lr_t = static_cast<float>(lr * std::sqrt(1.0 - std::pow(beta2, t)) /
                                        (1.0 - std::pow(beta1, t)));
  ApplyGrads(keys, n, grads, step, [&](float* row, const float* g) {
    float* m = row + dim;
    float* v = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      m[j] = beta1 * m[j] + (1 - beta1) * g[j];
      v[j] = beta2 * v[j] + (1 - beta2) * g[j] * g[j];
      row[j] -= lr_t * m[j] / (std::sqrt(v[j]) + eps);
    }
  });
}

void HashTable::ApplyFtrl(const int64_t* keys, int64_t n, const float* grads, float lr,
                          float lr_power, float l1, float l2, int64_t step) {
  // FTRL-Proximal (McMahan et al. 2013), as tf.compat.v1.train.FtrlOptimizer applies it.
  const int64_t dim = options_.dim;
  ApplyGrads(keys, n, grads, step, [&](float* row, const float* g) {
    float* z = row + dim;
    float* acc = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const float new_acc = acc[j] + g[j] * g[j];
      const float sigma = (std::pow(new_acc, -lr_power) - std::pow(acc[j], -lr_power)) / lr;
      z[j] += g[j] - sigma * row[j];
      acc[j] = new_acc;
      if (std::fabs(z[j]) <= l1) {
        row[j] = 0.f;
      } else {
        const float sign = z[j] > 0 ? 1.f : -1.f;
        row[j] = -(z[j] - sign * l1) / (std::pow(new_acc, -lr_power) / lr + 2 * l2);
      }
    }
  });
}

int64_t HashTable::EvictOlderThan(int64_t min_step) {
  int64_t removed = 0;
  for (auto& sp : stripes_) {
    Stripe& s = *sp;
    std::unique_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = s.size() - 1; r >= 0; --r) {
      if (s.rows.step(r) < min_step) {
        s.RemoveRow(r);
        ++s.evicted;
        ++removed;
      }
    }
  }
  return removed;
}

int64_t HashTable::EvictToTopN(int64_t keep) {
  std::vector<std::pair<uint32_t, int64_t>> all;  // (freq, key)
  for (const auto& sp : stripes_) {
    std::shared_lock<std::shared_mutex> lock(sp->mu);
    for (int64_t r = 0; r < sp->size(); ++r)
      all.emplace_back(sp->rows.freq(r), sp->rows.key(r));
  }
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

template <typename Fn>
int64_t HashTable::SumOverStripes(Fn&& fn) const {
  int64_t total = 0;
  for (const auto& s : stripes_) {
    std::shared_lock<std::shared_mutex> lock(s->mu);
    total += fn(*s);
  }
  return total;
}

int64_t HashTable::Size() const {
  return SumOverStripes([](const Stripe& s) { return s.size(); });
}

int64_t HashTable::admitted() const {
  return SumOverStripes([](const Stripe& s) { return s.admitted; });
}

int64_t HashTable::evicted() const {
  return SumOverStripes([](const Stripe& s) { return s.evicted; });
}

int64_t HashTable::pending_admission() const {
  return SumOverStripes([](const Stripe& s) { return static_cast<int64_t>(s.pending.size()); });
}

int64_t HashTable::MemoryBytes() const {
  // The indexes plus every block the pool mapped (rows held, chunks reserved or given
  // back, the current block's rest).
  return SumOverStripes([](const Stripe& s) -> int64_t {
           return static_cast<int64_t>(s.index.capacity() * sizeof(uint32_t));
         }) +
         pool_->MappedBytes();
}

}  // namespace tfpsx
