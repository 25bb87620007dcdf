// AVX2 + FMA path (built with -mavx2 -mfma; chosen at run time only on CPUs that have both).
#define MULTIMAX_ISA avx2
#define MULTIMAX_ISA_NAME "avx2"
#define MULTIMAX_VEC_BYTES 32
#include "rows.inc"
