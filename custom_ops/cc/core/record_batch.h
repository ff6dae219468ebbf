// Whole rows in flight between a table's RAM and its disk tier: key, step, frequency and
// [value | slots], in one record layout for both.

#ifndef TFPSX_CORE_RECORD_BATCH_H_
#define TFPSX_CORE_RECORD_BATCH_H_

#include <cstdint>
#include <vector>

namespace tfpsx {

struct RecordBatch {
  int64_t width = 0;  // floats per row
  std::vector<int64_t> keys, steps;
  std::vector<uint32_t> freqs;
  std::vector<float> rows;  // size() * width
  int64_t size() const { return static_cast<int64_t>(keys.size()); }
  void Add(int64_t key, int64_t step, uint32_t freq, const float* row) {
    keys.push_back(key);
    steps.push_back(step);
    freqs.push_back(freq);
    rows.insert(rows.end(), row, row + width);
  }
  void Clear() {
    keys.clear();
    steps.clear();
    freqs.clear();
    rows.clear();
  }
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_RECORD_BATCH_H_
