// How many thread-block clusters of each size and shared memory per block the GPU holds at once, and so how many of
// its SMs they keep busy (clusters live inside one GPC: where a GPC's SMs are no multiple of the cluster's, some stand
// idle). Standalone: nvcc -O2 -std=c++17 -gencode=arch=compute_90,code=sm_90 scripts/diag/cluster_occupancy.cu -o co && ./co
#include <cuda_runtime.h>

#include <cstdio>

__global__ void probe(float* out) {
  extern __shared__ float smem[];
  smem[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  if (out) out[blockIdx.x] = smem[(threadIdx.x + 1) % blockDim.x];
}

int main() {
  int dev = 0, sms = 0, optin = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, dev);
  std::printf("%s: %d SMs, %d bytes of shared memory a block at most\n", prop.name, sms, optin);
  std::printf("%8s %10s %10s %14s %12s\n", "cluster", "smem KiB", "clusters", "blocks a SM", "SMs busy");
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  const int kib[] = {48, 96, 112, 192, 220};
  for (int size = 1; size <= 16; size *= 2) {
    for (int k : kib) {
      const size_t smem = (size_t)k * 1024;
      if ((int)smem > optin) continue;
      cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(size), cfg.blockDim = dim3(512), cfg.dynamicSmemBytes = smem;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = size, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr, cfg.numAttrs = 1;
      int clusters = 0, per_sm = 0;
      const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, probe, &cfg);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe, 512, smem);
      if (e != cudaSuccess) {
        std::printf("%8d %10d %s\n", size, k, cudaGetErrorString(e));
        cudaGetLastError();
        continue;
      }
      const double busy = per_sm ? (double)clusters * size / per_sm : 0.0;
      std::printf("%8d %10d %10d %14d %12.1f\n", size, k, clusters, per_sm, busy);
    }
  }
  return 0;
}
