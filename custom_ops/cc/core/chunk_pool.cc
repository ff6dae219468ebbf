#include "custom_ops/cc/core/chunk_pool.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "custom_ops/cc/core/env_bool.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace tfpsx {
namespace {

bool HugePagesWanted() { return EnvBool("TFPSX_TABLE_HUGE_PAGES", false); }

size_t RoundUp(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit * unit; }

}  // namespace

ChunkPool::ChunkPool(size_t chunk_bytes)
    : chunk_bytes_(chunk_bytes), huge_pages_(HugePagesWanted()) {}

ChunkPool::~ChunkPool() {
  for (const Block& b : blocks_) FreeBlock(b);
}

size_t ChunkPool::BlockBytes(int64_t chunks) const {
  // Geometric growth: a sixteenth of what is mapped (~38 blocks per 10x of rows), in
  // whole chunks, at least `chunks` of them.
  const size_t target = std::min(std::max(mapped_ / 16, kMinBlock), kMaxBlock);
  const size_t per_block =
      std::max<size_t>(static_cast<size_t>(chunks), target / chunk_bytes_);
  return RoundUp(per_block * chunk_bytes_, huge_pages_ ? kHugePage : kPage);
}

char* ChunkPool::Get() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!free_.empty()) {
    char* p = free_.back();
    free_.pop_back();
    return p;
  }
  if (!trimmed_.empty()) {
    char* p = trimmed_.back();
    trimmed_.pop_back();
    trimmed_bytes_ -= InteriorBytes(p);
    return p;
  }
  if (left_ < chunk_bytes_) {
    const size_t bytes = BlockBytes(1);
    cur_ = AllocBlock(bytes);
    left_ = bytes;
  }
  char* p = cur_;
  cur_ += chunk_bytes_;
  left_ -= chunk_bytes_;
  return p;
}

void ChunkPool::Put(char* chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(chunk);
}

void ChunkPool::Reserve(int64_t chunks) {
  if (chunks <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  const size_t bytes = RoundUp(static_cast<size_t>(chunks) * chunk_bytes_,
                               huge_pages_ ? kHugePage : kPage);
  char* block = AllocBlock(bytes);
  Populate(block, bytes);
  // Get pops from the back: hand the chunks out in address order.
  for (int64_t c = chunks - 1; c >= 0; --c) free_.push_back(block + c * chunk_bytes_);
}

size_t ChunkPool::InteriorBytes(const char* chunk) const {
  const uintptr_t begin = RoundUp(reinterpret_cast<uintptr_t>(chunk), kPage);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(chunk) + chunk_bytes_) & ~(kPage - 1);
  return end > begin ? end - begin : 0;
}

void ChunkPool::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  for (char* chunk : free_) {
    const size_t bytes = InteriorBytes(chunk);
    if (bytes > 0) {
      char* begin = reinterpret_cast<char*>(RoundUp(reinterpret_cast<uintptr_t>(chunk), kPage));
#ifdef __linux__
      ::madvise(begin, bytes, MADV_DONTNEED);  // advice: a failure only keeps the pages
#else
      (void)begin;
#endif
    }
    trimmed_bytes_ += bytes;
    trimmed_.push_back(chunk);
  }
  free_.clear();
}

int64_t ChunkPool::ResidentBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(mapped_ - left_ - trimmed_bytes_);
}

int64_t ChunkPool::MappedBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(mapped_);
}

char* ChunkPool::AllocBlock(size_t bytes) {
#ifdef __linux__
  // With huge pages, over-map by one huge page so the block can start on a boundary.
  const size_t align = huge_pages_ ? kHugePage : kPage;
  const size_t span = bytes + (huge_pages_ ? kHugePage : 0);
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    throw std::runtime_error("could not map " + std::to_string(span) +
                             " bytes for rows: " + std::strerror(errno));
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t start = (base + align - 1) & ~(uintptr_t{align} - 1);
  if (start > base) munmap(m, start - base);
  const uintptr_t end = start + bytes;
  if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
  if (huge_pages_) madvise(reinterpret_cast<void*>(start), bytes, MADV_HUGEPAGE);
  char* p = reinterpret_cast<char*>(start);
#else
  char* p = static_cast<char*>(std::malloc(bytes));
  if (p == nullptr) throw std::bad_alloc();
#endif
  try {
    blocks_.push_back(Block{p, bytes});
  } catch (...) {
    FreeBlock(Block{p, bytes});
    throw;
  }
  mapped_ += bytes;
  return p;
}

void ChunkPool::Populate(char* p, size_t bytes) {
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

void ChunkPool::FreeBlock(const Block& b) {
#ifdef __linux__
  munmap(b.start, b.bytes);
#else
  std::free(b.start);
#endif
}

}  // namespace tfpsx
