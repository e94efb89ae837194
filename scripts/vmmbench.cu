// Times the CUDA VMM calls a pool makes per page (cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease)
// for 2, 8, 32 and 128 MiB pages. Build and run on a GPU machine: nvcc -O2 -o vmmbench scripts/vmmbench.cu -lcuda
#include <cuda.h>
#include <stdio.h>
#include <chrono>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); printf("%s failed: %s (line %d)\n", #x, s, __LINE__); return 1; } } while (0)
static double now() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  size_t gran; CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)); printf("granularity %zu\n", gran);
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t total = 512ull << 20;  // 512 MiB per round
  for (size_t page : {2ull << 20, 8ull << 20, 32ull << 20, 128ull << 20}) {
    int n = total / page; CUdeviceptr va; CK(cuMemAddressReserve(&va, total, page, 0, 0));
    CUmemGenericAllocationHandle h[512];
    for (int round = 0; round < 3; round++) {
      double t0 = now(); for (int i = 0; i < n; i++) CK(cuMemCreate(&h[i], page, &prop, 0));
      double t1 = now(); for (int i = 0; i < n; i++) CK(cuMemMap(va + i * page, page, 0, h[i], 0));
      double t2 = now(); CK(cuMemSetAccess(va, total, &acc, 1));
      double t3 = now(); CK(cuCtxSynchronize());
      double t4 = now(); for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * page, page));
      double t5 = now(); for (int i = 0; i < n; i++) CK(cuMemRelease(h[i]));
      double t6 = now();
      // per-page setAccess (what a pool mapping one page at a time pays)
      for (int i = 0; i < n; i++) CK(cuMemCreate(&h[i], page, &prop, 0));
      for (int i = 0; i < n; i++) CK(cuMemMap(va + i * page, page, 0, h[i], 0));
      double t7 = now(); for (int i = 0; i < n; i++) CK(cuMemSetAccess(va + i * page, page, &acc, 1));
      double t8 = now();
      CUresult multi = cuMemUnmap(va, total);  // one call over many mappings
      if (multi != CUDA_SUCCESS) for (int i = 0; i < n; i++) CK(cuMemUnmap(va + i * page, page));
      double t9 = now();
      for (int i = 0; i < n; i++) CK(cuMemRelease(h[i]));
      printf("page %4zu MiB x%3d: create %7.1f us/page  map %6.1f  setAccess(all) %8.1f us total  unmap %6.1f  release %6.1f  setAccess/page %6.1f  unmap-all-in-one %s %8.1f us total\n",
             page >> 20, n, (t1 - t0) / n, (t2 - t1) / n, t3 - t2, (t5 - t4) / n, (t6 - t5) / n, (t8 - t7) / n, multi == CUDA_SUCCESS ? "ok" : "refused", t9 - t8);
    }
    CK(cuMemAddressFree(va, total));
  }
  // cost of an idle context synchronize
  double t0 = now(); for (int i = 0; i < 1000; i++) CK(cuCtxSynchronize()); printf("idle cuCtxSynchronize %.2f us\n", (now() - t0) / 1000);
  return 0;
}
