/* The race tests' one check: evaluated in every build (never compiled out
 * like assert), and a failure names the expression and its line. */
#ifndef PF_TEST_CHECK_H
#define PF_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>
#define CHECK(expr)                                                            \
  do {                                                                         \
    if (!(expr)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #expr); \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)
#endif
