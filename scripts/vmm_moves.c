// What moving a page of a virtual reservation costs on CUDA, per mapping size, and whether cuMemUnmap waits for
// work on other streams. Build and run on a GPU machine:
//   gcc -O2 scripts/vmm_moves.c -I/usr/local/cuda/include -lcuda -o vmm_moves && ./vmm_moves
// Part 1: microseconds per 128 MiB range for pages of 2 to 128 MiB (median of 9): create, map, one access grant,
// unmap, release, and a move (unmap, map, grant) of the same handles; a grant per page; an idle cuCtxSynchronize.
// Part 2: with 40 memsets of 4 GiB queued on stream b (37 ms on an H200), times an idle stream's synchronize, cuMemUnmap of an
// unrelated page, a map and grant, and then cuCtxSynchronize.
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char *s; cuGetErrorString(r, &s); \
  fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)

static double now_us(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }

int main(void) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  size_t gran; CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemAccessDesc acc = {0}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t MiB = 1 << 20, range = 128 * MiB;
  size_t pages_mib[] = {2, 4, 8, 16, 32, 64, 128};
  printf("granularity %zu; range %zu MiB; us per whole range (median of 9)\n", gran, range / MiB);
  printf("%8s %6s %10s %10s %10s %10s %10s %12s %12s %10s\n", "page_MiB", "pages", "create", "map", "setaccess",
         "unmap", "release", "move(u+m+a)", "setacc/page", "sync_idle");
  CUdeviceptr va; CK(cuMemAddressReserve(&va, range, 0, 0, 0));
  for (int k = 0; k < 7; k++) {
    size_t p = pages_mib[k] * MiB, n = range / p;
    CUmemGenericAllocationHandle *h = malloc(n * sizeof *h);
    double t[7][9];
    for (int rep = 0; rep < 9; rep++) {
      double a = now_us();
      for (size_t i = 0; i < n; i++) CK(cuMemCreate(&h[i], p, &prop, 0));
      double b = now_us();
      for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * p, p, 0, h[i], 0));
      double c = now_us();
      CK(cuMemSetAccess(va, range, &acc, 1));
      double d = now_us();
      for (size_t i = 0; i < n; i++) CK(cuMemUnmap(va + i * p, p));
      double e = now_us();
      // A page move: the same handles unmapped elsewhere, mapped here again, access granted.
      for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * p, p, 0, h[i], 0));
      double e2 = now_us();
      for (size_t i = 0; i < n; i++) CK(cuMemSetAccess(va + i * p, p, &acc, 1));
      double e3 = now_us();
      for (size_t i = 0; i < n; i++) CK(cuMemUnmap(va + i * p, p));
      double e4 = now_us();
      for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * p, p, 0, h[i], 0));
      CK(cuMemSetAccess(va, range, &acc, 1));
      for (size_t i = 0; i < n; i++) CK(cuMemUnmap(va + i * p, p));
      double f = now_us();
      for (size_t i = 0; i < n; i++) CK(cuMemRelease(h[i]));
      double g = now_us();
      CK(cuCtxSynchronize());
      double s0 = now_us(); CK(cuCtxSynchronize()); double s1 = now_us();
      static double sync[9];
      t[0][rep] = b - a; t[1][rep] = c - b; t[2][rep] = d - c; t[3][rep] = e - d; t[4][rep] = g - f;
      t[5][rep] = f - e4; t[6][rep] = (e3 - e2) / n; sync[rep] = s1 - s0;
      if (rep == 8) {
        for (int col = 0; col < 7; col++) for (int i = 0; i < 9; i++) for (int j = i + 1; j < 9; j++)
          if (t[col][j] < t[col][i]) { double x = t[col][i]; t[col][i] = t[col][j]; t[col][j] = x; }
        for (int i = 0; i < 9; i++) for (int j = i + 1; j < 9; j++) if (sync[j] < sync[i]) { double x = sync[i]; sync[i] = sync[j]; sync[j] = x; }
        printf("%8zu %6zu %10.1f %10.1f %10.1f %10.1f %10.1f %12.1f %12.1f %10.1f\n", pages_mib[k], n, t[0][4], t[1][4],
               t[2][4], t[3][4], t[4][4], t[5][4], t[6][4], sync[4]);
      }
    }
    free(h);
  }
  // For scale: cuMemAlloc + cuMemFree of the same range, and stream-ordered cuMemAllocAsync + free.
  double best = 1e18, best_async = 1e18;
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  for (int rep = 0; rep < 9; rep++) {
    CUdeviceptr d; double a = now_us(); CK(cuMemAlloc(&d, range)); CK(cuMemFree(d)); double b = now_us();
    if (b - a < best) best = b - a;
    a = now_us(); CK(cuMemAllocAsync(&d, range, s)); CK(cuMemFreeAsync(d, s)); CK(cuStreamSynchronize(s)); b = now_us();
    if (b - a < best_async) best_async = b - a;
  }
  printf("cuMemAlloc+cuMemFree %zu MiB: %.1f us; cuMemAllocAsync+FreeAsync+sync: %.1f us\n", range / MiB, best, best_async);
  {
    size_t page = 2 << 20, big = (size_t)4 << 30;
    CUdeviceptr busy; CK(cuMemAlloc(&busy, big));
    CUstream a, b; CK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
    CUdeviceptr va; CK(cuMemAddressReserve(&va, 8 * page, 0, 0, 0));
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, page, &prop, 0));
    for (int rep = 0; rep < 3; rep++) {
      CK(cuMemMap(va, page, 0, h, 0)); CK(cuMemSetAccess(va, page, &acc, 1));
      CK(cuMemsetD8Async(va, 1, page, a)); CK(cuStreamSynchronize(a));
      double t0 = now_us();
      for (int i = 0; i < 40; i++) CK(cuMemsetD8Async(busy, i, big, b));
      double t1 = now_us(); CK(cuStreamSynchronize(a)); double t2 = now_us();
      CK(cuMemUnmap(va, page)); double t3 = now_us();
      CK(cuMemMap(va + page, page, 0, h, 0)); CK(cuMemSetAccess(va + page, page, &acc, 1)); double t4 = now_us();
      CK(cuMemUnmap(va + page, page)); double t5 = now_us();
      CK(cuCtxSynchronize()); double t6 = now_us();
      printf("queue %.0f us; idle stream sync %.1f us; unmap %.1f us; map+access %.1f us; unmap %.1f us; then ctx sync %.0f us\n",
             t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5);
    }
  }
  return 0;
}
