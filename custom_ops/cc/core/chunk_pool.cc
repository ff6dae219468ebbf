#include "custom_ops/cc/core/chunk_pool.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace tfpsx {
namespace {

bool HugePagesWanted() {
  const char* v = std::getenv("TFPSX_TABLE_HUGE_PAGES");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

ChunkPool::ChunkPool(size_t chunk_bytes)
    : chunk_bytes_(chunk_bytes),
      block_bytes_((std::max(chunk_bytes, kHugePage) + kHugePage - 1) / kHugePage * kHugePage),
      huge_pages_(HugePagesWanted()) {}

ChunkPool::~ChunkPool() {
  for (char* b : blocks_) FreeBlock(b);
}

char* ChunkPool::Get() {
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

void ChunkPool::Put(char* chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(chunk);
}

void ChunkPool::Reserve(int64_t chunks) {
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

int64_t ChunkPool::MappedBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(blocks_.size() * block_bytes_);
}

char* ChunkPool::AllocBlock() {
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

void ChunkPool::FreeBlock(char* b) {
#ifdef __linux__
  munmap(b, block_bytes_);
#else
  std::free(b);
#endif
}

}  // namespace tfpsx
