// Where a table's row chunks come from: 2 MiB blocks mapped for the table. A chunk a
// stripe gives back is kept for the table's next chunk, and the blocks go back to the
// system with the table (not left in malloc's heap). With TFPSX_TABLE_HUGE_PAGES=1 the
// blocks are madvise'd for transparent huge pages: one page fault per 2 MiB instead of
// 512. Off by default: on this project's VMs it made inserting new keys ~35% faster in
// the native benchmark but 2-3x slower inside a TF process (huge-page faults there were
// slow and erratic), see README.
//
// Thread safety: every method may be called concurrently (one mutex; a table asks for a
// chunk once per 512 rows).

#ifndef TFPSX_CORE_CHUNK_POOL_H_
#define TFPSX_CORE_CHUNK_POOL_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace tfpsx {

class ChunkPool {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;

  explicit ChunkPool(size_t chunk_bytes);
  ~ChunkPool();
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

  size_t chunk_bytes() const { return chunk_bytes_; }

  // A chunk of chunk_bytes (a given-back one first). Throws std::runtime_error when no
  // block can be mapped.
  char* Get();
  void Put(char* chunk);
  // Maps blocks for at least `chunks` more chunks (whole blocks) and faults their pages
  // in now, so that the chunks Get hands out later cost no page faults. Throws
  // std::runtime_error when the memory cannot be mapped or faulted in.
  void Reserve(int64_t chunks);
  int64_t MappedBytes();

 private:
  char* AllocBlock();
  static void Populate(char* p, size_t bytes);
  void FreeBlock(char* b);

  const size_t chunk_bytes_;
  const size_t block_bytes_;
  const bool huge_pages_;
  std::mutex mu_;
  std::vector<char*> blocks_;
  std::vector<char*> free_;
  char* cur_ = nullptr;
  size_t left_ = 0;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_CHUNK_POOL_H_
