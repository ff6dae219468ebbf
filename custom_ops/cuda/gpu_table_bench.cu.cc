// Native benchmark of the GPU table (gpu_table.h): Mkeys/s of find_or_insert (new keys)
// and find (hits) at 1M and 10M keys, dim 16 and 128, and what fraction of the device's
// memory bandwidth the bytes a find moves make. nvcc, no TensorFlow:
//
//   make cuda-bench        (builds build/native/cuda/gpu_table_bench and runs it)
//
// Bytes per found key: the key read (8), its slot's key (8) and ready flag (4), the row
// read from the table and written out (2 * 4 * dim). HierarchicalKV's published figures
// (find, dim 8..) are the reference: ~2.5 B keys/s on an A100, up to 3.9 on an H100.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "custom_ops/cuda/gpu_table.h"

namespace {

using tfpsx::cuda::Check;

double PeakBytesPerSecond() {
  int device = 0, clock_khz = 0, bus_bits = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  Check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device),
        "memory clock");
  Check(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device), "bus width");
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0);  // double data rate
}

template <typename Fn>
double Seconds(Fn&& fn, int reps) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "event");
  Check(cudaEventCreate(&stop), "event");
  fn();  // warm-up
  Check(cudaEventRecord(start), "record");
  for (int r = 0; r < reps; ++r) fn();
  Check(cudaEventRecord(stop), "record");
  Check(cudaEventSynchronize(stop), "sync");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / 1e3 / reps;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "properties");
  const double peak = PeakBytesPerSecond();
  std::printf("device: %s, memory bandwidth %.0f GB/s\n", prop.name, peak / 1e9);
  std::printf("%10s %5s %22s %14s %12s %10s\n", "keys", "dim", "find_or_insert Mkeys/s",
              "find Mkeys/s", "find GB/s", "of peak");
  tfpsx::RowInitializer init;
  init.kind = tfpsx::InitKind::kNormal;
  init.b = 0.05f;
  for (long long n : {1000000LL, 10000000LL}) {
    std::vector<int64_t> keys(n);
    std::mt19937_64 rng(n);
    for (auto& k : keys) k = static_cast<int64_t>(rng() >> 1);
    int64_t* d_keys = nullptr;
    Check(cudaMalloc(&d_keys, n * sizeof(int64_t)), "keys");
    Check(cudaMemcpy(d_keys, keys.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice), "copy");
    for (long long dim : {16LL, 128LL}) {
      float* d_rows = nullptr;
      Check(cudaMalloc(&d_rows, n * dim * sizeof(float)), "rows");
      double insert_s = 0;
      {
        // A fresh table per insert run: every key is new.
        const int reps = 3;
        for (int r = 0; r < reps + 1; ++r) {
          tfpsx::cuda::GpuHashTable table(2 * n, dim, init);
          cudaEvent_t a, b;
          cudaEventCreate(&a);
          cudaEventCreate(&b);
          cudaEventRecord(a);
          table.FindOrInsert(d_keys, n, d_rows, nullptr);
          cudaEventRecord(b);
          Check(cudaEventSynchronize(b), "insert");
          float ms = 0;
          cudaEventElapsedTime(&ms, a, b);
          if (r > 0) insert_s += ms / 1e3 / reps;  // the first run warms up
          cudaEventDestroy(a);
          cudaEventDestroy(b);
        }
      }
      tfpsx::cuda::GpuHashTable table(2 * n, dim, init);
      table.FindOrInsert(d_keys, n, d_rows, nullptr);
      const double find_s = Seconds([&] { table.Find(d_keys, n, d_rows, nullptr, nullptr); }, 10);
      const double bytes = n * (8.0 + 8.0 + 4.0 + 2.0 * 4.0 * dim);
      std::printf("%10lld %5lld %22.0f %14.0f %12.0f %9.0f%%\n", n, dim, n / insert_s / 1e6,
                  n / find_s / 1e6, bytes / find_s / 1e9, 100.0 * bytes / find_s / peak);
      cudaFree(d_rows);
    }
    cudaFree(d_keys);
  }
  return 0;
}
