// AVX-512 without VNNI (Skylake-X, Cascade Lake is VNNI): int16 dot products as vpmaddwd + vpaddd.
#define SERVELM_VNNI 0
#define SERVELM_NS avx512
#define SERVELM_FN gemm_avx512
#include "quant_avx512.inc"
