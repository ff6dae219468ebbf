// Many reads of files at given offsets in one submission to the kernel: a tiered table's
// batch of row groups (segment_store.h). Through io_uring when the kernel offers it (raw
// system calls, no liburing: nothing to install), one io_uring_enter for up to a ring's
// worth of reads; else, or with TFPSX_TIER_IO_URING=0, one pread per read. Reads served
// from the page cache complete inside the submitting call either way.
//
// Each thread that reads has its own ring (made on its first batch, closed when the
// thread ends): callers need no lock, so a prefetch can read without the table's.

#ifndef TFPSX_CORE_BATCH_READER_H_
#define TFPSX_CORE_BATCH_READER_H_

#include <cstdint>
#include <string>

namespace tfpsx {

struct FileRead {
  int fd;
  const std::string* path;  // named in errors
  char* buf;
  int64_t bytes;
  int64_t offset;
};

// Reads each of reads[n] whole. Throws std::runtime_error naming the file and the
// system's reason on an error, or when the file is shorter than asked (cut).
// Returns the number of submissions to the kernel it took.
int64_t ReadAll(FileRead* reads, int64_t n);

// Whether this thread's batches go through io_uring (false: the kernel refused a ring,
// or TFPSX_TIER_IO_URING=0).
bool BatchReadsUseIoUring();

}  // namespace tfpsx

#endif  // TFPSX_CORE_BATCH_READER_H_
