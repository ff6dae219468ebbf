// TFPSX_HOST_DEVICE marks the inline functions that both the CPU table and CUDA code run
// (the key hash, the initializer, the optimizers' row math): one definition, so a GPU
// table draws and trains rows by the same formulas as the CPU table.

#ifndef TFPSX_CORE_HOST_DEVICE_H_
#define TFPSX_CORE_HOST_DEVICE_H_

#ifdef __CUDACC__
#define TFPSX_HOST_DEVICE __host__ __device__
#else
#define TFPSX_HOST_DEVICE
#endif

#endif  // TFPSX_CORE_HOST_DEVICE_H_
