/* The C ABI through the header, compiled with `cc` by tests/c_header.rs. Exit code 0 on success. */
#include "check.h"
#include "umm.h"
#include <stdio.h>
#include <string.h>

int main(void) {
    int devices = umm_device_count();
    int missing = devices > 0 ? 4096 : 0;
    umm_clear_error();
    CHECK(umm_last_error() == NULL);

    CHECK(umm_alloc(1 << 20, missing, NULL) == NULL);
    CHECK(umm_last_error() != NULL && strstr(umm_last_error(), "no CUDA pool") != NULL);

    umm_clear_error();
    CHECK(umm_alloc(0, 0, NULL) == NULL);
    CHECK(strstr(umm_last_error(), "above zero") != NULL);

    umm_clear_error();
    umm_free((void *)0x1000, 16, 0, NULL);
    CHECK(strstr(umm_last_error(), "not allocated by umm") != NULL);

    CHECK(umm_stats_json(missing) == NULL);
    umm_string_free(NULL);
    CHECK(umm_empty_cache(missing) == -1);
    CHECK(umm_set_limit(missing, 1) == -1);
    CHECK(umm_trace_flush() == 0); /* without UMM_TRACE: nothing to write */

    if (devices > 0) {
        void *p = umm_alloc(4096, 0, NULL);
        CHECK(p != NULL);
        char *s = umm_stats_json(0);
        CHECK(s != NULL && strstr(s, "\"reserved_bytes\"") != NULL);
        umm_string_free(s);
        umm_free(p, 4096, 0, NULL);
    }
    printf("C ABI test passed (%d CUDA devices)\n", devices);
    return 0;
}
