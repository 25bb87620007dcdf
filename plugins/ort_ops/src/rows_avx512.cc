// AVX-512F path (built with -mavx512f -mfma; chosen at run time only on CPUs that have it).
#define MULTIMAX_ISA avx512
#define MULTIMAX_ISA_NAME "avx512"
#define MULTIMAX_VEC_BYTES 64
#include "rows.inc"
