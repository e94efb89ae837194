/*
 * Instructions per cached allocate+free pair through the C ABI, on a simulated device (no GPU): the cost of the
 * registry, the live map and the pool's cache hit, counted by callgrind so that two builds compare exactly.
 *
 *   cargo build --release -p umm-capi
 *   cc -O2 capi/benches/sim_cost.c -o /tmp/sim_cost -L target/release -lumm_capi -Wl,-rpath,$PWD/target/release
 *   for n in 0 100000; do UMM_CAPI_SIM=16GiB valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$n /tmp/sim_cost $n; done
 *
 * (total at 100000 - total at 0) / 100000 is the cost of one pair; sizes cycle from 512 B to 48 MiB.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
void *umm_alloc(ssize_t size, int device, void *stream);
void umm_free(void *ptr, ssize_t size, int device, void *stream);
int main(int argc, char **argv) {
  long n = atol(argv[1]);
  ssize_t sizes[] = {512, 4096, 65536, 1 << 20, 3 << 20, 12 << 20, 48 << 20};
  for (int w = 0; w < 3; w++) for (int i = 0; i < 7; i++) { void *p = umm_alloc(sizes[i], 0, 0); umm_free(p, 0, 0, 0); }
  for (long i = 0; i < n; i++) { void *p = umm_alloc(sizes[i % 7], 0, 0); if (!p) return 1; umm_free(p, 0, 0, 0); }
  return 0;
}
