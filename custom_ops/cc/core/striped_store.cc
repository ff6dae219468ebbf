#include "custom_ops/cc/core/striped_store.h"

#include <cmath>

namespace tfpsx {

void Stripe::Rehash(uint64_t capacity) {
  ResetIndex(capacity);
  for (int64_t r = 0; r < rows.size(); ++r) {
    const uint64_t h = HashKey(rows.key(r));
    uint64_t pos = h & mask;
    while (index[pos] != 0) pos = (pos + 1) & mask;
    index[pos] = MakeSlot(r, h);
  }
}

uint64_t Stripe::SlotOf(int64_t key, int64_t r) const {
  for (uint64_t pos = HashKey(key) & mask;; pos = (pos + 1) & mask) {
    if (RowOf(index[pos]) == r) return pos;
  }
}

void Stripe::RemoveRow(int64_t r) {
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

StripedStore::StripedStore(int64_t row_width, int num_stripes) {
  stripes_.reserve(num_stripes);
  for (int i = 0; i < num_stripes; ++i) stripes_.emplace_back(new Stripe(i, row_width));
  pool_ = std::make_unique<ChunkPool>(stripes_[0]->rows.chunk_bytes());
  for (auto& s : stripes_) s->rows.set_pool(pool_.get());
  stripe_shift_ = 64;
  for (int s = num_stripes; s > 1; s >>= 1) --stripe_shift_;
}

void StripedStore::Reserve(int64_t capacity) {
  const int stripes = num_stripes();
  // Keys fall into stripes binomially: give each stripe its share plus 4 standard
  // deviations, so that no stripe outgrows its index before the table holds capacity.
  const double share = static_cast<double>(capacity) / stripes;
  const int64_t rows = static_cast<int64_t>(std::ceil(share + 4 * std::sqrt(share)));
  uint64_t slots = 16;
  while (static_cast<double>(rows) > kMaxLoad * static_cast<double>(slots)) slots *= 2;
  // Row memory for capacity rows, plus one chunk per stripe when a chunk holds several
  // rows: each stripe's last chunk is partly filled.
  const RowStore& rows0 = stripes_[0]->rows;
  const int64_t chunks = (capacity + rows0.chunk_rows() - 1) / rows0.chunk_rows() +
                         (rows0.chunk_rows() > 1 ? stripes : 0);
  try {
    for (auto& s : stripes_) s->ResetIndex(slots);
    pool_->Reserve(chunks);
  } catch (const std::exception& e) {
    const int64_t bytes = static_cast<int64_t>(slots * sizeof(uint32_t)) * stripes +
                          chunks * stripes_[0]->rows.chunk_bytes();
    throw std::runtime_error("reserving " + std::to_string(capacity) + " rows (" +
                             std::to_string(bytes >> 20) + " MiB) failed: " + e.what());
  }
  reserved_slots_ = slots;
}

int64_t StripedStore::IndexBytes() const {
  return SumOverStripes([](const Stripe& s) -> int64_t {
    return static_cast<int64_t>(s.index.capacity() * sizeof(uint32_t));
  });
}

int64_t StripedStore::UsedBytes() const {
  return SumOverStripes([](const Stripe& s) -> int64_t {
    return static_cast<int64_t>(s.index.capacity() * sizeof(uint32_t)) +
           s.size() * s.rows.record_bytes();
  });
}

int64_t StripedStore::ReservedBytes() const { return IndexBytes() + pool_->MappedBytes(); }

}  // namespace tfpsx
