// Portable path: 16-byte generic vectors (SSE2 on x86-64, NEON on arm64, scalar code elsewhere).
#define MULTIMAX_ISA portable
#define MULTIMAX_ISA_NAME "portable"
#define MULTIMAX_VEC_BYTES 16
#include "rows.inc"
