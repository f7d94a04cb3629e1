// Host-side launch helpers shared by the kernels' launchers: per-device facts read once, the dynamic
// shared memory opt-in, and a launch with programmatic dependent launch (sm_90+). CUDA runtime API
// only (no device code), so the CPU emulation of the kernels (tests/cuda_emulator) uses it as it is.
#pragma once

#include "gemma4_mtp/common.cuh"

namespace gemma4_mtp {

// Per-device facts the launches need, read once per device (no configuration calls at launch time, so
// that launches inside a CUDA-graph capture stay plain kernel nodes).
struct DeviceInfo {
  int smem_optin = 0;  // bytes of dynamic shared memory a block may opt in to
  bool pdl = false;    // programmatic dependent launch (sm_90+)
};

inline cudaError_t device_info(DeviceInfo* out) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo cache[kMaxDevices];
  static bool known[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < kMaxDevices && known[dev]) {
    *out = cache[dev];
    return cudaSuccess;
  }
  DeviceInfo info;
  int major = 0;
  err = cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err != cudaSuccess) return err;
  info.pdl = major >= 9;
  if (dev < kMaxDevices) {
    cache[dev] = info;
    known[dev] = true;
  }
  *out = info;
  return cudaSuccess;
}

// The current device's SM count (1 when it cannot be read).
inline int device_sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) return 1;
  return sms;
}

// Sets a kernel's dynamic shared memory opt-in once per device. The kernel is a template argument so
// that each kernel has its own record: kernels of one signature share a type, and a record per type
// would skip the opt-in of every such kernel after the first (its launch then fails).
template <auto kernel>
cudaError_t opt_in_smem(int bytes) {
  constexpr int kMaxDevices = 64;
  static int done[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < kMaxDevices && done[dev] >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && dev < kMaxDevices) done[dev] = bytes;
  return err;
}

namespace detail {
template <class Kernel, class... Args>
cudaError_t launch_with(const cudaLaunchAttribute* attrs, unsigned num_attrs, Kernel kernel, dim3 grid, int threads,
                        size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = const_cast<cudaLaunchAttribute*>(attrs);
  cfg.numAttrs = num_attrs;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}
}  // namespace detail

// Launches `kernel` on `stream`; with pdl, as a programmatic dependent launch: it may be scheduled while
// the previous kernel of the stream still runs and must call griddep_wait() before it reads anything
// that kernel writes.
template <class Kernel, class... Args>
cudaError_t launch(Kernel kernel, dim3 grid, int threads, size_t smem, bool pdl, cudaStream_t stream,
                   Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  return detail::launch_with(attr, pdl ? 1 : 0, kernel, grid, threads, smem, stream, args...);
}

// Launches `kernel` on `stream` as a cooperative launch: every program co-resident (or a launch error),
// so that they may meet at grid_barrier() (grid_barrier.cuh).
template <class Kernel, class... Args>
cudaError_t launch_cooperative(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  return detail::launch_with(attr, 1, kernel, grid, threads, smem, stream, args...);
}

// The most programs a cluster may have here: 8 anywhere (portable), 16 on H100 / H200 once the kernel
// allows non-portable sizes (which launch_cluster asks for).
constexpr int kPortableCluster = 8;
constexpr int kMaxCluster = 16;

// The launch attribute of clusters of `cluster` programs along x (launch_cluster's, and what
// cudaOccupancyMaxActiveClusters is asked about).
inline cudaLaunchAttribute cluster_dimension(int cluster) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// Launches `kernel` on `stream` in clusters of `cluster` programs along x (sm_90+; grid.x a multiple of
// it), which meet at cluster_sync() and read each other's shared memory (cluster.cuh). Sizes above 8 are
// opted in per kernel (cudaFuncAttributeNonPortableClusterSizeAllowed) first; whether a size fits the
// GPU (its programs' shared memory and registers on the SMs of one GPC) is
// cudaOccupancyMaxActiveClusters's answer, or a launch error.
template <auto kernel, class... Args>
cudaError_t launch_cluster(dim3 grid, int cluster, int threads, size_t smem, cudaStream_t stream, Args... args) {
  if (cluster < 1 || cluster > kMaxCluster || grid.x % static_cast<unsigned>(cluster) != 0)
    return cudaErrorInvalidValue;
  if (cluster > kPortableCluster) {  // once per device, as opt_in_smem
    constexpr int kMaxDevices = 64;
    static bool done[kMaxDevices] = {};
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess && !(dev < kMaxDevices && done[dev]))
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
    if (dev < kMaxDevices) done[dev] = true;
  }
  const cudaLaunchAttribute attr[1] = {cluster_dimension(cluster)};
  return detail::launch_with(attr, 1, kernel, grid, threads, smem, stream, args...);
}

}  // namespace gemma4_mtp
