#include "custom_ops/cc/core/key_index.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "custom_ops/cc/core/initializer.h"

namespace tfpsx {
namespace {

constexpr int kMaxKicks = 500;
constexpr uint32_t kFpMask = (1u << 11) - 1;

// [0, m) from 32 bits of hash, without a division (Lemire's multiply-shift).
inline uint64_t Range(uint64_t hash32, uint64_t m) { return (hash32 * m) >> 32; }

}  // namespace

KeyIndex::KeyIndex(int64_t buckets) { Reset(buckets); }

void KeyIndex::Reset(int64_t buckets) {
  if (buckets < 1 || buckets >= (int64_t{1} << 32))
    throw std::invalid_argument("KeyIndex: buckets must be in [1, 2^32), got " +
                                std::to_string(buckets));
  // The old level's memory goes first. Should the new one fail to allocate, the index
  // is left empty and sized 0 (every call then finds nothing and Insert refuses).
  std::vector<uint32_t>().swap(slots_);
  buckets_ = 0;
  size_ = 0;
  slots_.assign(static_cast<size_t>(buckets * kWays), 0);
  buckets_ = buckets;
}

int64_t KeyIndex::BucketsFor(int64_t keys, int64_t at_least) {
  const int64_t want = static_cast<int64_t>(std::ceil(keys / (kWays * kRebuildLoad)));
  return std::max(want, at_least);
}

KeyIndex::Where KeyIndex::Locate(int64_t key) const {
  // A hash of its own (not the RAM table's HashKey), so that a key's place here does
  // not correlate with its stripe there.
  const uint64_t h = Mix(static_cast<uint64_t>(key) ^ 0x5bd1e9955bd1e995ULL);
  uint32_t fp = static_cast<uint32_t>(h) & kFpMask;
  if (fp == 0) fp = 1;  // 0 marks an empty slot
  return {Range(h >> 32, static_cast<uint64_t>(buckets_)), fp};
}

uint64_t KeyIndex::Alternate(uint64_t bucket, uint32_t fp) const {
  // (c - bucket) mod buckets, c from the fingerprint alone: its own inverse, for any
  // number of buckets (the xor of power-of-two filters would need one).
  const uint64_t m = static_cast<uint64_t>(buckets_);
  const uint64_t c = Range(Mix(fp) >> 32, m);
  return c >= bucket ? c - bucket : c + m - bucket;
}

bool KeyIndex::Place(uint32_t entry, uint64_t bucket) {
  const uint32_t fp = entry >> 21;
  const uint64_t other = Alternate(bucket, fp);
  for (uint64_t b : {bucket, other}) {
    for (int w = 0; w < kWays; ++w) {
      uint32_t& slot = slots_[b * kWays + w];
      if (slot == 0) {
        slot = entry;
        return true;
      }
    }
  }
  // Kick: swap the entry in hand with one of the bucket's and move that one to its
  // other bucket, kMaxKicks times at most; on failure undo every swap in reverse.
  std::vector<size_t> path;
  uint32_t hand = entry;
  uint64_t b = (kick_state_ & 1) ? bucket : other;
  for (int kick = 0; kick < kMaxKicks; ++kick) {
    kick_state_ = kick_state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    const size_t at = b * kWays + ((kick_state_ >> 33) & (kWays - 1));
    std::swap(hand, slots_[at]);
    path.push_back(at);
    b = Alternate(b, hand >> 21);
    for (int w = 0; w < kWays; ++w) {
      uint32_t& slot = slots_[b * kWays + w];
      if (slot == 0) {
        slot = hand;
        return true;
      }
    }
  }
  for (auto it = path.rbegin(); it != path.rend(); ++it) std::swap(hand, slots_[*it]);
  return false;  // hand == entry again
}

bool KeyIndex::Insert(int64_t key, int64_t segment, int64_t slot) {
  if (segment < 0 || segment >= kMaxSegments)
    throw std::out_of_range("KeyIndex: segment id " + std::to_string(segment) +
                            " out of range [0, " + std::to_string(kMaxSegments) + ")");
  if (slot < 0 || slot > kMaxSlot)
    throw std::out_of_range("KeyIndex: slot " + std::to_string(slot) + " out of range [0, " +
                            std::to_string(kMaxSlot) + "]");
  if (buckets_ == 0 ||
      size_ + 1 > static_cast<int64_t>(kMaxLoad * static_cast<double>(slots_.size())))
    return false;
  const Where w = Locate(key);
  if (!Place(Entry(w.fp, segment, slot), w.bucket)) return false;
  ++size_;
  return true;
}

void KeyIndex::Candidates(const int64_t* keys, int64_t n, std::vector<Candidate>* out) const {
  if (buckets_ == 0) return;
  constexpr int64_t kAhead = 8;
  auto prefetch = [&](int64_t key) {
    const Where w = Locate(key);
    __builtin_prefetch(&slots_[w.bucket * kWays]);
    __builtin_prefetch(&slots_[Alternate(w.bucket, w.fp) * kWays]);
  };
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) prefetch(keys[i]);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch(keys[i + kAhead]);
    const Where w = Locate(keys[i]);
    const uint64_t b1 = w.bucket, b2 = Alternate(b1, w.fp);
    for (uint64_t b : {b1, b2}) {
      for (int j = 0; j < kWays; ++j) {
        const uint32_t e = slots_[b * kWays + j];
        if (e != 0 && (e >> 21) == w.fp)
          out->push_back({keys[i], static_cast<int32_t>((e >> 5) & 0xffff),
                          static_cast<int32_t>(e & 31)});
      }
      if (b2 == b1) break;
    }
  }
}

uint32_t* KeyIndex::FindEntry(int64_t key, uint32_t segment_and_slot) {
  if (buckets_ == 0) return nullptr;
  const Where w = Locate(key);
  const uint32_t entry = w.fp << 21 | segment_and_slot;
  const uint64_t b1 = w.bucket, b2 = Alternate(b1, w.fp);
  for (uint64_t b : {b1, b2}) {
    for (int i = 0; i < kWays; ++i) {
      uint32_t& e = slots_[b * kWays + i];
      if (e == entry) return &e;
    }
  }
  return nullptr;
}

bool KeyIndex::Erase(int64_t key, int64_t segment, int64_t slot) {
  uint32_t* e = FindEntry(key, Entry(0, segment, slot));
  if (e == nullptr) return false;
  *e = 0;
  --size_;
  return true;
}

bool KeyIndex::Relabel(int64_t key, int64_t from, int64_t from_slot, int64_t to,
                       int64_t to_slot) {
  if (to < 0 || to >= kMaxSegments || to_slot < 0 || to_slot > kMaxSlot)
    throw std::out_of_range("KeyIndex: relabel to segment " + std::to_string(to) + " slot " +
                            std::to_string(to_slot) + " out of range");
  uint32_t* e = FindEntry(key, Entry(0, from, from_slot));
  if (e == nullptr) return false;
  *e = Entry(*e >> 21, to, to_slot);
  return true;
}

}  // namespace tfpsx
