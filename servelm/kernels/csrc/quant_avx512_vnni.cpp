// AVX-512 with VNNI: int16 dot products as vpdpwssd.
#define SERVELM_VNNI 1
#define SERVELM_NS avx512_vnni
#define SERVELM_FN gemm_avx512_vnni
#include "quant_avx512.inc"
