// Where a table's row chunks come from: blocks of memory mapped for the table, carved
// into chunks of one fixed size. A chunk a stripe gives back is kept for the table's next
// chunk, and the blocks go back to the system with the table (not left in malloc's heap).
//
// What a table maps grows with the rows it holds: a block holds at least one chunk, and a
// new block is about a sixteenth of what is mapped already (64 KiB .. 8 MiB, whole
// chunks), so the part of the newest block not handed out yet stays under ~1/16 of the
// total (and 8 MiB) and a
// table of a few very wide rows maps a few chunks, not megabytes per row. (Blocks of a
// fixed 2 MiB, or one chunk when larger, used to map 614 MB per row of dim 100,000 with
// Adam.) The pool reports both what it mapped and what it handed out.
//
// With TFPSX_TABLE_HUGE_PAGES=1 the blocks are 2 MiB multiples on 2 MiB boundaries,
// madvise'd for transparent huge pages: one page fault per 2 MiB instead of 512. Off by
// default: on this project's VMs it made inserting new keys ~35% faster in the native
// benchmark but 2-3x slower inside a TF process (huge-page faults there were slow and
// erratic), see docs/tables.md.
//
// Thread safety: every method may be called concurrently (one mutex; a table asks for a
// chunk once per chunk of rows).

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
  static constexpr size_t kPage = 4096;
  static constexpr size_t kMinBlock = size_t{64} << 10;
  static constexpr size_t kMaxBlock = size_t{8} << 20;

  explicit ChunkPool(size_t chunk_bytes);
  ~ChunkPool();
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

  size_t chunk_bytes() const { return chunk_bytes_; }

  // A chunk of chunk_bytes (a given-back one first). Throws std::runtime_error when no
  // block can be mapped.
  char* Get();
  void Put(char* chunk);
  // Maps one block for `chunks` more chunks and faults its pages in now, so that the
  // chunks Get hands out later cost no page faults. Throws std::runtime_error when the
  // memory cannot be mapped or faulted in.
  void Reserve(int64_t chunks);
  // Every block mapped (chunks in use, given back or not handed out yet).
  int64_t MappedBytes();
  // Gives the pages of the chunks given back to the system (madvise DONTNEED); they
  // stay mapped and fault in again, zeroed, when handed out. A tiered table calls it
  // after moving rows to disk, so that its process's RSS follows the rows it holds.
  void Trim();
  // What may be resident: mapped, less the trimmed chunks and the newest block's part
  // not handed out yet (never touched unless reserved).
  int64_t ResidentBytes();

 private:
  struct Block {
    char* start;
    size_t bytes;
  };
  // The size of the next block holding at least `chunks` chunks (whole pages).
  size_t BlockBytes(int64_t chunks) const;
  char* AllocBlock(size_t bytes);
  // The whole pages inside a chunk (what Trim gives back).
  size_t InteriorBytes(const char* chunk) const;
  static void Populate(char* p, size_t bytes);
  static void FreeBlock(const Block& b);

  const size_t chunk_bytes_;
  const bool huge_pages_;
  std::mutex mu_;
  std::vector<Block> blocks_;
  std::vector<char*> free_;
  std::vector<char*> trimmed_;  // given back and trimmed: handed out after free_
  size_t trimmed_bytes_ = 0;    // their page-aligned interiors
  size_t mapped_ = 0;
  char* cur_ = nullptr;     // the newest block's part not handed out yet
  size_t left_ = 0;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_CHUNK_POOL_H_
