// Reads the records of one split (a byte range of a file): what a worker trains of a
// lease (split_coordinator.h), at the cost of the split's bytes, not its file's.
//
// Text: a record is a line (without its '\n'; a '\r' before it is kept). The split
// [start, end) holds the lines that start in it: when start > 0 the first is the one
// after the first '\n' at or after start - 1 (a line that starts before start belongs to
// the split before), and the last may run past end. A record's end offset is where the
// next line starts (or the file's size, for a last line without '\n'): the position a
// worker commits. A read resumes at any such offset.
//
// TFRecord (uncompressed): a record is [length uint64 | masked crc32c of length |
// data | masked crc32c of data]; a split holds the records that start in [start, end)
// (a split of TFRecords is a whole file, or starts at a record's first byte). Both CRCs
// are checked: a corrupt record throws, naming the file and its offset.
//
// One call reads at most about max_bytes of records (at least one), so that a large
// split is read in chunks with bounded memory: next is the offset to continue from, -1
// once the split is read. Errors (a missing file, a short read) throw std::runtime_error
// naming the file and the system's reason.

#ifndef TFPSX_CORE_SPLIT_READER_H_
#define TFPSX_CORE_SPLIT_READER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tfpsx {

enum class RecordFormat { kText, kTfRecord };

struct SplitChunk {
  std::vector<std::string> records;
  std::vector<int64_t> ends;  // each record's end offset (the next record's start)
  int64_t next = -1;          // where to continue; -1: the split is read
  int64_t bytes_read = 0;     // bytes read from the file
};

// Records of [start, end) of `path` from `resume` (start, or a record's end offset).
SplitChunk ReadSplit(const std::string& path, RecordFormat format, int64_t start,
                     int64_t resume, int64_t end, int64_t max_bytes);

// Where a read of records stopped: next (-1: the split is read) and the bytes it read.
struct SplitRead {
  int64_t next = -1;
  int64_t bytes_read = 0;
};

// The same read, each record handed to `emit(data, size, end offset)` as it is found
// (its bytes valid during the call only): a caller copies each record once, into its
// own storage (the kernel: straight into its output strings). The read's window of
// bytes is this thread's, kept from one read to the next (no fresh buffer, and no
// fresh pages, per chunk).
SplitRead ReadSplitRecords(const std::string& path, RecordFormat format, int64_t start,
                           int64_t resume, int64_t end, int64_t max_bytes,
                           const std::function<void(const char*, size_t, int64_t)>& emit);

// CRC-32C (Castagnoli) of data, and TFRecord's masking of it.
uint32_t Crc32c(const char* data, size_t n);
inline uint32_t MaskCrc(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace tfpsx

#endif  // TFPSX_CORE_SPLIT_READER_H_
