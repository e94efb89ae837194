/* CHECK(cond) for the C test programs: on failure, prints the file, line and condition and returns 1 from main. */
#ifndef UMM_TEST_CHECK_H
#define UMM_TEST_CHECK_H

#include <stdio.h>

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            return 1;                                                                \
        }                                                                            \
    } while (0)

#endif
