/* On a CUDA machine: checks that umm_alloc/umm_free leave the caller's current context alone (a context of the
 * caller's own, not umm's primary one), then times cached alloc+free pairs through the C ABI. Build and run:
 *   cc -O2 -I capi/include -I capi/tests capi/benches/context_and_cost.c -L DIR -lumm_capi -lcuda -Wl,-rpath,DIR -o ctx && ./ctx
 * Exit code 0 on success. Prints ns per alloc+free pair for a few sizes. */
#include "check.h"
#include "umm.h"
#include <cuda.h>
#include <stdio.h>
#include <time.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(void) {
    CUdevice dev;
    CUcontext mine, current;
    CHECK(cuInit(0) == CUDA_SUCCESS);
    CHECK(cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
    /* A context of our own (current now), not the device's primary context that umm uses. */
#if CUDA_VERSION >= 13000
    CHECK(cuCtxCreate(&mine, NULL, 0, dev) == CUDA_SUCCESS);
#else
    CHECK(cuCtxCreate(&mine, 0, dev) == CUDA_SUCCESS);
#endif

    /* First call: discovery, then a new segment or mapped pages (umm binds its primary context). */
    void *p = umm_alloc(3 << 20, 0, NULL);
    CHECK(p != NULL);
    CHECK(cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == mine);
    umm_free(p, 3 << 20, 0, NULL);
    CHECK(cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == mine);
    /* A cache hit, and a large request that maps pages. */
    p = umm_alloc(3 << 20, 0, NULL);
    void *q = umm_alloc(256 << 20, 0, NULL);
    CHECK(p != NULL && q != NULL);
    CHECK(cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == mine);
    umm_free(q, 256 << 20, 0, NULL);
    umm_free(p, 3 << 20, 0, NULL);
    CHECK(umm_empty_cache(0) >= 0); /* unmaps and destroys */
    CHECK(cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == mine);
    /* With no context current at all, none is left current. */
    CHECK(cuCtxSetCurrent(NULL) == CUDA_SUCCESS);
    p = umm_alloc(1 << 20, 0, NULL);
    CHECK(p != NULL);
    umm_free(p, 1 << 20, 0, NULL);
    CHECK(cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == NULL);
    printf("context: restored after every call\n");

    CHECK(cuCtxSetCurrent(mine) == CUDA_SUCCESS);
    long sizes[] = {512, 1 << 20, 64 << 20};
    for (int s = 0; s < 3; s++) {
        const int n = 200000;
        double best = 1e30;
        for (int round = 0; round < 5; round++) {
            double t0 = now_ns();
            for (int i = 0; i < n; i++) {
                void *b = umm_alloc(sizes[s], 0, NULL);
                umm_free(b, sizes[s], 0, NULL);
            }
            double per = (now_ns() - t0) / n;
            if (per < best) best = per;
        }
        printf("alloc+free %ld bytes: %.1f ns per pair (best of 5 x %d)\n", sizes[s], best, n);
    }
    umm_empty_cache(0);
    cuCtxDestroy(mine);
    return 0;
}
