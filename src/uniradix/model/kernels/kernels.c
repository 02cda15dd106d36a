/* uniradix's row-invariant CPU kernels.

   The rule every function here keeps: an output element is computed by one fixed
   sequence of IEEE operations that depends only on its own inputs, never on how many
   rows come with it, where it falls in a vector, or how the work is split between
   threads. So a token's values are the same bits in a decode step, in a prefill chunk of
   any size, in a speculative verify chunk and in the no-cache forward; that is what keeps
   reuse exact in every precision.

   - Products (ur_linear_io): y[m, n] = sum_k x[m, k] * w[n, k] as one chain of fused
     multiply-adds in k order from 0, in float32, whatever the weight's dtype (float32,
     bfloat16, float16: converted exactly in registers, never into a float matrix). The
     weight is packed once into panels of 16 output columns, [panel][k][16] (bfloat16 in
     pairs of k, DT_BF16P, whose chain is VDPBF16PS's: each pair odd input first, denormals
     flushed; that instruction computes it where the CPU has AVX512-BF16); a vector lane
     holds one output column, so AVX-512, AVX2 and the scalar fallback give the same bits.
     bfloat16 x bfloat16 where the CPU has AMX: its bfloat16 tiles at every row count
     (linear_bf16_amx), their own rounding.
   - Elementwise functions (exp, sigmoid, silu, softplus, gelu_tanh, tanh) from basic IEEE
     operations only: the vector loop and its tail compute the same function.
   - Attention over keys where they lie in the pools, each query's scores, softmax and
     weighted sum in key order; bfloat16 queries over bfloat16 pools in VDPBF16PS's
     arithmetic, the weights rounded to bfloat16 (attend_block_pairs).
   - The recurrences (gated delta rule, Mamba2's selective scan) token by token.

   Built with -ffp-contract=off: the only fused operations are the ones written; the
   elementwise functions are branch-free, so their loops vectorise, and a vector lane
   and the scalar tail run the same operations. */
#define _GNU_SOURCE   /* syscall() under -std=c11 (asking Linux for AMX's tiles): GCC 14 refuses an undeclared call */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define UR_ISA "avx512, vnni, bf16"
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define UR_ISA "avx512, vnni"
#else
#define UR_ISA "avx512"
#endif
#define UR_AVX512 1
#if defined(__AVX512BF16__)
#define UR_BF16DP 1   /* bfloat16 pairs by VDPBF16PS (tile_pairs) */
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define UR_ISA "avx2"
#define UR_AVX2 1
#else
#define UR_ISA "scalar"
#endif

#define NR 16          /* output columns per packed panel */

/* DT_BF16P: bfloat16 panels in pairs, [K / 2][16][2] (inputs 2i and 2i + 1 of an output
   side by side: how AMX's bfloat16 tiles and VDPBF16PS read a weight); the others [K][16] */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_BF16P = 3 };

const char *ur_isa(void) { return UR_ISA; }
/* the arithmetic's version: raised when any kernel's bits change (2: quantized products sum
   each group in integers, one chain of groups; 3: paired bfloat16 panels in VDPBF16PS's
   order; 4: bfloat16 attention in VDPBF16PS's arithmetic, attend_block_pairs), so stored
   KV of another never meets this */
int ur_version(void) { return 4; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) {
            u = s;
        } else {  /* subnormal: normalise */
            e = 127 - 15 + 1;
            while (!(m & 0x400)) { m <<= 1; e--; }
            m &= 0x3ff;
            u = s | (e << 23) | (m << 13);
        }
    } else if (e == 31) {
        u = s | 0x7f800000u | (m << 13);
    } else {
        u = s | ((e + 127 - 15) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_elem(const void *p, int dt, int64_t i) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

static inline int64_t elem_size(int dt) { return dt == DT_F32 ? 4 : 2; }

/* Ask for bytes from p on before they are read (a decode step reads each weight and each
   key once, from memory: computing on one part while the next arrives keeps a kernel at
   the memory's speed; the hardware's own prefetch stops at every 4 KiB page). No
   arithmetic changes. */
static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* ------------------------------------------------------------------------ products */

/* One panel row (16 weights of k) as float32 vectors. */
#if defined(UR_AVX512)
typedef __m512 wvec;
static inline wvec wload(const void *p, int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
/* Row k of a paired panel: base is the pair's (row k & ~1), odd = k & 1. */
static inline wvec wload_pair(const void *base, int odd) {
    const __m512i v = _mm512_loadu_si512(base);
    return _mm512_castsi512_ps(odd ? _mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)) : _mm512_slli_epi32(v, 16));
}
#define WV_ZERO() _mm512_setzero_ps()
#define WV_FMA(a, b, c) _mm512_fmadd_ps(_mm512_set1_ps(a), (b), (c))
#define WV_ADD(a, b) _mm512_add_ps((a), (b))
static inline void wstore(float *y, wvec v, int n) {
    if (n == NR) { _mm512_storeu_ps(y, v); return; }
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v);
}
static inline wvec wloadf(const float *p, int n) {
    if (n == NR) return _mm512_loadu_ps(p);
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
#elif defined(UR_AVX2)
typedef struct { __m256 lo, hi; } wvec;
static inline __m256 h8(const uint16_t *p, int dt) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
static inline wvec wload(const void *p, int dt) {
    wvec v;
    if (dt == DT_F32) {
        v.lo = _mm256_loadu_ps((const float *)p);
        v.hi = _mm256_loadu_ps((const float *)p + 8);
    } else {
        v.lo = h8((const uint16_t *)p, dt);
        v.hi = h8((const uint16_t *)p + 8, dt);
    }
    return v;
}
static inline __m256 pair8(const void *p, int odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_castsi256_ps(odd ? _mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)) : _mm256_slli_epi32(v, 16));
}
static inline wvec wload_pair(const void *base, int odd) {
    wvec v = {pair8(base, odd), pair8((const char *)base + 32, odd)};
    return v;
}
static inline wvec WV_ZERO(void) { wvec v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
static inline wvec WV_FMA(float a, wvec b, wvec c) {
    __m256 s = _mm256_set1_ps(a);
    wvec v = {_mm256_fmadd_ps(s, b.lo, c.lo), _mm256_fmadd_ps(s, b.hi, c.hi)};
    return v;
}
static inline wvec WV_ADD(wvec a, wvec b) {
    wvec v = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
    return v;
}
static inline void wstore(float *y, wvec v, int n) {
    if (n == NR) { _mm256_storeu_ps(y, v.lo); _mm256_storeu_ps(y + 8, v.hi); return; }
    float t[NR];
    _mm256_storeu_ps(t, v.lo);
    _mm256_storeu_ps(t + 8, v.hi);
    memcpy(y, t, sizeof(float) * n);
}
static inline wvec wloadf(const float *p, int n) {
    if (n == NR) { wvec v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return v; }
    float t[NR] = {0};
    memcpy(t, p, sizeof(float) * n);
    wvec v = {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)};
    return v;
}
#else
typedef struct { float v[NR]; } wvec;
static inline wvec wload(const void *p, int dt) {
    wvec v;
    for (int i = 0; i < NR; i++) v.v[i] = load_elem(p, dt, i);
    return v;
}
static inline wvec wload_pair(const void *base, int odd) {
    wvec v;
    for (int i = 0; i < NR; i++) v.v[i] = bf16_to_f32(((const uint16_t *)base)[2 * i + odd]);
    return v;
}
static inline wvec WV_ZERO(void) { wvec v; for (int i = 0; i < NR; i++) v.v[i] = 0.0f; return v; }
static inline wvec WV_FMA(float a, wvec b, wvec c) {
    wvec v;
    for (int i = 0; i < NR; i++) v.v[i] = fmaf(a, b.v[i], c.v[i]);
    return v;
}
static inline wvec WV_ADD(wvec a, wvec b) { wvec v; for (int i = 0; i < NR; i++) v.v[i] = a.v[i] + b.v[i]; return v; }
static inline void wstore(float *y, wvec v, int n) { memcpy(y, v.v, sizeof(float) * n); }
static inline wvec wloadf(const float *p, int n) {
    wvec v = WV_ZERO();
    memcpy(v.v, p, sizeof(float) * n);
    return v;
}
#endif

/* The rows of the pass that starts at row m of M over a block of weights: the first
   pass, which reads the block in from memory, takes `first` rows, the rest go in passes
   of even size over it in cache (17 rows, first 8: 8, 5, 4, where 8, 8, 1 left a last
   pass of one row waiting on its chains) */
static inline int64_t pass_rows(int64_t m, int64_t M, int64_t first) {
    const int64_t rest = M - m, passes = (rest + first - 1) / first;
    return m == 0 ? (rest < first ? rest : first) : (rest + passes - 1) / passes;
}

/* MR rows x NP panels over k in [k0, k1): the accumulators start from zero (k0 == 0) or
   from y, where the previous k block left them: the chain continues, in k order. */
#define KBLOCK 768   /* the longest k block: K in blocks of even and equal length up to it */
#define MR_BULK 6
#if defined(UR_AVX512)
#define NP_BULK 4   /* 6 rows x 4 panels: 24 sums in registers, each weight line read once for 6
                       rows and each input once for 4 panels (8 x 2 ran float32 products at 70%
                       of the FMA's peak on Zen 4, this at 90-95%; bfloat16 the same) */
#else
#define NP_BULK 1
#endif
#define NP_ONE 4   /* a few rows: this many panels at a time, for independent chains */
#if defined(UR_AVX512)
#define MR_ONE 4   /* rows that take NP_ONE panels at a time (their sums fit the registers) */
#else
#define MR_ONE 1
#endif

/* A paired bfloat16 panel's chain (DT_BF16P) is VDPBF16PS's arithmetic, so that the
   instruction computes it where the CPU has AVX512-BF16 (tile_pairs) and every other
   path gives the same bits: per pair of inputs, the odd one's product first, then the
   even one's, each a fused multiply-add rounded to nearest even, denormal inputs read as
   zero and denormal sums flushed to zero (DAZ, FTZ). Elsewhere the chain runs with the
   floating-point mode set so for its duration (x86; another CPU keeps denormals). */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
static inline unsigned pair_mode_on(void) {
    const unsigned was = _mm_getcsr();
    _mm_setcsr(was | 0x8040u);   /* FTZ (bit 15) and DAZ (bit 6) */
    return was;
}
static inline void pair_mode_off(unsigned was) { _mm_setcsr(was); }
#else
static inline unsigned pair_mode_on(void) { return 0; }
static inline void pair_mode_off(unsigned was) { (void)was; }
#endif

/* The accumulators of a tile (plus the bias once the chain is complete) into y. */
static inline __attribute__((always_inline)) void tile_store(
    int MR, int NP, wvec acc[8][4], const int *ncol, int64_t p0, float *y, int64_t ldy, int last, const float *bias) {
    for (int j = 0; j < NP; j++) {
        if (last && bias != NULL) {
            wvec b = wloadf(bias + (p0 + j) * NR, ncol[j]);
            for (int r = 0; r < MR; r++) acc[r][j] = WV_ADD(acc[r][j], b);
        }
        for (int r = 0; r < MR; r++) wstore(y + r * ldy + (p0 + j) * NR, acc[r][j], ncol[j]);
    }
}

static inline __attribute__((always_inline)) void tile(
    int MR, int NP, const float *x, int64_t ldx, const char *wp, int dt, int64_t K, int64_t p0,
    int64_t N, float *y, int64_t ldy, int64_t k0, int64_t k1, const float *bias, const char *pf) {
    wvec acc[8][4];
    const int64_t ps = K * NR * elem_size(dt);      /* bytes per panel */
    const int64_t es = elem_size(dt) * NR;          /* bytes per k in a panel */
    int ncol[4];
    for (int j = 0; j < NP; j++) {
        int64_t c = N - (p0 + j) * NR;
        ncol[j] = c >= NR ? NR : (int)c;
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NP; j++)
            acc[r][j] = k0 == 0 ? WV_ZERO() : wloadf(y + r * ldy + (p0 + j) * NR, ncol[j]);
    const char *w0 = wp + p0 * ps + k0 * es;
    if (dt == DT_BF16P) {   /* k0 and k1 even: a pair's line, its odd input, then its even one */
        const unsigned mode = pair_mode_on();
        for (int64_t k = k0; k < k1; k += 2, w0 += 2 * es) {
            wvec w[4], u[4];
            if (pf) for (int j = 0; j < NP; j++) __builtin_prefetch(pf + j * ps + (k - k0) * es, 0, 2);
            for (int j = 0; j < NP; j++) w[j] = wload_pair(w0 + j * ps, 0), u[j] = wload_pair(w0 + j * ps, 1);
            for (int r = 0; r < MR; r++)
                for (int j = 0; j < NP; j++) acc[r][j] = WV_FMA(x[r * ldx + k + 1], u[j], acc[r][j]);
            for (int r = 0; r < MR; r++)
                for (int j = 0; j < NP; j++) acc[r][j] = WV_FMA(x[r * ldx + k], w[j], acc[r][j]);
        }
        pair_mode_off(mode);
    } else {
        for (int64_t k = k0; k < k1; k++, w0 += es) {
            if (pf) for (int j = 0; j < NP; j++) __builtin_prefetch(pf + j * ps + (k - k0) * es, 0, 2);
            for (int j = 0; j < NP; j++) {
                wvec w = wload(w0 + j * ps, dt);
                for (int r = 0; r < MR; r++)
                    acc[r][j] = WV_FMA(x[r * ldx + k], w, acc[r][j]);
            }
        }
    }
    tile_store(MR, NP, acc, ncol, p0, y, ldy, k1 == K, bias);
}

#if defined(UR_BF16DP)
/* tile() for bfloat16 rows against a paired bfloat16 panel, by VDPBF16PS: a pair of
   inputs a step, broadcast, against a panel's line of 16 outputs x 2 inputs (the same
   chain as tile's DT_BF16P, computed by the instruction). x: the rows' pairs interleaved
   (pack_pairs), row r's pair i at x[i * MR_BULK + r], so every row is one offset from
   one pointer. */
static inline __attribute__((always_inline)) void tile_pairs(
    int MR, int NP, const int32_t *x, const char *wp, int64_t K, int64_t p0,
    int64_t N, float *y, int64_t ldy, int64_t k0, int64_t k1, const float *bias, const char *pf) {
    wvec acc[8][4];
    const int64_t ps = K * NR * 2;   /* bytes per panel */
    int ncol[4];
    for (int j = 0; j < NP; j++) {
        int64_t c = N - (p0 + j) * NR;
        ncol[j] = c >= NR ? NR : (int)c;
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NP; j++)
            acc[r][j] = k0 == 0 ? WV_ZERO() : wloadf(y + r * ldy + (p0 + j) * NR, ncol[j]);
    const char *w0 = wp + p0 * ps + k0 * NR * 2;
    for (int64_t k = k0; k < k1; k += 2, w0 += 2 * NR * 2) {
        __m512i w[4];
        if (pf) for (int j = 0; j < NP; j++) __builtin_prefetch(pf + j * ps + (k - k0) * NR * 2, 0, 2);
        for (int j = 0; j < NP; j++) w[j] = _mm512_loadu_si512(w0 + j * ps);
        for (int r = 0; r < MR; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(x[k * (MR_BULK / 2) + r]);
            for (int j = 0; j < NP; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)w[j], b);
        }
    }
    tile_store(MR, NP, acc, ncol, p0, y, ldy, k1 == K, bias);
}
#endif


/* Row m of x: float32 rows (xdt DT_F32, row stride ldx), or bfloat16 ones as pack_pairs
   lays them out (DT_BF16: blocks of MR_BULK rows, K / 2 pairs a row, interleaved) */
static inline const void *x_row(const void *x, int xdt, int64_t m, int64_t ldx, int64_t K) {
    if (xdt == DT_F32) return (const float *)x + m * ldx;
    return (const int32_t *)x + m / MR_BULK * (K / 2) * MR_BULK + m % MR_BULK;
}

/* the tiles for one weight dtype and one x dtype (constants here, so the inner loop has
   no branch): x float32 for tile(), bfloat16 for tile_pairs() */
static inline __attribute__((always_inline)) void tile_rows_dt(
    int mr, int np, const void *x, const int xdt, int64_t ldx, const char *wp, const int dt, int64_t K, int64_t p0,
    int64_t N, float *y, int64_t ldy, int64_t k0, int64_t k1, const float *b, const char *pf) {
#if defined(UR_BF16DP)
#define T(R, P) do {                                                                                   \
        if (xdt == DT_BF16) tile_pairs(R, P, (const int32_t *)x, wp, K, p0, N, y, ldy, k0, k1, b, pf);   \
        else tile(R, P, (const float *)x, ldx, wp, dt, K, p0, N, y, ldy, k0, k1, b, pf);                \
    } while (0)
#define T1(X, P0, Y) do {                                                                              \
        if (xdt == DT_BF16) tile_pairs(1, 1, (const int32_t *)(X), wp, K, P0, N, Y, ldy, k0, k1, b, NULL); \
        else tile(1, 1, (const float *)(X), ldx, wp, dt, K, P0, N, Y, ldy, k0, k1, b, NULL);            \
    } while (0)
#else
#define T(R, P) tile(R, P, (const float *)x, ldx, wp, dt, K, p0, N, y, ldy, k0, k1, b, pf)
#define T1(X, P0, Y) tile(1, 1, (const float *)(X), ldx, wp, dt, K, P0, N, Y, ldy, k0, k1, b, NULL)
#endif
    if (np == NP_BULK) {
        switch (mr) {
        case 1: T(1, NP_BULK); return;
        case 2: T(2, NP_BULK); return;
        case 3: T(3, NP_BULK); return;
        case 4: T(4, NP_BULK); return;
        case 5: T(5, NP_BULK); return;
        case 6: T(6, NP_BULK); return;
        }
    }
    if (np == NP_ONE) {
        switch (mr) {
        case 1: T(1, NP_ONE); return;
#if defined(UR_AVX512)
        case 2: T(2, NP_ONE); return;
        case 3: T(3, NP_ONE); return;
        case 4: T(4, NP_ONE); return;
#endif
        }
    }
    for (int j = 0; j < np; j++)
        for (int r = 0; r < mr; r++) T1(x_row(x, xdt, r, ldx, K), p0 + j, y + r * ldy);
#undef T
#undef T1
}

static void tile_rows(int mr, int np, const void *x, int xdt, int64_t ldx, const char *wp, int dt, int64_t K,
                      int64_t p0, int64_t N, float *y, int64_t ldy, int64_t k0, int64_t k1, const float *b,
                      const char *pf) {
#if defined(UR_BF16DP)
    if (xdt == DT_BF16) { tile_rows_dt(mr, np, x, DT_BF16, ldx, wp, DT_BF16P, K, p0, N, y, ldy, k0, k1, b, pf); return; }
#endif
    if (dt == DT_F32) tile_rows_dt(mr, np, x, DT_F32, ldx, wp, DT_F32, K, p0, N, y, ldy, k0, k1, b, pf);
    else if (dt == DT_BF16) tile_rows_dt(mr, np, x, DT_F32, ldx, wp, DT_BF16, K, p0, N, y, ldy, k0, k1, b, pf);
    else if (dt == DT_BF16P) tile_rows_dt(mr, np, x, DT_F32, ldx, wp, DT_BF16P, K, p0, N, y, ldy, k0, k1, b, pf);
    else tile_rows_dt(mr, np, x, DT_F32, ldx, wp, DT_F16, K, p0, N, y, ldy, k0, k1, b, pf);
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T (+ bias [N]), W packed as
   ceil(N / 16) panels [K][16] of dtype dt; x float32, or bfloat16 where tile_pairs takes
   it (paired weights, AVX512-BF16). */
static void product(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx, const void *wp, int dt, int64_t N,
                    const float *bias, float *y, int64_t ldy, int nt) {
    const int64_t P = (N + NR - 1) / NR;
    if (M <= 0 || N <= 0) return;
    if (K == 0) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? 0.0f + bias[n] : 0.0f;
        return;
    }
    const int64_t kb = NR * elem_size(dt), ps = K * kb;   /* bytes per k in a panel, per panel */
    if (M < MR_BULK) {
        /* few rows (decode): split the panels between threads, each reading its panels once */
        const int64_t groups = (P + NP_ONE - 1) / NP_ONE;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && groups > 1)
        for (int64_t g = 0; g < groups; g++) {
            int64_t p0 = g * NP_ONE;
            int np = P - p0 >= NP_ONE ? NP_ONE : (int)(P - p0);
            /* the next group's panels asked for while these are read (1.2-1.4x faster
               at 5-7 rows from memory, the same at 1-4, measured on Zen 4) */
            const char *pf = g + 1 < groups ? (const char *)wp + (p0 + NP_ONE) * ps : NULL;
            if (M <= MR_ONE) {
                tile_rows((int)M, np, x, xdt, ldx, (const char *)wp, dt, K, p0, N, y, ldy, 0, K, bias, pf);
            } else {
                for (int64_t pp = p0; pp < p0 + np; pp += NP_BULK) {
                    int q = p0 + np - pp >= NP_BULK ? NP_BULK : (int)(p0 + np - pp);
                    tile_rows((int)M, q, x, xdt, ldx, (const char *)wp, dt, K, pp, N, y, ldy, 0, K, bias,
                              pf ? pf + (pp - p0) * ps : NULL);
                }
            }
        }
        return;
    }
    /* many rows: tiles of MC rows x NP_BULK panels; within a tile, k in blocks so the
       panel block stays in cache while the rows pass over it, as few as KBLOCK allows and
       of equal length (640: one block, 1024: two of 512, 2048: three of 684), where blocks
       of 512 left 640's a tail of 128 (a tile's sums stored and loaded again for it: Gemma
       3 270M's products 1.5-2.5% slower at 17 and 256 rows, float32 and bfloat16, Zen 4) */
    const int64_t MC = 96;
    const int64_t kblocks = (K + KBLOCK - 1) / KBLOCK, kl = ((K + kblocks - 1) / kblocks + 1) / 2 * 2;
    const int64_t rblocks = (M + MC - 1) / MC, pgroups = (P + NP_BULK - 1) / NP_BULK;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t rb = 0; rb < rblocks; rb++) {
        for (int64_t g = 0; g < pgroups; g++) {
            int64_t m0 = rb * MC, m1 = m0 + MC < M ? m0 + MC : M;
            int64_t p0 = g * NP_BULK;
            int np = P - p0 >= NP_BULK ? NP_BULK : (int)(P - p0);
            for (int64_t k0 = 0; k0 < K; k0 += kl) {
                int64_t k1 = k0 + kl < K ? k0 + kl : K;
                /* every row tile asks for the next panel group's same k block while it
                   reads this one's (the rows' tiles compute for longer than memory takes
                   to deliver it; asked by the first tile alone, the requests it could not
                   keep in flight were not asked again: at 8 / 17 rows from memory 1.2x /
                   1.1x slower, measured on Zen 4; a line already on its way costs one
                   more request) */
                const char *pf = g + 1 < pgroups ? (const char *)wp + (p0 + NP_BULK) * ps + k0 * kb : NULL;
                for (int64_t m = m0; m < m1; m += MR_BULK) {
                    int mr = m1 - m >= MR_BULK ? MR_BULK : (int)(m1 - m);
                    tile_rows(mr, np, x_row(x, xdt, m, ldx, K), xdt, ldx, (const char *)wp, dt, K, p0, N, y + m * ldy,
                              ldy, k0, k1, bias, pf);
                }
            }
        }
    }
}

/* n values of dtype dt at src as float32 at dst (16-bit ones convert exactly). */
static void to_f32(const void *src, int dt, float *dst, int64_t n) {
    if (dt == DT_F32) { memcpy(dst, src, sizeof(float) * (size_t)n); return; }
    int64_t i = 0;
#if defined(UR_AVX512)
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
        _mm512_storeu_ps(dst + i, dt == DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                                : _mm512_cvtph_ps(h));
    }
#elif defined(UR_AVX2)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
        _mm256_storeu_ps(dst + i, dt == DT_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                                : _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; i++) dst[i] = load_elem(src, dt, i);
}

/* Rows of x in dtype xdt (row stride ldx) as contiguous float32 [M, K]: x itself where
   it is that already, else a copy to free (16-bit values convert exactly). */
static const float *rows_f32(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx, int64_t *ld, float **owned) {
    *owned = NULL;
    if (xdt == DT_F32) { *ld = ldx; return (const float *)x; }
    float *f = (float *)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    for (int64_t m = 0; m < M; m++) to_f32((const uint16_t *)x + m * ldx, xdt, f + m * K, K);
    *ld = K;
    *owned = f;
    return f;
}

/* float32 to bfloat16, rounded to nearest even as torch rounds (a NaN stays a NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(UR_AVX512)
/* f32_to_bf16 of 16 floats at once (the same bits: nearest even, a NaN kept a NaN) */
static inline __m256i bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* rows [M, N] of float32 (row stride lds) to bfloat16 (row stride ldd), each f32_to_bf16 */
static void rows_to_bf16(const float *src, int64_t lds, uint16_t *dst, int64_t ldd, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; m++) {
        int64_t n = 0;
#if defined(UR_AVX512)
        for (; n + 16 <= N; n += 16)
            _mm256_storeu_si256((__m256i *)(dst + m * ldd + n), bf16x16(_mm512_loadu_ps(src + m * lds + n)));
#endif
        for (; n < N; n++) dst[m * ldd + n] = f32_to_bf16(src[m * lds + n]);
    }
}

/* float32 rounded to bfloat16 and back (f32_to_bf16's rounding), 16 at a time */
#if defined(UR_AVX512)
static inline __m512 bf16r16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(v)), 16));
}
static inline __m512 bf16load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* y = res + bfloat16(t), each rounded to bfloat16 as torch's add rounds (res, y bfloat16) */
static void add_rows_bf16(const uint16_t *res, const float *t, uint16_t *y, int64_t n) {
    int64_t i = 0;
#if defined(UR_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i), bf16x16(_mm512_add_ps(bf16load16(res + i), bf16r16(_mm512_loadu_ps(t + i)))));
#endif
    for (; i < n; i++) y[i] = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(f32_to_bf16(t[i])));
}

/* ur_linear with x in any of the three dtypes (row stride ldx) and y in float32 or
   bfloat16 (ydt): the conversions inside the one call, the product the same. */
int ur_amx_bf16(int64_t K);
void linear_bf16_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N,
                     const float *bias, void *y, int ydt, int64_t ldy, int nt);

/* Whether a bfloat16 x bfloat16 product takes AMX's tiles (ur_amx_bf16): decided by the
   operands' dtypes and K, never by the row count, so a row gets the same bits alone or
   in any chunk. */
static inline int amx_bf16_product(int xdt, int dt, int64_t K) {
    return xdt == DT_BF16 && dt == DT_BF16P && ur_amx_bf16(K);
}

#if defined(UR_BF16DP)
/* bfloat16 rows [M, K] (row stride ldx, K even) as tile_pairs reads them: blocks of
   MR_BULK rows, each row's pair i (inputs 2i, 2i + 1, one int32) at i * MR_BULK + r */
static int32_t *pack_pairs(const uint16_t *x, int64_t M, int64_t K, int64_t ldx) {
    const int64_t h = K / 2, blocks = (M + MR_BULK - 1) / MR_BULK;
    int32_t *xp = (int32_t *)malloc(sizeof(int32_t) * (size_t)(blocks * h * MR_BULK));
    for (int64_t m = 0; m < M; m++) {
        int32_t *d = xp + m / MR_BULK * h * MR_BULK + m % MR_BULK;
        const uint16_t *s = x + m * ldx;
        for (int64_t i = 0; i < h; i++) memcpy(d + i * MR_BULK, s + 2 * i, 4);
    }
    return xp;
}
#endif

/* y (float32) = the product on the vector path, x in any of the three dtypes */
static void vector_product(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx, const void *wp, int dt,
                           int64_t N, const float *bias, float *y, int64_t ldy, int nt) {
#if defined(UR_BF16DP)
    if (xdt == DT_BF16 && dt == DT_BF16P) {   /* by VDPBF16PS */
        int32_t *xp = pack_pairs((const uint16_t *)x, M, K, ldx);
        product(xp, DT_BF16, M, K, 0, wp, dt, N, bias, y, ldy, nt);
        free(xp);
        return;
    }
#endif
    float *owned;
    int64_t lx;
    const float *xf = rows_f32(x, xdt, M, K, ldx, &lx, &owned);
    product(xf, DT_F32, M, K, lx, wp, dt, N, bias, y, ldy, nt);
    free(owned);
}

void ur_linear_io(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx, const void *wp, int dt, int64_t N,
                  const float *bias, void *y, int ydt, int64_t ldy, int nt) {
    if (amx_bf16_product(xdt, dt, K)) {   /* the output written as it comes */
        linear_bf16_amx((const uint16_t *)x, M, K, ldx, (const uint16_t *)wp, N, bias, y, ydt, ldy, nt);
        return;
    }
    float *tmp = NULL;
    if (ydt == DT_F32) {
        vector_product(x, xdt, M, K, ldx, wp, dt, N, bias, (float *)y, ldy, nt);
    } else {
        tmp = (float *)malloc(sizeof(float) * (size_t)(M * N > 0 ? M * N : 1));
        vector_product(x, xdt, M, K, ldx, wp, dt, N, bias, tmp, N, nt);
        rows_to_bf16(tmp, N, (uint16_t *)y, ldy, M, N);
    }
    free(tmp);
}

/* ------------------------------------------------------------------------ quantized products */

/* Weights as a GGUF file stores them (kernels.PackedQuant), multiplied as llama.cpp
   does: the activations rounded to 8 bits per block of 32, integer dot products with the
   codes, the scales applied in float32.

   A weight row's codes u in blocks of 32 inputs (8 bits: signed; 4, 5, 6: unsigned) and,
   per group of G inputs (32, or 16 for Q6_K), a scale a and, where the format has one, c:
   the weight is w = a * u + c (gguf_blocks: c = b - a off).

   A row x of the activations is quantised once per call, per block b of 32: d_b =
   max|x| / 127, q_i = nearest(x_i * 127 / max|x|), and per group the sum of its q times
   d_b. Then, for each output, one chain in group order:
       acc = fma(float(sum of the group's u q, in integers), a_g * d_b, acc)
   plus sum_g c_g (d_b sum(q))_g (one chain of fmas in group order), plus the bias. The
   group's integer sum is exact however it is formed (four products at a time by VNNI's
   dpbusd or AVX2's maddubs, sixteen rows of a tile at once by AMX), so every path, every
   row count and every thread count gives the same bits.

   Packed layout (kernels.PackedQuant): panels of QP = 16 weight rows; a panel's block b
   (16 rows x 32 inputs) lies as eight groups of four inputs, group g a line of 64 bytes,
   [row j][input 4g + i]: exactly an AMX B tile's rows and one AVX-512 vector, a lane per
   weight row. Bytes per panel block: 8 and 6 bits: 512 (a code a byte); 4 bits: 256
   (line g's codes in the low nibbles of line g % 4, for g >= 4 in the high ones); 5 bits:
   those 256, then per group a 64-bit word whose bit 4j + i is that code's fifth bit. The
   scales a (and c) lie [panel][group][16]. */
#define QP 16   /* weight rows a panel holds (kernels.PackedQuant's PW) */
#define QCHUNK_BYTES (256 << 10)   /* codes a chunk of panels holds (ur_linear_q) */
static inline int64_t qblock_bytes(int bits) { return bits == 4 ? 16 : bits == 5 ? 20 : 32; }  /* a row's, per block */
static inline int64_t qpanel_block(int bits) { return QP * qblock_bytes(bits); }

/* x [K] -> q [K] int8, d [K / 32] per block, s [K / G] the group sums of q times d, o
   [K / G] the group sums of q times -128 (the offset of VNNI's unsigned reading of 8-bit
   codes). */
static void quantize_row(const float *x, int64_t K, int64_t G, int8_t *q, float *d, float *s, int32_t *o) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
#if defined(UR_AVX512) || defined(UR_AVX2)
        /* x * inv rounded to the nearest integer, ties to even (nearbyintf's rounding, in
           the vector unit: the library call cost more than the products), then clamped */
        for (int i = 0; i < 32; i += 8) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), _mm256_set1_ps(inv)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
            const __m256i w = _mm256_cvtps_epi32(r);   /* integers already: exact */
            const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storel_epi64((__m128i *)(q + b * 32 + i), _mm_packs_epi16(h, h));
        }
#else
        for (int i = 0; i < 32; i++) {
            float r = nearbyintf(xb[i] * inv);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[b * 32 + i] = (int8_t)r;
        }
#endif
    }
    for (int64_t g = 0; g < K / G; g++) {
        int sum = 0;
        for (int64_t i = 0; i < G; i++) sum += q[g * G + i];
        s[g] = (float)sum * d[(g * G) / 32];
        o[g] = -128 * sum;
    }
}

/* code k (0 .. 31) of weight row j in a panel block, as the integer it stands for */
static inline int qcode_at(const uint8_t *pb, int bits, int j, int k) {
    const int g = k / 4, i = k % 4;
    if (bits == 8) return (int8_t)pb[g * 64 + j * 4 + i];
    if (bits == 6) return pb[g * 64 + j * 4 + i];
    int u = (pb[(g & 3) * 64 + j * 4 + i] >> (g >= 4 ? 4 : 0)) & 0x0F;
    if (bits == 5) u |= (int)((pb[256 + g * 8 + (j * 4 + i) / 8] >> ((j * 4 + i) % 8)) & 1) << 4;
    return u;
}

/* A panel's outputs for one activation row, from its accumulated group sums: plus
   sum_g c_g s_g (c NULL: none), plus the bias, stored (the first nw of the 16). Lane by
   lane the same operations in every path. */
static inline void qfinish(float *v, const float *c, const float *sr, int64_t ng, const float *bias, int64_t n0,
                           int nw, float *y) {
    if (c) {
        float cs[QP] = {0.0f};
        for (int64_t g = 0; g < ng; g++)
            for (int j = 0; j < QP; j++) cs[j] = fmaf(c[g * QP + j], sr[g], cs[j]);
        for (int j = 0; j < QP; j++) v[j] += cs[j];
    }
    for (int j = 0; j < nw; j++) y[n0 + j] = bias ? v[j] + bias[n0 + j] : v[j];
}

#if defined(UR_AVX512) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
#define Q8_OFFSET 1   /* 8-bit codes read as u + 128 (dpbusd's unsigned operand), the group's sum started at o */
#else
#define Q8_OFFSET 0
#endif
#define QROWS 8   /* activation rows a pass over a panel's codes takes */

/* qfinish's c term added to rows [0, mr) of acc (each acc[r] + the chain of fmas of c_g
   and row r's group sums, in group order: qfinish's arithmetic), up to four rows' chains
   side by side in registers (one row's chain after another's cost a third of an AMX
   product's time; qpanel_amx_g writes the same out). */
static inline __attribute__((always_inline)) void qterm_c(__m512 *acc, const int mr, const float *c, const float *s,
                                                          int64_t ng) {
    for (int r0 = 0; r0 < mr; r0 += 4) {
        const int rn = mr - r0 < 4 ? mr - r0 : 4;
        __m512 cs[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t g = 0; g < ng; g++) {
            const __m512 cg = _mm512_loadu_ps(c + g * QP);
            for (int r = 0; r < rn; r++) cs[r] = _mm512_fmadd_ps(cg, _mm512_set1_ps(s[(r0 + r) * ng + g]), cs[r]);
        }
        for (int r = 0; r < rn; r++) acc[r0 + r] = _mm512_add_ps(acc[r0 + r], cs[r]);
    }
}

/* Line g of a panel block: 16 weight rows x 4 codes, a lane a row (8 bits with VNNI: xor 0x80). */
static inline __m512i qline(const uint8_t *pb, int g, const int bits) {
    if (bits == 8 || bits == 6) {
        __m512i v = _mm512_loadu_si512((const void *)(pb + g * 64));
        return bits == 8 && Q8_OFFSET ? _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)) : v;
    }
    __m512i v = _mm512_loadu_si512((const void *)(pb + (g & 3) * 64));
    if (g >= 4) v = _mm512_srli_epi16(v, 4);
    v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    if (bits == 5) {
        uint64_t h;
        memcpy(&h, pb + 256 + g * 8, 8);
        v = _mm512_or_si512(v, _mm512_maskz_mov_epi8((__mmask64)h, _mm512_set1_epi8(0x10)));
    }
    return v;
}

/* s + each lane's four codes u times the four activations q4 (one int32, broadcast) */
static inline __m512i qdot(__m512i s, __m512i u, int32_t q4, const int bits) {
    __m512i q = _mm512_set1_epi32(q4);
#if Q8_OFFSET
    (void)bits;
    return _mm512_dpbusd_epi32(s, u, q);
#else
    if (bits == 8) {  /* |u| times q with u's sign: u q exactly (a pair at most 2 * 128 * 127) */
        q = _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(u), _mm512_setzero_si512(), q);
        u = _mm512_abs_epi8(u);
    }
    return _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1)));
#endif
}

static inline __m512 qscale(const float *a, float d) { return _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_set1_ps(d)); }

/* Rows [0, mr) of the quantised activations against one panel (pc: its codes, a and c its
   scales), outputs n0 .. n0 + nw. nxt: the next panel's codes, read ahead (NULL: none). */
static inline __attribute__((always_inline)) void qpanel_bg(
        const int bits, const int64_t G, const int mr, const int8_t *q, const float *d, const float *s,
        const int32_t *o, int64_t K, const uint8_t *pc, const uint8_t *nxt, const float *a, const float *c,
        const float *bias, int64_t n0, int nw, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ng = K / G, pbb = qpanel_block(bits);
    __m512 acc[QROWS];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = pc + b * pbb;
        if (nxt) prefetch_row((const char *)(nxt + b * pbb), pbb);
        __m512i s0[QROWS];
        for (int r = 0; r < mr; r++)
            s0[r] = bits == 8 && Q8_OFFSET ? _mm512_set1_epi32(o[r * ng + b * 32 / G]) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m512i u = qline(pb, g, bits);
            for (int r = 0; r < mr; r++) {
                int32_t q4;
                memcpy(&q4, q + r * K + b * 32 + g * 4, 4);
                s0[r] = qdot(s0[r], u, q4, bits);
            }
            if (G == 16 && g == 3) {  /* the block's first group of 16 */
                for (int r = 0; r < mr; r++) {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]),
                                             qscale(a + 2 * b * QP, d[r * nb + b]), acc[r]);
                    s0[r] = bits == 8 && Q8_OFFSET ? _mm512_set1_epi32(o[r * ng + 2 * b + 1]) : _mm512_setzero_si512();
                }
            }
        }
        const float *ab = a + (G == 16 ? 2 * b + 1 : b) * QP;
        for (int r = 0; r < mr; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), qscale(ab, d[r * nb + b]), acc[r]);
    }
    if (c) qterm_c(acc, mr, c, s, ng);
    for (int r = 0; r < mr; r++) {
        __m512 v = acc[r];
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps((__mmask16)((1u << nw) - 1), bias + n0));
        _mm512_mask_storeu_ps(y + r * ldy + n0, (__mmask16)((1u << nw) - 1), v);
    }
}

#elif defined(UR_AVX2)
#define Q8_OFFSET 0
#define QROWS 2

/* Line g of a panel block, the half h's 8 weight rows x 4 codes (a lane a row). */
static inline __m256i qline(const uint8_t *pb, int g, int h, const int bits) {
    if (bits == 8 || bits == 6) return _mm256_loadu_si256((const __m256i *)(pb + g * 64 + h * 32));
    __m256i v = _mm256_loadu_si256((const __m256i *)(pb + (g & 3) * 64 + h * 32));
    if (g >= 4) v = _mm256_srli_epi16(v, 4);
    v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    if (bits == 5) {  /* the word's 32 bits of this half, bit t to byte t's 0x10 */
        uint32_t w;
        memcpy(&w, pb + 256 + g * 8 + h * 4, 4);
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        __m256i hb = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)w), spread), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(hb, bit), _mm256_set1_epi8(0x10)));
    }
    return v;
}

static inline __m256i qdot(__m256i s, __m256i u, int32_t q4, const int bits) {
    __m256i q = _mm256_set1_epi32(q4), p;
    if (bits == 8) p = _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u));
    else p = _mm256_maddubs_epi16(u, q);
    return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

static inline __m256 qscale(const float *a, float d) { return _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_set1_ps(d)); }

static inline __attribute__((always_inline)) void qpanel_bg(
        const int bits, const int64_t G, const int mr, const int8_t *q, const float *d, const float *s,
        const int32_t *o, int64_t K, const uint8_t *pc, const uint8_t *nxt, const float *a, const float *c,
        const float *bias, int64_t n0, int nw, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ng = K / G, pbb = qpanel_block(bits);
    (void)o;
    float v[QROWS][QP];
    for (int h = 0; h < 2; h++) {
        __m256 acc[QROWS];
        for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pb = pc + b * pbb;
            if (nxt && h == 0) prefetch_row((const char *)(nxt + b * pbb), pbb);
            __m256i s0[QROWS], s1[QROWS];
            for (int r = 0; r < mr; r++) s0[r] = s1[r] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i u = qline(pb, g, h, bits);
                for (int r = 0; r < mr; r++) {
                    int32_t q4;
                    memcpy(&q4, q + r * K + b * 32 + g * 4, 4);
                    if (g & 1) s1[r] = qdot(s1[r], u, q4, bits);
                    else s0[r] = qdot(s0[r], u, q4, bits);
                }
                if (G == 16 && g == 3) {
                    for (int r = 0; r < mr; r++) {
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0[r], s1[r])),
                                                 qscale(a + 2 * b * QP + h * 8, d[r * nb + b]), acc[r]);
                        s0[r] = s1[r] = _mm256_setzero_si256();
                    }
                }
            }
            const float *ab = a + (G == 16 ? 2 * b + 1 : b) * QP + h * 8;
            for (int r = 0; r < mr; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0[r], s1[r])),
                                         qscale(ab, d[r * nb + b]), acc[r]);
        }
        for (int r = 0; r < mr; r++) _mm256_storeu_ps(v[r] + h * 8, acc[r]);
    }
    for (int r = 0; r < mr; r++) qfinish(v[r], c, s + r * ng, ng, bias, n0, nw, y + r * ldy);
}

#else
#define Q8_OFFSET 0
#define QROWS 1

static inline void qpanel_bg(
        const int bits, const int64_t G, const int mr, const int8_t *q, const float *d, const float *s,
        const int32_t *o, int64_t K, const uint8_t *pc, const uint8_t *nxt, const float *a, const float *c,
        const float *bias, int64_t n0, int nw, float *y, int64_t ldy) {
    const int64_t nb = K / 32, ng = K / G, pbb = qpanel_block(bits);
    (void)o; (void)nxt; (void)mr; (void)ldy;
    float v[QP];
    for (int j = 0; j < QP; j++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pb = pc + b * pbb;
            for (int h = 0; h < 32 / G; h++) {
                int sum = 0;
                for (int k = h * (int)G; k < (h + 1) * (int)G; k++) sum += qcode_at(pb, bits, j, k) * q[b * 32 + k];
                acc = fmaf((float)sum, a[(b * 32 / G + h) * QP + j] * d[b], acc);
            }
        }
        v[j] = acc;
    }
    qfinish(v, c, s, ng, bias, n0, nw, y);
}
#endif

/* One specialisation per format (bits, group), so that the inner loop has no branch. */
static void qpanel(int mr, const int8_t *q, const float *d, const float *s, const int32_t *o, int64_t K,
                   const uint8_t *pc, const uint8_t *nxt, const float *a, const float *c, int bits, int64_t G,
                   const float *bias, int64_t n0, int nw, float *y, int64_t ldy) {
#define B(BITS, GG, R) qpanel_bg(BITS, GG, R, q, d, s, o, K, pc, nxt, a, c, bias, n0, nw, y, ldy)
#if QROWS == 8
#define F(BITS, GG) switch (mr) {                                                       \
    case 8: B(BITS, GG, 8); return; case 7: B(BITS, GG, 7); return; case 6: B(BITS, GG, 6); return;  \
    case 5: B(BITS, GG, 5); return; case 4: B(BITS, GG, 4); return; case 3: B(BITS, GG, 3); return;  \
    case 2: B(BITS, GG, 2); return; default: B(BITS, GG, 1); return; }
#else
#define F(BITS, GG) switch (mr) { case QROWS: B(BITS, GG, QROWS); return; default: B(BITS, GG, 1); return; }
#endif
    if (G == 16) { F(6, 16) }
    switch (bits) {
    case 8: F(8, 32)
    case 4: F(4, 32)
    case 5: F(5, 32)
    default: F(6, 32)
    }
#undef F
#undef B
}

/* ------------------------------------------------------------------ AMX */
#if defined(UR_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define UR_AMX 1
#define AMX_ROWS 16   /* activation rows from which a product takes AMX's tiles */
#define AMX_STORE_LAG 3   /* products between a group's tile product and its store (at most 3: four C tiles) */
static int amx_state;   /* 0: not asked yet; 1: the kernel lets this process use the tiles; -1: not, or switched off */

/* Whether products take AMX (asked of the kernel once: Linux lends the tile state to a
   process that requests it). want 0 switches it off, 1 back on (if granted), -1 asks. */
int ur_amx(int want) {
    if (want == 0) { amx_state = -1; return 0; }
    if (amx_state == 0 || want == 1)
        amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return amx_state > 0;
}

typedef struct {
    uint8_t palette, start_row, zero[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles 0-3: C, 16 rows x 16 int32 sums (four groups in flight); tiles 4-5: A, 16
   activation rows x one group (G bytes); tiles 6-7: B, the group's G / 4 lines of a
   panel block (64 bytes: 16 weight rows x 4 codes) */
static void amx_configure(int64_t G) {
    tile_config t;
    memset(&t, 0, sizeof t);
    t.palette = 1;
    for (int i = 0; i < 4; i++) { t.rows[i] = 16; t.colsb[i] = 64; }
    for (int i = 4; i < 6; i++) { t.rows[i] = 16; t.colsb[i] = (uint16_t)G; }
    for (int i = 6; i < 8; i++) { t.rows[i] = (uint8_t)(G / 4); t.colsb[i] = 64; }
    _tile_loadconfig(&t);
}

/* 16 activation rows (q padded to them: rows past mr are zeros, their d 0) against one
   panel whose codes lie a byte each, [block][line][64] (pc), outputs of rows [0, mr).
   Each group's sums come from one tile product, stored AMX_STORE_LAG products later (a
   store waits for its product: stored at once, each held the next products back; 0.9x
   the time at 256 rows), then scaled into the rows' chains (so the products run while
   the vector unit scales), with the same float operations as qpanel_bg's, in group
   order. pf (pf_bytes): a later panel's codes, fetched a share a group meanwhile (tile
   loads start no hardware prefetch: without it a verify step's head waited on memory,
   1.3x the time). */
static inline __attribute__((always_inline)) void qpanel_amx_g(
        const int bits8, const int64_t G, int mr, const int8_t *q, const float *d, const float *s, int64_t K,
        const uint8_t *pc, const float *a, const float *c, const float *bias, int64_t n0, int nw, float *y,
        int64_t ldy, const char *pf, int64_t pf_bytes) {
    const int64_t nb = K / 32, ng = K / G;
    const int64_t pf_share = pf ? (pf_bytes / ng + 63) / 64 * 64 : 0;
    int32_t sums[4][16 * 16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
#define PRODUCT(C, A, B) do {                                                          \
        _tile_zero(C);                                                                 \
        _tile_loadd(A, q + g * G, K);                                                  \
        _tile_loadd(B, pc + g * G * 16, 64);                                           \
        if (bits8) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B);                  \
    } while (0)
    for (int64_t g = 0; g < ng + AMX_STORE_LAG + 1; g++) {
        if (pf && g < ng)   /* into the second-level cache: the panel after next */
            for (int64_t o = g * pf_share; o < (g + 1) * pf_share && o < pf_bytes; o += 64)
                __builtin_prefetch(pf + o, 0, 2);
        if (g >= AMX_STORE_LAG && g - AMX_STORE_LAG < ng) {   /* the sums of group g - LAG (its tile is next to be zeroed) */
            switch ((g - AMX_STORE_LAG) & 3) {
            case 0: _tile_stored(0, sums[0], 64); break;
            case 1: _tile_stored(1, sums[1], 64); break;
            case 2: _tile_stored(2, sums[2], 64); break;
            default: _tile_stored(3, sums[3], 64); break;
            }
        }
        if (g < ng) {
            switch (g & 3) {
            case 0: PRODUCT(0, 4, 6); break;
            case 1: PRODUCT(1, 5, 7); break;
            case 2: PRODUCT(2, 4, 6); break;
            default: PRODUCT(3, 5, 7); break;
            }
        }
        if (g > AMX_STORE_LAG) {   /* group h: its sums were stored an iteration ago */
            const int64_t h = g - AMX_STORE_LAG - 1, b = h * G / 32;
            const int32_t *sh = sums[h & 3];
            const __m512 av = _mm512_loadu_ps(a + h * QP);
            for (int r = 0; r < 16; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sh + 16 * r))),
                                         _mm512_mul_ps(av, _mm512_set1_ps(d[r * nb + b])), acc[r]);
        }
    }
#undef PRODUCT
    if (c) {   /* qterm_c's arithmetic, written out: here the helper cost this loop its registers */
        for (int r0 = 0; r0 < mr; r0 += 4) {
            __m512 cs[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t g = 0; g < ng; g++) {
                const __m512 cg = _mm512_loadu_ps(c + g * QP);
                for (int r = 0; r < 4; r++)   /* rows past mr: padding, never stored */
                    cs[r] = _mm512_fmadd_ps(cg, _mm512_set1_ps(s[(r0 + r) * ng + g]), cs[r]);
            }
            for (int r = 0; r < 4; r++) acc[r0 + r] = _mm512_add_ps(acc[r0 + r], cs[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        float v[QP];
        _mm512_storeu_ps(v, acc[r]);
        qfinish(v, NULL, s + r * ng, ng, bias, n0, nw, y + r * ldy);
    }
}

static void qpanel(int mr, const int8_t *q, const float *d, const float *s, const int32_t *o, int64_t K,
                   const uint8_t *pc, const uint8_t *nxt, const float *a, const float *c, int bits, int64_t G,
                   const float *bias, int64_t n0, int nw, float *y, int64_t ldy);

#define AMX_ROWS_OUTER 64   /* rows from which the 16-row blocks go outside the panels (below) */
#define AMX_SWEEP_BYTES (1 << 20)   /* codes a sweep of panels holds (widened): in the second-level cache */

/* Rows [m, m + mr) against panel p, whose codes (a byte each where widened) are at pc. A
   last block of a few rows (a verify step of 17: 16 and 1) takes the vector path's one
   pass over the panel, which costs less than a whole tile product (the head's 17 rows:
   0.8x the time); the same bits either way. */
static inline void amx_block(const int8_t *q, const float *d, const float *s, const int32_t *o, int64_t m, int mr,
                             int64_t K, const uint8_t *codes, const uint8_t *pc, int64_t p, const float *a,
                             const float *c, int bits, int64_t G, int64_t N, const float *bias, float *y, int64_t ldy,
                             const char *pf, int64_t pf_bytes) {
    const int64_t nb = K / 32, ng = K / G;
    const int nw = N - p * QP >= QP ? QP : (int)(N - p * QP);
    if (mr <= QROWS / 2) {
        qpanel(mr, q + m * K, d + m * nb, s + m * ng, o + m * ng, K, codes + p * nb * qpanel_block(bits), NULL,
               a + p * ng * QP, c ? c + p * ng * QP : NULL, bits, G, bias, p * QP, nw, y + m * ldy, ldy);
        return;
    }
#define A(B8, GG) qpanel_amx_g(B8, GG, mr, q + m * K, d + m * nb, s + m * ng, K, pc, a + p * ng * QP, \
                               c ? c + p * ng * QP : NULL, bias, p * QP, nw, y + m * ldy, ldy, pf, pf_bytes)
    if (G == 16) A(0, 16);
    else if (bits == 8) A(1, 32);
    else A(0, 32);
#undef A
}

/* The product over AMX, panels split between threads. Few rows (a verify step, a short
   chunk): each panel's 4- or 5-bit codes widened to a byte each, then every 16 rows of
   activations against it. A prefill chunk (AMX_ROWS_OUTER rows or more): the panels in
   sweeps of about AMX_SWEEP_BYTES of codes, each sweep's panels widened once, then each
   16 rows against every panel of the sweep, so that the rows' codes stay in the
   first-level cache while the sweep's panels stream by from the second (0.75-0.85x the
   time at 256 rows), and a large weight is still read from memory once. */
/* A panel's 4- or 5-bit codes (nb blocks of pbb bytes) a byte each, as the tiles read
   them: [block][line][64] at dst. */
static inline void widen_panel(uint8_t *dst, const uint8_t *panel, int64_t nb, int64_t pbb, int bits) {
    for (int64_t b = 0; b < nb; b++)
        for (int g = 0; g < 8; g++)
            _mm512_store_si512((void *)(dst + b * 512 + g * 64), qline(panel + b * pbb, g, bits));
}

static void qlinear_amx(const int8_t *q, const float *d, const float *s, const int32_t *o, int64_t M, int64_t K,
                        const uint8_t *codes, const float *a, const float *c, int bits, int64_t G, int64_t N,
                        const float *bias, float *y, int64_t ldy, int nt) {
    const int64_t nb = K / 32, ng = K / G, P = (N + QP - 1) / QP, pbb = qpanel_block(bits);
    const int widen = bits == 4 || bits == 5;
    int64_t sweep = AMX_SWEEP_BYTES / (nb * 512);   /* panels a sweep takes */
    sweep = sweep < 1 ? 1 : sweep > P ? P : sweep;
    uint8_t *all = M >= AMX_ROWS_OUTER && widen ? aligned_alloc(64, (size_t)(sweep * nb * 512)) : NULL;
    const int outer = M >= AMX_ROWS_OUTER && (all || !widen);   /* no room to widen a sweep: panel by panel */
#pragma omp parallel num_threads(nt) if (nt > 1 && P > 1)
    {
        amx_configure(G);
        if (outer) {
            const int64_t stride = all ? nb * 512 : nb * pbb;
            for (int64_t p0 = 0; p0 < P; p0 += sweep) {
                const int64_t p1 = p0 + sweep < P ? p0 + sweep : P;
                if (all) {
#pragma omp for schedule(static)
                    for (int64_t p = p0; p < p1; p++)
                        widen_panel(all + (p - p0) * nb * 512, codes + p * nb * pbb, nb, pbb, bits);
                }
                for (int64_t m = 0; m < M; m += 16) {
                    const int mr = M - m >= 16 ? 16 : (int)(M - m);
#pragma omp for schedule(static) nowait
                    for (int64_t p = p0; p < p1; p++)
                        amx_block(q, d, s, o, m, mr, K, codes, all ? all + (p - p0) * stride : codes + p * stride, p,
                                  a, c, bits, G, N, bias, y, ldy, NULL, 0);
                }
#pragma omp barrier
            }
        } else {
            uint8_t *wide = widen ? aligned_alloc(64, (size_t)(nb * 512)) : NULL;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++) {
                const uint8_t *pc = codes + p * nb * pbb;
                if (wide) {
                    widen_panel(wide, pc, nb, pbb, bits);
                    pc = wide;
                }
                const int64_t ahead = p + 2 < P ? p + 2 : -1;   /* its codes and scales fetched meanwhile */
                for (int64_t m = 0; m < M; m += 16)
                    amx_block(q, d, s, o, m, M - m >= 16 ? 16 : (int)(M - m), K, codes, pc, p, a, c, bits, G, N,
                              bias, y, ldy, m == 0 && ahead >= 0 ? (const char *)(codes + ahead * nb * pbb) : NULL,
                              nb * pbb);
                if (ahead >= 0) {
                    prefetch_row((const char *)(a + ahead * ng * QP), ng * QP * 4);
                    if (c) prefetch_row((const char *)(c + ahead * ng * QP), ng * QP * 4);
                }
            }
            free(wide);
        }
        _tile_release();
    }
    free(all);
}

#if defined(__AMX_BF16__)
/* ------------------------------------------------------------------ bfloat16 on AMX

   A bfloat16 x bfloat16 product (both operands bfloat16: the bfloat16 precision's) on
   AMX's bfloat16 tiles, for every row count: y[m, n] accumulates, in float32, one tile
   product per 32 inputs in k order (TDPBF16PS: 16 pairs of exact products into the
   float32 sum, with the tile unit's own internal order and rounding, which no vector
   instruction reproduces). An output depends on its own row and column only, so a row
   has the same bits alone, in a chunk of any size and on any thread count, on this
   CPU. It is not the vector path's arithmetic (a chain of fused multiply-adds), so the
   kernels' identity says which one ran (kernels.identity): KV computed here is not
   reused by a CPU without the tiles, nor the other way round. */
#define BF_ROWS 16   /* a tile's rows */
#define BF_K 32      /* inputs a tile product takes: 16 pairs, 64 bytes a row */

int ur_amx_bf16(int64_t K) { return K > 0 && K % BF_K == 0 && ur_amx(-1); }

/* tiles 0-3: C, 16 rows x 16 float32 sums (two row blocks x two panels); 4-5: A, 16 rows x
   32 inputs; 6-7: B, 16 pairs of inputs x 16 outputs */
static void amx_configure_bf16(void) {
    tile_config t;
    memset(&t, 0, sizeof t);
    t.palette = 1;
    for (int i = 0; i < 8; i++) { t.rows[i] = 16; t.colsb[i] = 64; }
    _tile_loadconfig(&t);
}

/* C tile t's sums (rows r0.., panel p) into y (float32, or bfloat16 rounded once as
   f32_to_bf16 rounds), plus the bias, for the rows below M */
static inline void bf_store(const float *sums, int64_t r0, int64_t M, int64_t p, int64_t N, const float *bias,
                            void *y, int ydt, int64_t ldy) {
    const int nw = N - p * NR >= NR ? NR : (int)(N - p * NR);
    const __mmask16 keep = (__mmask16)((1u << nw) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + p * NR) : _mm512_setzero_ps();
    for (int r = 0; r < BF_ROWS && r0 + r < M; r++) {
        __m512 v = _mm512_load_ps(sums + r * 16);
        if (bias) v = _mm512_add_ps(v, b);
        if (ydt == DT_F32) _mm512_mask_storeu_ps((float *)y + (r0 + r) * ldy + p * NR, keep, v);
        else _mm256_mask_storeu_epi16((uint16_t *)y + (r0 + r) * ldy + p * NR, keep, bf16x16(v));
    }
}

/* y [M, N] (f32, row stride ldy) = x [M, K] (bfloat16, row stride ldx) @ W^T (+ bias), W
   bfloat16 panels in pairs [P][K / 2][16][2] (DT_BF16P: a k step's B tile is 1 KiB of a
   panel, read where it lies), K a multiple of 32. The rows go in 16-row blocks, read
   where they lie (a last block of fewer from a copy padded with zero rows, whose sums
   are never stored); each thread takes a few
   panels at a time and runs every row block against them. Each C tile's chain of
   products waits for the one before, so several run side by side: one row block (a
   decode or verify step) against three panels, or two row blocks against two. (A
   software prefetch of the next panels made a one-row step from memory 1.2x slower:
   the tiles' loads of contiguous KiBs keep up with memory here without it.) */
void linear_bf16_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N,
                     const float *bias, void *y, int ydt, int64_t ldy, int nt) {
    if (M <= 0 || N <= 0) return;
    const int64_t P = (N + NR - 1) / NR, Mp = (M + BF_ROWS - 1) / BF_ROWS * BF_ROWS;
    const int64_t GP = Mp == BF_ROWS ? 3 : 2, groups = (P + GP - 1) / GP, pw = K * 16;   /* pw: a panel's values */
    /* whole blocks of 16 rows are read where they lie; a last one of fewer from a copy
       padded with zero rows */
    const int64_t Mf = M / BF_ROWS * BF_ROWS;
    uint16_t *xt = Mf < M ? aligned_alloc(64, (size_t)(BF_ROWS * K * 2)) : NULL;
    if (xt) {
        for (int64_t m = Mf; m < M; m++) memcpy(xt + (m - Mf) * K, x + m * ldx, (size_t)K * 2);
        memset(xt + (M - Mf) * K, 0, (size_t)((Mp - M) * K * 2));
    }
#define BF_A(m) ((m) < Mf ? x + (m) * ldx : xt)
#define BF_LDA(m) (((m) < Mf ? ldx : K) * 2)
#pragma omp parallel num_threads(nt) if (nt > 1 && groups > 1)
    {
        amx_configure_bf16();
        float sums[4][BF_ROWS * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p0 = g * GP;
            const int np = P - p0 >= GP ? (int)GP : (int)(P - p0);
            const uint16_t *w0 = wp + p0 * pw, *w1 = w0 + pw, *w2 = w1 + pw;
            if (GP == 3) {   /* one row block, up to three panels: C0-C2, A4, B5-B7 */
                _tile_zero(0); _tile_zero(1); _tile_zero(2);
                const uint16_t *a0 = BF_A(0);
                const int64_t la0 = BF_LDA(0);
                for (int64_t k = 0; k < K; k += BF_K) {
                    _tile_loadd(4, a0 + k, la0);
                    _tile_loadd(5, w0 + k * 16, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (np > 1) { _tile_loadd(6, w1 + k * 16, 64); _tile_dpbf16ps(1, 4, 6); }
                    if (np > 2) { _tile_loadd(7, w2 + k * 16, 64); _tile_dpbf16ps(2, 4, 7); }
                }
                _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64); _tile_stored(2, sums[2], 64);
                for (int j = 0; j < np; j++) bf_store(sums[j], 0, M, p0 + j, N, bias, y, ydt, ldy);
                continue;
            }
            for (int64_t m = 0; m < Mp; m += 2 * BF_ROWS) {   /* two row blocks, two panels: C0-C3, A4-A5, B6-B7 */
                const int rb = m + BF_ROWS < Mp ? 2 : 1;
                const uint16_t *a0 = BF_A(m), *a1 = rb == 2 ? BF_A(m + BF_ROWS) : NULL;
                const int64_t la0 = BF_LDA(m), la1 = BF_LDA(m + BF_ROWS);
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t k = 0; k < K; k += BF_K) {
                    _tile_loadd(4, a0 + k, la0);
                    _tile_loadd(6, w0 + k * 16, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (np > 1) { _tile_loadd(7, w1 + k * 16, 64); _tile_dpbf16ps(1, 4, 7); }
                    if (rb == 2) {
                        _tile_loadd(5, a1 + k, la1);
                        _tile_dpbf16ps(2, 5, 6);
                        if (np > 1) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
                _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64);
                for (int t = 0; t < 4; t++)
                    if ((t & 1) < np && (t >> 1) < rb)
                        bf_store(sums[t], m + (t >> 1) * BF_ROWS, M, p0 + (t & 1), N, bias, y, ydt, ldy);
            }
        }
        _tile_release();
    }
#undef BF_A
#undef BF_LDA
    free(xt);
}
#else
int ur_amx_bf16(int64_t K) { (void)K; return 0; }
void linear_bf16_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N,
                     const float *bias, void *y, int ydt, int64_t ldy, int nt) { (void)x; (void)M; (void)K; (void)ldx;
    (void)wp; (void)N; (void)bias; (void)y; (void)ydt; (void)ldy; (void)nt; }
#endif
#else
int ur_amx(int want) { (void)want; return 0; }
int ur_amx_bf16(int64_t K) { (void)K; return 0; }
void linear_bf16_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N,
                     const float *bias, void *y, int ydt, int64_t ldy, int nt) { (void)x; (void)M; (void)K; (void)ldx;
    (void)wp; (void)N; (void)bias; (void)y; (void)ydt; (void)ldy; (void)nt; }
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias) over W as stored (above): codes [panels][K / 32][panel
   block], a and c [panels][K / G][16] (c NULL: none). K a multiple of 32 and of G. */
void ur_linear_q(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx, const void *codes, const float *a,
                 const float *c, int bits, int64_t G, int64_t N, const float *bias, float *y, int64_t ldy, int nt) {
    if (M <= 0 || N <= 0) return;
    const int64_t nb = K / 32, ng = K / G, pbb = qpanel_block(bits), P = (N + QP - 1) / QP;
    const int64_t Mp = (M + 15) / 16 * 16;   /* rows padded for AMX's 16-row tiles: zeros, d 0 */
    int8_t *q = calloc((size_t)(Mp * K + 64), 1);
    float *d = calloc((size_t)(Mp * nb), sizeof(float));
    float *s = calloc((size_t)(Mp * ng), sizeof(float));   /* padding rows' sums 0: qpanel_amx_g reads them
                                                              (garbage there was slow: denormal operands) */
    int32_t *o = malloc(sizeof(int32_t) * (size_t)(Mp * ng));
    float *row = xdt == DT_F32 ? NULL : malloc(sizeof(float) * (size_t)K);   /* a 16-bit row, converted exactly */
    for (int64_t m = 0; m < M; m++) {
        const float *xr = (const float *)x + m * ldx;
        if (row) {
            to_f32((const char *)x + m * ldx * elem_size(xdt), xdt, row, K);
            xr = row;
        }
        quantize_row(xr, K, G, q + m * K, d + m * nb, s + m * ng, o + m * ng);
    }
    free(row);
#if defined(UR_AMX)
    if (M >= AMX_ROWS && ur_amx(-1)) {
        qlinear_amx(q, d, s, o, M, K, (const uint8_t *)codes, a, c, bits, G, N, bias, y, ldy, nt);
        free(q); free(d); free(s); free(o);
        return;
    }
#endif
    /* panels in chunks that stay in the second-level cache while every row group passes
       over them (a row group's outputs then lie side by side: one chunk's panels written
       as a run of each row, where a panel at a time scattered them a row apart, every
       line a miss), at most an even share of the panels a thread */
    const int64_t per = (int64_t)nb * pbb, cap = (QCHUNK_BYTES + per - 1) / per;
    const int64_t share = (P + nt - 1) / (nt > 0 ? nt : 1);
    const int64_t CP = cap < share ? cap : share > 0 ? share : 1;
    const int64_t chunks = (P + CP - 1) / CP;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && chunks > 1)
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t p0 = ch * CP, p1 = p0 + CP < P ? p0 + CP : P;
        /* the first row group, which reads the panels from memory, takes QROWS rows, the
           rest go in groups of even size (17: 8, 5, 4, where 8, 8, 1 left a last pass of
           one row waiting on its chain: the Q8_0 head's 17 / 25 rows 24.2 / 33.0 ms against
           25.2 / 36.0 on Zen 4) */
        for (int64_t m = 0, mr = 0; m < M; m += mr) {
            mr = pass_rows(m, M, QROWS);
            for (int64_t p = p0; p < p1; p++) {
                const uint8_t *pc = (const uint8_t *)codes + p * per;
                /* the first pass reads ahead, from 5 rows on: below, one sequential stream, the
                   hardware's prefetch alone is faster (Gemma 3 270M's Q8_0 head at 1 / 2 / 4 rows
                   8.3 / 8.4 / 9.5 ms against 9.9 / 9.0 / 11.0, measured on Zen 4; the greedy
                   head's rule) */
                const uint8_t *nxt = M > 4 && m == 0 && p + 1 < P ? pc + per : NULL;
                if (nxt) {   /* the next panel's scales */
                    prefetch_row((const char *)(a + (p + 1) * ng * QP), ng * QP * 4);
                    if (c) prefetch_row((const char *)(c + (p + 1) * ng * QP), ng * QP * 4);
                }
                const int nw = N - p * QP >= QP ? QP : (int)(N - p * QP);
                qpanel((int)mr, q + m * K, d + m * nb, s + m * ng, o + m * ng, K, pc, nxt,
                       a + p * ng * QP, c ? c + p * ng * QP : NULL, bits, G, bias, p * QP, nw, y + m * ldy, ldy);
            }
        }
    }
    free(q); free(d); free(s); free(o);
}

/* Rows `ids` of a weight as stored, as float32 [n, K]: each weight fma(a, u, c) (a * u
   without c), the value the file's dequantisation gives (an embedding lookup reading
   the table the head multiplies by). */
void ur_rows_q(const void *codes, const float *a, const float *c, int bits, int64_t G, int64_t K,
               const int64_t *ids, int64_t n, float *out) {
    const int64_t nb = K / 32, ng = K / G, pbb = qpanel_block(bits);
    for (int64_t i = 0; i < n; i++) {
        const int64_t panel = ids[i] / QP;
        const int j = (int)(ids[i] % QP);
        const uint8_t *pc = (const uint8_t *)codes + panel * nb * pbb;
        const float *pa = a + panel * ng * QP, *pcs = c ? c + panel * ng * QP : NULL;
        for (int64_t k = 0; k < K; k++) {
            const int u = qcode_at(pc + (k / 32) * pbb, bits, j, (int)(k % 32));
            const int64_t at = (k / G) * QP + j;
            out[i * K + k] = pcs ? fmaf(pa[at], (float)u, pcs[at]) : pa[at] * (float)u;
        }
    }
}

/* ------------------------------------------------------------------------ argmax */

/* The index of the largest of x [n] (float32), the first where several are equal and the
   first NaN where there is one: torch.argmax's answer, in one pass (torch's takes about
   0.7 ms over a 262k-word row, as long as a small layer's products). */
int64_t ur_argmax(const float *x, int64_t n) {
    if (n <= 0) return -1;
    /* the largest value and whether there is a NaN (a maximum is the same in any order:
       lanes of partial maxima; a NaN is skipped by max(v, m)), then the first index
       holding it (or the first NaN) */
    float mx = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(UR_AVX512)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 vn = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        vn |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(v, vm);
    }
    float m[16];
    _mm512_storeu_ps(m, vm);
    for (int l = 0; l < 16; l++) mx = m[l] > mx ? m[l] : mx;
    nan = vn != 0;
#elif defined(UR_AVX2)
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int vn = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vn |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(v, vm);
    }
    float m[8];
    _mm256_storeu_ps(m, vm);
    for (int l = 0; l < 8; l++) mx = m[l] > mx ? m[l] : mx;
    nan = vn != 0;
#endif
    for (; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
        nan |= x[i] != x[i];
    }
    int64_t j = 0;
#if defined(UR_AVX512)
    const __m512 target = _mm512_set1_ps(mx);
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#elif defined(UR_AVX2)
    const __m256 target = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; j < n; j++)
        if (nan ? x[j] != x[j] : x[j] == mx) return j;
    return 0;
}

/* ------------------------------------------------------------------------ greedy head

   The token a greedy row takes is the argmax of its logits; the LM head that gives them
   is the largest product of a step (262k words x 640 inputs for Gemma 3). An int8 copy
   of the head (a scale a word) and the row rounded to int8 in two parts (its largest
   inputs with one scale, the rest with another) give every logit to within a bound
   computed from norms (Cauchy-Schwarz on what each rounding left, and the float chain's
   own error): every
   word whose upper bound reaches the best lower bound is a candidate, the head's own
   kernel computes those exactly, and their argmax is the full head's, bit for bit
   (kernels.GreedyHead). The integer sums are exact on every path, so the candidates
   are the same everywhere; only their count depends on the bound's slack. */
#define GH_ROWS 8    /* rows a pass over a panel takes */
#define GH_BIG 8     /* a row's largest inputs, rounded on their own (16: each row's bounds a
                        little tighter, 7.1 candidates a row against 7.6 on Gemma 3 270M's
                        verify rows, and the calls 4% slower: docs/models.md) */

/* One row rounded to int8 in two parts: its GH_BIG largest inputs (by magnitude: the
   outliers that would make one scale coarse for the rest) with one scale, the others
   with another; q1's codes + 128 (dpbusd's unsigned operand), q2 kept only as the
   magnitudes and signs of its groups (mag, neg). x = t1 q1 + t2 q2 + d, and
   |logit_j - A_j| <= a |e_j| + b |w_j| bounds x.e_j, d against s_j q_j and the head's
   float chain. big: the groups of 4 inputs that hold the outliers (ng of them). */
typedef struct {
    float t1, t2, a, b;
    int ok, ng;
    int32_t big[GH_BIG];
    uint32_t mag[GH_BIG];   /* a group's four |q2|, one byte each */
    uint64_t neg[GH_BIG];   /* their signs, for each of a panel's 16 words: bit 4 c + t */
} gh_row;

static gh_row gh_quantize(const float *x, int64_t K, int64_t Kp, uint8_t *q1, double gamma) {
    gh_row r;
    memset(&r, 0, sizeof r);
    double nx = 0.0;
    for (int64_t k = 0; k < K; k++) {
        if (!isfinite(x[k])) return r;
        nx += (double)x[k] * x[k];
    }
    /* the outliers: the GH_BIG largest magnitudes, the first of equals first */
    int64_t top[GH_BIG];
    const int nb = K < GH_BIG ? (int)K : GH_BIG;
    uint8_t *taken = (uint8_t *)calloc((size_t)(Kp > 0 ? 2 * Kp : 1), 1);
    int8_t *q2 = (int8_t *)(taken + Kp);   /* the outliers' codes (zero elsewhere) */
    for (int i = 0; i < nb; i++) {
        int64_t at = -1;
        for (int64_t k = 0; k < K; k++)
            if (!taken[k] && (at < 0 || fabsf(x[k]) > fabsf(x[at]))) at = k;
        top[i] = at;
        taken[at] = 1;
    }
    double m1 = 0.0, m2 = 0.0;
    for (int64_t k = 0; k < K; k++) {
        if (taken[k]) m2 = fmax(m2, fabs(x[k]));
        else m1 = fmax(m1, fabs(x[k]));
    }
    const float t1 = (float)(m1 / 127.0), t2 = (float)(m2 / 127.0);
    double nd = 0.0;
    for (int64_t k = 0; k < Kp; k++) {
        int v = 0, w = 0;
        if (k < K && !taken[k] && t1 > 0) v = (int)lrint(x[k] / t1);
        if (k < K && taken[k] && t2 > 0) w = (int)lrint(x[k] / t2);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        w = w > 127 ? 127 : w < -127 ? -127 : w;
        q1[k] = (uint8_t)(v + 128);
        q2[k] = (int8_t)w;
        if (k < K) {
            const double d = (double)x[k] - (double)t1 * v - (double)t2 * w;   /* one of the two is zero */
            nd += d * d;
        }
    }
    for (int i = 0; i < nb; i++) {   /* the groups of 4 the outliers fall in, each once */
        const int32_t g = (int32_t)(top[i] / 4);
        int seen = 0;
        for (int j = 0; j < r.ng; j++) seen |= r.big[j] == g;
        if (seen) continue;
        uint32_t mag = 0, sign = 0;
        for (int t = 0; t < 4; t++) {
            const int v = q2[4 * g + t];
            mag |= (uint32_t)(v < 0 ? -v : v) << (8 * t);
            sign |= (uint32_t)(v < 0) << t;
        }
        r.mag[r.ng] = mag;
        r.neg[r.ng] = (uint64_t)sign * 0x1111111111111111ull;
        r.big[r.ng++] = g;
    }
    free(taken);
    nx = sqrt(nx) * (1.0 + 0x1p-40);
    nd = sqrt(nd) * (1.0 + 0x1p-40) + 0x1p-50 * nx;   /* and the doubles' own roundings of the residues */
    r.t1 = t1;
    r.t2 = t2;
    r.a = (float)((nx + nd) * (1.0 + 0x1p-18));
    r.b = (float)((nd + gamma * nx) * (1.0 + 0x1p-18));
    r.ok = isfinite(r.a) && isfinite(r.b);
    return r;
}

/* The outliers' integer sums against one panel (their groups only; q2 is zero elsewhere
   in them): sum over the groups of q2 w, for 16 words, as |q2| against the words
   negated where q2 is negative (dpbusd's unsigned operand; the codes are within +-127,
   so a negation is exact), in two chains (integer sums are exact in any order). */
static inline void gh_big(const gh_row *g, const int8_t *panel, int32_t *out) {
#if defined(UR_AVX512) && defined(__AVX512VNNI__)
    const __m512i zero = _mm512_setzero_si512();
    __m512i acc0 = zero, acc1 = zero;
    int i = 0;
    for (; i + 2 <= g->ng; i += 2) {
        const __m512i w0 = _mm512_loadu_si512(panel + (int64_t)g->big[i] * 4 * NR);
        const __m512i w1 = _mm512_loadu_si512(panel + (int64_t)g->big[i + 1] * 4 * NR);
        acc0 = _mm512_dpbusd_epi32(acc0, _mm512_set1_epi32((int32_t)g->mag[i]),
                                   _mm512_mask_sub_epi8(w0, (__mmask64)g->neg[i], zero, w0));
        acc1 = _mm512_dpbusd_epi32(acc1, _mm512_set1_epi32((int32_t)g->mag[i + 1]),
                                   _mm512_mask_sub_epi8(w1, (__mmask64)g->neg[i + 1], zero, w1));
    }
    if (i < g->ng) {
        const __m512i w0 = _mm512_loadu_si512(panel + (int64_t)g->big[i] * 4 * NR);
        acc0 = _mm512_dpbusd_epi32(acc0, _mm512_set1_epi32((int32_t)g->mag[i]),
                                   _mm512_mask_sub_epi8(w0, (__mmask64)g->neg[i], zero, w0));
    }
    _mm512_storeu_si512(out, _mm512_add_epi32(acc0, acc1));
#else
    for (int c = 0; c < NR; c++) {
        int32_t acc = 0;
        for (int i = 0; i < g->ng; i++) {
            const int8_t *wc = panel + (int64_t)g->big[i] * 4 * NR + c * 4;
            for (int t = 0; t < 4; t++) {
                const int32_t m = (int32_t)((g->mag[i] >> (8 * t)) & 0xff);
                acc += (g->neg[i] >> t & 1 ? -m : m) * wc[t];
            }
        }
        out[c] = acc;
    }
#endif
}

#if defined(UR_AVX512) && defined(__AVX512VNNI__)
/* L rows' integer sums against one panel: sums[l][c] = sum_k q0[l * Kp + k] panel[k][c],
   C chains a row over alternate groups of 4 inputs (one or two rows: one chain would wait
   on each dpbusd's latency; integer sums are exact in any order). hot: the panel is in L1
   (a block after the first), and each group of 4 inputs is loaded once into a register
   for all the rows, where the compiler would fold it into every row's dpbusd as a load of
   its own (blocks of 2-4 rows then took twice a row's time: Zen 4's loads, not its
   products, were the limit); from memory, the folded form streams faster. */
static inline __attribute__((always_inline)) void gh_sums(const int L, const int C, const int hot, const uint8_t *q0,
                                                          int64_t Kp, const int8_t *panel, int32_t sums[][NR],
                                                          const int8_t *pf) {
    __m512i acc[GH_ROWS][4];
    for (int l = 0; l < L; l++)
        for (int c = 0; c < C; c++) acc[l][c] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 4 * C <= Kp; k += 4 * C)
        for (int c = 0; c < C; c++) {
            if (pf) __builtin_prefetch(pf + (k + 4 * c) * NR, 0, 2);
            __m512i wv = _mm512_loadu_si512(panel + (k + 4 * c) * NR);
            if (hot) __asm__("" : "+v"(wv));   /* in a register: not folded into each row's dpbusd */
            for (int l = 0; l < L; l++) {
                int32_t four;
                memcpy(&four, q0 + l * Kp + k + 4 * c, 4);
                acc[l][c] = _mm512_dpbusd_epi32(acc[l][c], _mm512_set1_epi32(four), wv);
            }
        }
    for (; k < Kp; k += 4) {
        if (pf) __builtin_prefetch(pf + k * NR, 0, 2);
        const __m512i wv = _mm512_loadu_si512(panel + k * NR);
        for (int l = 0; l < L; l++) {
            int32_t four;
            memcpy(&four, q0 + l * Kp + k, 4);
            acc[l][0] = _mm512_dpbusd_epi32(acc[l][0], _mm512_set1_epi32(four), wv);
        }
    }
    for (int l = 0; l < L; l++) {
        for (int c = 1; c < C; c++) acc[l][0] = _mm512_add_epi32(acc[l][0], acc[l][c]);
        _mm512_storeu_si512(sums[l], acc[l][0]);
    }
}
#endif

/* One row's bounds of 16 words from their integer sums (sums: its main part's, codes
   + 128 against the words; big: its outliers'): the upper bounds to ur (-inf past the nw real
   words) and the lower ones into top, a lane a word (the best so far: a NaN leaves a
   lane as it was, as a scalar `>` would). Every lane one fixed sequence of float32
   operations, the same on each path. */
static inline void gh_bounds(const gh_row *g, const int32_t *sums, const int32_t *big, const int32_t *colsum,
                             const float *s, const float *e, const float *w, int nw, float *ur, float *top) {
#if defined(UR_AVX512)
    const __mmask16 real = (__mmask16)((1u << nw) - 1u);
    const __m512 sv = _mm512_loadu_ps(s);
    /* the integer sums less the +128 offsets: exact, and exact in float32 (< 2^24) */
    const __m512 i1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums),
                                                          _mm512_slli_epi32(_mm512_loadu_si512(colsum), 7)));
    const __m512 i2 = _mm512_cvtepi32_ps(_mm512_loadu_si512(big));
    const __m512 p1 = _mm512_mul_ps(_mm512_mul_ps(sv, _mm512_set1_ps(g->t1)), i1);
    const __m512 p2 = _mm512_mul_ps(_mm512_mul_ps(sv, _mm512_set1_ps(g->t2)), i2);
    const __m512 A = _mm512_add_ps(p1, p2);
    const __m512 R = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(g->a), _mm512_loadu_ps(e)),
                      _mm512_mul_ps(_mm512_set1_ps(g->b), _mm512_loadu_ps(w))),
        _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(0x1p-15f), _mm512_add_ps(_mm512_abs_ps(p1), _mm512_abs_ps(p2))),
                      _mm512_set1_ps(1e-30f)));
    _mm512_storeu_ps(ur, _mm512_mask_blend_ps(real, _mm512_set1_ps(-INFINITY), _mm512_add_ps(A, R)));
    const __m512 t = _mm512_loadu_ps(top);
    _mm512_storeu_ps(top, _mm512_mask_max_ps(t, real, _mm512_sub_ps(A, R), t));
#else
    for (int c = 0; c < NR; c++) {   /* a vector loop: no branch */
        const float i1 = (float)(sums[c] - 128 * colsum[c]), i2 = (float)big[c];
        const float p1 = (s[c] * g->t1) * i1, p2 = (s[c] * g->t2) * i2, A = p1 + p2;
        const float R = (g->a * e[c] + g->b * w[c]) + (0x1p-15f * (fabsf(p1) + fabsf(p2)) + 1e-30f);
        ur[c] = A + R;
        const float lo = A - R;
        top[c] = c < nw && lo > top[c] ? lo : top[c];
    }
    for (int c = nw; c < NR; c++) ur[c] = -INFINITY;   /* a last panel's padding */
#endif
}

/* The int8 head from the dense one w [V, K] (dtype dt): per word j a scale s = max|w_j| /
   127, codes round(w_j / s) into panels [P][Kp / 4][16][4] (zeros past V and K), their
   sum, and the norms of w_j - s q_j and of w_j, in float64, rounded up to float32. */
void ur_greedy_build(const void *w, int dt, int64_t V, int64_t K, int8_t *q, int32_t *colsum, float *s, float *e,
                     float *wn, int nt) {
    const int64_t Kp = (K + 3) / 4 * 4;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t j = 0; j < V; j++) {
        double mx = 0.0;
        for (int64_t k = 0; k < K; k++) mx = fmax(mx, fabs((double)load_elem(w, dt, j * K + k)));
        const float sj = (float)(mx / 127.0);
        double ee = 0.0, ww = 0.0;
        int32_t sum = 0;
        int8_t *panel = q + (j / NR) * Kp * NR;
        const int c = (int)(j % NR);
        for (int64_t k = 0; k < Kp; k++) {
            const double v = k < K ? (double)load_elem(w, dt, j * K + k) : 0.0;
            long t = sj > 0 ? lrint(v / sj) : 0;
            t = t > 127 ? 127 : t < -127 ? -127 : t;
            panel[(k / 4) * NR * 4 + c * 4 + k % 4] = (int8_t)t;
            sum += (int32_t)t;
            const double d = v - (double)sj * (double)t;
            ee += d * d;
            ww += v * v;
        }
        colsum[j] = sum;
        s[j] = sj;
        e[j] = nextafterf((float)(sqrt(ee) * (1.0 + 0x1p-30)), INFINITY);
        wn[j] = nextafterf((float)(sqrt(ww) * (1.0 + 0x1p-30)), INFINITY);
    }
}

/* A row's filter bar from its best lower bound so far, T: the words an upper bound of
   which is below it cannot be candidates. Monotone in T, so a bar from a lower bound of
   the row's final T is at most the final bar. */
static inline float gh_bar(double T, double rel, double abs_) { return (float)(T - (rel * fabs(T) + abs_)); }

/* The words of a panel whose upper bound reaches the bar: a bit a word (NaN never). */
static inline uint32_t gh_hits(const float *ur, float bar) {
#if defined(UR_AVX512)
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(ur), _mm512_set1_ps(bar), _CMP_GE_OQ);
#else
    uint32_t hit = 0;
    for (int c = 0; c < NR; c++) hit |= (uint32_t)(ur[c] >= bar) << c;
    return hit;
#endif
}

static inline float gh_top(const float *best) {
    float top = -INFINITY;
    for (int c = 0; c < NR; c++) top = best[c] > top ? best[c] : top;
    return top;
}

/* Candidates of M rows x [M, K] (float32) against the int8 head q (panels [P][Kp / 4][16][4],
   Kp = K rounded up to 4; colsum: each word's sum of codes; s its scale; e and w the
   norms of its rounding error and of the word itself, rounded up). Row m's candidates
   (the words whose upper bound reaches the bar of its best lower bound) go to
   cand + m * cap, ascending, their count to count[m] (-1: more than cap, or a row that
   is not finite: the caller runs the full head for it). The pass keeps, a row, only the
   words whose upper bound reaches the bar of the best lower bound seen so far (a
   superset of the candidates, and few: no upper bound is stored for every word), the
   final bar then picks the candidates from them. pend: scratch of M * 2 (4 cap + 4096)
   floats, a row's kept words and their upper bounds (a row whose kept words outgrow it,
   even at the bar of the moment, has more than cap candidates: -1). */
void ur_greedy_candidates(const float *x, int64_t M, int64_t K, const int8_t *q, const int32_t *colsum,
                          const float *s, const float *e, const float *w, int64_t V, double gamma, double rel,
                          double abs_, void *pend, int64_t *cand, int64_t cap, int64_t *count) {
    const int64_t P = (V + NR - 1) / NR, Kp = (K + 3) / 4 * 4, PC = 4 * cap + 4096;
    uint8_t *q1 = (uint8_t *)malloc((size_t)(M * Kp));
    gh_row *rw = (gh_row *)malloc(sizeof(gh_row) * (size_t)M);
    float *best = (float *)malloc(sizeof(float) * (size_t)(M * NR));   /* each row's best lower bound, a lane a word */
    float *bar = (float *)malloc(sizeof(float) * (size_t)M);           /* each row's filter bar of the moment */
    int64_t *np = (int64_t *)malloc(sizeof(int64_t) * (size_t)M);     /* words kept, -1 when they outgrew pend */
    for (int64_t m = 0; m < M; m++) {
        rw[m] = gh_quantize(x + m * K, K, Kp, q1 + m * Kp, gamma);
        for (int c = 0; c < NR; c++) best[m * NR + c] = -INFINITY;
        bar[m] = -FLT_MAX;   /* not -inf: a padding word's -inf never passes */
        np[m] = rw[m].ok ? 0 : -1;
    }
    for (int64_t p = 0; p < P; p++) {
        const int8_t *panel = q + p * Kp * NR;
        const int nw = V - p * NR >= NR ? NR : (int)(V - p * NR);
        for (int64_t m0 = 0; m0 < M;) {
            /* the first block, which streams the panel in, takes GH_ROWS rows, the rest go in
               blocks of even size over the panel in L1 (17: 8, 5, 4; 9: 8, 1) */
            const int mr = (int)pass_rows(m0, M, GH_ROWS);
            int32_t sums[GH_ROWS][NR];
#if defined(UR_AVX512) && defined(__AVX512VNNI__)
            /* several rows: the first block asks for the next panel while it reads this one
               (at 4 / 8 / 17 rows 1.1x / 1.9x / 1.4x faster, measured on Zen 4; at one row
               the hardware's prefetch alone is faster) */
            const int8_t *pf = M > 2 && m0 == 0 && p + 1 < P ? panel + Kp * NR : NULL;
            if (m0 == 0)
                switch (mr) {   /* the row count a constant: the sums stay in registers */
#define GH(R, C) case R: gh_sums(R, C, 0, q1 + m0 * Kp, Kp, panel, sums, pf); break;
                GH(1, 4) GH(2, 2) GH(3, 1) GH(4, 1) GH(5, 1) GH(6, 1) GH(7, 1) GH(8, 1)
#undef GH
                }
            else   /* the panel the first block read, in L1 */
                switch (mr) {
#define GH(R, C) case R: gh_sums(R, C, 1, q1 + m0 * Kp, Kp, panel, sums, NULL); break;
                GH(1, 4) GH(2, 4) GH(3, 2) GH(4, 2) GH(5, 1) GH(6, 1) GH(7, 1) GH(8, 1)
#undef GH
                }
#else
            memset(sums, 0, sizeof sums);
            for (int64_t k = 0; k < Kp; k += 4)
                for (int l = 0; l < mr; l++) {
                    const uint8_t *xl = q1 + (m0 + l) * Kp + k;
                    for (int c = 0; c < NR; c++) {
                        const int8_t *wc = panel + k * NR + c * 4;
                        sums[l][c] += xl[0] * wc[0] + xl[1] * wc[1] + xl[2] * wc[2] + xl[3] * wc[3];
                    }
                }
#endif
            for (int r = 0; r < mr; r++) {
                const int64_t m = m0 + r;
                if (np[m] < 0) continue;
                int32_t big[NR];
                float ur[NR];
                gh_big(&rw[m], panel, big);
                gh_bounds(&rw[m], sums[r], big, colsum + p * NR, s + p * NR, e + p * NR, w + p * NR, nw, ur,
                          best + m * NR);
                if (!gh_hits(ur, bar[m])) continue;
                /* a word passed: the bar of the best lower bound now (its own included), and the
                   words that still pass it kept */
                bar[m] = gh_bar(gh_top(best + m * NR), rel, abs_);
                int32_t *pw = (int32_t *)pend + m * 2 * PC;
                float *pu = (float *)pend + m * 2 * PC + PC;
                int64_t n = np[m];
                if (n + NR > PC) {   /* full: what no longer passes goes */
                    int64_t k = 0;
                    for (int64_t i = 0; i < n; i++)
                        if (pu[i] >= bar[m]) { pw[k] = pw[i]; pu[k++] = pu[i]; }
                    n = k;
                    if (n + NR > PC) { np[m] = -1; continue; }
                }
                for (uint32_t hit = gh_hits(ur, bar[m]); hit; hit &= hit - 1) {
                    const int c = __builtin_ctz(hit);
                    pw[n] = (int32_t)(p * NR + c);
                    pu[n++] = ur[c];
                }
                np[m] = n;
            }
            m0 += mr;
        }
    }
    for (int64_t m = 0; m < M; m++) {
        const double T = gh_top(best + m * NR);
        if (np[m] < 0 || !isfinite(T)) { count[m] = -1; continue; }
        const float fb = gh_bar(T, rel, abs_);
        const int32_t *pw = (const int32_t *)pend + m * 2 * PC;
        const float *pu = (const float *)pend + m * 2 * PC + PC;
        int64_t n = 0;
        for (int64_t i = 0; i < np[m] && n >= 0; i++)
            if (pu[i] >= fb) {
                if (n == cap) n = -1;
                else cand[m * cap + n++] = pw[i];
            }
        count[m] = n;
    }
    free(q1);
    free(rw);
    free(best);
    free(bar);
    free(np);
}

/* ------------------------------------------------------------------------ elementwise */

/* e^x from IEEE operations only: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' expf
   polynomial, then scaled by 2^n through the exponent bits (0 below e^-87.3, inf above
   e^88.7). Within 2 ulp of the correctly rounded value. */
static inline float ur_expf(float x) {
    /* branch-free, so the loops over it vectorise: the edges are selected at the end */
    const float xc = x > 88.72283f ? 88.72283f : (x < -87.33654f ? -87.33654f : x);
    const float t = fmaf(xc, 1.44269504088896341f, 12582912.0f);
    const float n = t - 12582912.0f;
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float e = fmaf(p * r, r, r) + 1.0f;
    /* 2^n as two halves (n may reach 128, one past the largest exponent) */
    const int32_t k = (int32_t)n, k1 = k >> 1, k2 = k - k1;
    const uint32_t b1 = (uint32_t)(k1 + 127) << 23, b2 = (uint32_t)(k2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    const float y = e * s1 * s2;
    return x > 88.72283f ? INFINITY : (x < -87.33654f ? 0.0f : (x != x ? x : y));
}

/* log(x) for x > 0 finite (Cephes' logf): x = m 2^e, m in [sqrt(1/2), sqrt(2)). */
static inline float ur_logf(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const int32_t e0 = (int32_t)((u >> 23) & 0xff) - 126;
    u = (u & 0x807fffffu) | 0x3f000000u;   /* m in [0.5, 1) */
    float m0;
    memcpy(&m0, &u, 4);
    const int small = m0 < 0.707106781186547524f;
    const int32_t e = small ? e0 - 1 : e0;
    const float m = small ? m0 + m0 - 1.0f : m0 - 1.0f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = fmaf(y, m, -1.1514610310e-1f);
    y = fmaf(y, m, 1.1676998740e-1f);
    y = fmaf(y, m, -1.2420140846e-1f);
    y = fmaf(y, m, 1.4249322787e-1f);
    y = fmaf(y, m, -1.6668057665e-1f);
    y = fmaf(y, m, 2.0000714765e-1f);
    y = fmaf(y, m, -2.4999993993e-1f);
    y = fmaf(y, m, 3.3333331174e-1f);
    y = y * m * z;
    const float fe = (float)e;
    y = fmaf(fe, -2.12194440e-4f, y);
    y = fmaf(z, -0.5f, y);
    return fmaf(fe, 0.693359375f, m + y);
}

/* log(1 + x) for x >= 0, accurate near 0 (u = 1 + x; log(u) x / (u - 1)). */
static inline float ur_log1pf(float x) {
    const float u = 1.0f + x;
    const float r = ur_logf(u) * (x / (u - 1.0f));
    return u == 1.0f ? x : (u == INFINITY ? u : r);
}

static inline float ur_tanhf(float x) {
    const float a = fabsf(x);
    const float z = x * x;
    float p = -5.70498872745e-3f;
    p = fmaf(p, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    const float near0 = fmaf(p * z, x, x);
    const float far = copysignf(1.0f - 2.0f / (ur_expf(2.0f * a) + 1.0f), x);
    return a < 0.625f ? near0 : (a > 9.0f ? copysignf(1.0f, x) : far);
}

static inline float f_exp(float x, float p) { (void)p; return ur_expf(x); }
static inline float f_sigmoid(float x, float p) { (void)p; return 1.0f / (1.0f + ur_expf(-x)); }
static inline float f_silu(float x, float p) { (void)p; return x / (1.0f + ur_expf(-x)); }
/* softplus with beta 1 and threshold p (torch's: x itself above it) */
static inline float f_softplus(float x, float p) { return x > p ? x : ur_log1pf(ur_expf(x)); }
static inline float f_gelu_tanh(float x, float p) {
    (void)p;
    float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + ur_tanhf(inner));
}
static inline float f_tanh(float x, float p) { (void)p; return ur_tanhf(x); }

/* RMSNorm of `rows` rows of n float32: y = x / sqrt(mean(x^2) + eps) * w (w NULL: 1).
   Each row's sum of squares in one order: eight chains of fused multiply-adds over
   i = l (mod 8), summed pairwise, then the tail in order; y may be x. */
#define RN_ROWS 4   /* rows whose chains run side by side (each its own: the same bits) */

/* y [nr, n] = the norm of x [nr, n], nr <= RN_ROWS rows (y may be x) */
static void rms_rows(const float *x, float *y, int nr, int64_t n, const float *w, float eps) {
    float acc[RN_ROWS][8] = {{0}};
    int64_t i = 0;
    if (nr == RN_ROWS)
        for (; i + 8 <= n; i += 8)
            for (int r = 0; r < RN_ROWS; r++)
                for (int l = 0; l < 8; l++) acc[r][l] = fmaf(x[r * n + i + l], x[r * n + i + l], acc[r][l]);
    for (int r = 0; r < nr; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n, *a = acc[r];
        int64_t j = i;
        for (; j + 8 <= n; j += 8)
            for (int l = 0; l < 8; l++) a[l] = fmaf(xr[j + l], xr[j + l], a[l]);
        float ss = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        for (; j < n; j++) ss = fmaf(xr[j], xr[j], ss);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        if (w) for (int64_t k = 0; k < n; k++) yr[k] = xr[k] * inv * w[k];
        else for (int64_t k = 0; k < n; k++) yr[k] = xr[k] * inv;
    }
}

void ur_rms_norm(const float *x, float *y, int64_t rows, int64_t n, const float *w, float eps, int nt) {
    const int64_t groups = (rows + RN_ROWS - 1) / RN_ROWS;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && rows * n > 65536)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = g * RN_ROWS;
        rms_rows(x + r0 * n, y + r0 * n, rows - r0 < RN_ROWS ? (int)(rows - r0) : RN_ROWS, n, w, eps);
    }
}

/* ur_rms_norm with x in any of the three dtypes and y in float32 or bfloat16 (ydt), the
   conversions inside the one call; with res (ydt, [rows, n]), y = res + the norm rounded
   to ydt, the sum rounded to ydt (a residual add: torch's add of the two, in one call).
   A few rows at a time through a small buffer (a buffer the size of the call's rows,
   allocated each call, cost more in page faults than the norm itself). */
void ur_rms_norm_io(const void *x, int xdt, void *y, int ydt, int64_t rows, int64_t n, const float *w, float eps,
                    const void *res, int nt) {
    if (xdt == DT_F32 && ydt == DT_F32 && !res) {
        ur_rms_norm((const float *)x, (float *)y, rows, n, w, eps, nt);
        return;
    }
    const int64_t groups = (rows + RN_ROWS - 1) / RN_ROWS;
#pragma omp parallel num_threads(nt) if (nt > 1 && rows * n > 65536)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(RN_ROWS * n > 0 ? RN_ROWS * n : 1));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = g * RN_ROWS, nr = rows - r0 < RN_ROWS ? rows - r0 : RN_ROWS, e0 = r0 * n, ne = nr * n;
            to_f32((const char *)x + e0 * elem_size(xdt), xdt, buf, ne);
            rms_rows(buf, buf, (int)nr, n, w, eps);
            if (ydt == DT_F32) {
                float *yo = (float *)y + e0;
                if (res) for (int64_t i = 0; i < ne; i++) yo[i] = ((const float *)res)[e0 + i] + buf[i];
                else memcpy(yo, buf, sizeof(float) * (size_t)ne);
            } else if (res) {
                add_rows_bf16((const uint16_t *)res + e0, buf, (uint16_t *)y + e0, ne);
            } else {
                rows_to_bf16(buf, 0, (uint16_t *)y + e0, 0, 1, ne);
            }
        }
        free(buf);
    }
}

/* RoPE: y [rows, heads, d] = x (dtype dt, both contiguous; y may be x) with the first rot
   dims of each head rotated, x c + roll(x, rot / 2) s, where c and s (the sin with its
   first half negated) are row r's [rot] values in dt; each product and the sum rounded
   to dt as torch's three ops round them; the dims past rot copied (partial RoPE). */
static inline float round_to(float v, int dt) { return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }
static inline void store_elem(void *p, int dt, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* o[i] = round(xa[i] c[i]) + round(xb[i] s[i]) for i < n, each product rounded to dt (the
   sum rounded when stored) */
static inline void rope_span(const float *xa, const float *xb, const float *c, const float *s, float *o, int64_t n,
                             int dt) {
    int64_t i = 0;
#if defined(UR_AVX512)
    if (dt == DT_BF16)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(o + i, _mm512_add_ps(
                bf16r16(_mm512_mul_ps(_mm512_loadu_ps(xa + i), _mm512_loadu_ps(c + i))),
                bf16r16(_mm512_mul_ps(_mm512_loadu_ps(xb + i), _mm512_loadu_ps(s + i)))));
#endif
    for (; i < n; i++) o[i] = round_to(xa[i] * c[i], dt) + round_to(xb[i] * s[i], dt);
}

void ur_rope(const void *x, void *y, int dt, int64_t rows, int64_t heads, int64_t d, int64_t rot, const void *cs,
             const void *sn) {
    const int64_t half = rot / 2;
    float stack[4 * 512], *buf = d <= 512 ? stack : (float *)malloc(sizeof(float) * (size_t)(4 * d));
    float *c = buf + d, *s = c + d, *o = s + d;
    for (int64_t r = 0; r < rows; r++) {
        to_f32((const char *)cs + r * rot * elem_size(dt), dt, c, rot);
        to_f32((const char *)sn + r * rot * elem_size(dt), dt, s, rot);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t off = (r * heads + h) * d;
            to_f32((const char *)x + off * elem_size(dt), dt, buf, d);
            rope_span(buf, buf + half, c, s, o, half, dt);                          /* x c + x[i + half] s */
            rope_span(buf + half, buf, c + half, s + half, o + half, rot - half, dt);  /* x c + x[i - half] s */
            memcpy(o + rot, buf + rot, sizeof(float) * (size_t)(d - rot));
            if (dt == DT_BF16) rows_to_bf16(o, 0, (uint16_t *)y + off, 0, 1, d);
            else memcpy((float *)y + off, o, sizeof(float) * (size_t)d);
        }
    }
    if (buf != stack) free(buf);
}

enum { EW_EXP = 0, EW_SIGMOID, EW_SILU, EW_SOFTPLUS, EW_GELU_TANH, EW_TANH };

/* y[i] = f(x[i]) for n contiguous float32 elements (y may be x). */
void ur_elementwise(int op, const float *x, float *y, int64_t n, float param, int nt) {
    const int64_t block = 1 << 14;
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
        switch (op) {
#define LOOP(F) for (int64_t i = lo; i < hi; i++) y[i] = F(x[i], param); break
        case EW_EXP: LOOP(f_exp);
        case EW_SIGMOID: LOOP(f_sigmoid);
        case EW_SILU: LOOP(f_silu);
        case EW_SOFTPLUS: LOOP(f_softplus);
        case EW_GELU_TANH: LOOP(f_gelu_tanh);
        case EW_TANH: LOOP(f_tanh);
#undef LOOP
        }
    }
}

/* ur_elementwise over x in any of the three dtypes, y in float32 or bfloat16 (rounded as
   torch's .to() rounds), the conversions inside the one call, block by block. */
void ur_elementwise_io(int op, const void *x, int xdt, void *y, int ydt, int64_t n, float param, int nt) {
    const int64_t block = 4096;
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && blocks > 4)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * block, m = lo + block < n ? block : n - lo;
        float f[4096];
        to_f32((const char *)x + lo * elem_size(xdt), xdt, f, m);
        ur_elementwise(op, f, f, m, param, 1);
        if (ydt == DT_BF16) rows_to_bf16(f, 0, (uint16_t *)y + lo, 0, 1, m);
        else memcpy((float *)y + lo, f, sizeof(float) * (size_t)m);
    }
}

/* A gated unit's product, y = f(g) * u, over `rows` rows of n (g and u rows ldg and ldu
   elements apart, y contiguous), all three in dtype dt (float32 or bfloat16): f(g) as
   ur_elementwise_io computes it (rounded to dt), times u, the product rounded to dt; the
   bits of the two calls torch makes of it (the activation, then the multiply: a product
   of two bfloat16 values is exact in float32, so its one rounding is the multiply's),
   in one pass where they took two and a copy of a strided g. */
void ur_act_mul(int op, const void *g, int64_t ldg, const void *u, int64_t ldu, int dt, void *y, int64_t rows,
                int64_t n, float param, int nt) {
    const int64_t block = 4096;
    const int64_t per = (n + block - 1) / block, blocks = rows * per;
    const size_t es = (size_t)elem_size(dt);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && blocks > 4)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r = b / per, lo = (b % per) * block, m = lo + block < n ? block : n - lo;
        float f[4096], v[4096];
        to_f32((const char *)g + (r * ldg + lo) * es, dt, f, m);
        ur_elementwise(op, f, f, m, param, 1);
        to_f32((const char *)u + (r * ldu + lo) * es, dt, v, m);
        if (dt == DT_BF16) {
            uint16_t h[4096];
            rows_to_bf16(f, 0, h, 0, 1, m);   /* f(g) rounded, as the activation's output is */
            to_f32(h, DT_BF16, f, m);
            for (int64_t i = 0; i < m; i++) f[i] = f[i] * v[i];
            rows_to_bf16(f, 0, (uint16_t *)y + r * n + lo, 0, 1, m);
        } else {
            float *yo = (float *)y + r * n + lo;
            for (int64_t i = 0; i < m; i++) yo[i] = f[i] * v[i];
        }
    }
}

/* ------------------------------------------------------------------------ attention */

/* Eight floats of a row in dtype dt as a vector (lane l: element l). */
#if defined(UR_AVX2) || defined(UR_AVX512)
typedef __m256 v8;
static inline v8 load8(const void *p, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
static inline v8 v8_zero(void) { return _mm256_setzero_ps(); }
static inline v8 v8_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline void v8_store(float *p, v8 v) { _mm256_storeu_ps(p, v); }
#else
typedef struct { float v[8]; } v8;
static inline v8 load8(const void *p, int dt) { v8 r; for (int l = 0; l < 8; l++) r.v[l] = load_elem(p, dt, l); return r; }
static inline v8 v8_zero(void) { v8 r; for (int l = 0; l < 8; l++) r.v[l] = 0.0f; return r; }
static inline v8 v8_fma(v8 a, v8 b, v8 c) { v8 r; for (int l = 0; l < 8; l++) r.v[l] = fmaf(a.v[l], b.v[l], c.v[l]); return r; }
static inline void v8_store(float *p, v8 v) { memcpy(p, v.v, 32); }
#endif

/* dot(a, b) over d, the one order every score is computed in: lane l of eight chains of
   fused multiply-adds takes the elements i = l (mod 8) in index order; the lanes are
   summed pairwise, ((0+1)+(2+3))+((4+5)+(6+7)); then the tail (d mod 8) in order. b in
   dtype dt. dots() computes up to MAXQ such products against one b at once. */
static inline float lanes_sum(v8 acc) {
    float t[8];
    v8_store(t, acc);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

#define MAXQ 8     /* queries dots() takes at once (its chains in registers) */
#define QBLOCK 64  /* queries a block of rows takes: the keys read once for all of them */

static inline void dots(const float *const *a, int nq, const void *b, int dt, int64_t d, float *out) {
    v8 acc[MAXQ];
    for (int q = 0; q < nq; q++) acc[q] = v8_zero();
    const int64_t es = elem_size(dt);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        v8 bv = load8((const char *)b + i * es, dt);
        for (int q = 0; q < nq; q++) acc[q] = v8_fma(load8(a[q] + i, DT_F32), bv, acc[q]);
    }
    for (int q = 0; q < nq; q++) {
        float s = lanes_sum(acc[q]);
        for (int64_t t = i; t < d; t++) s = fmaf(a[q][t], load_elem(b, dt, t), s);
        out[q] = s;
    }
}

#if defined(UR_AVX512)
/* dots() against two keys at once, b0's chains in lanes 0-7 and b1's in lanes 8-15 of one
   vector, each lane the chain dots() keeps in it and the lanes summed in the same tree
   (pairs, then pairs of pairs, then the halves: IEEE addition commutes), so each score is
   the same bits; half the instructions, and twice the chains in flight. */
static inline __m512 load8x2(const void *b0, const void *b1, int dt) {
    if (dt == DT_F32) return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)b0)),
                                                _mm256_loadu_ps((const float *)b1), 1);
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)b0)),
                                              _mm_loadu_si128((const __m128i *)b1), 1);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

static inline float half_sum(__m512 v, int upper) {
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));   /* lane 2m: (2m) + (2m + 1) */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));   /* lane 4m: its pairs of pairs */
    v = _mm512_add_ps(v, _mm512_castpd_ps(_mm512_permutex_pd(_mm512_castps_pd(v), _MM_SHUFFLE(1, 0, 3, 2))));
    return upper ? _mm512_cvtss_f32(_mm512_castps256_ps512(_mm512_extractf32x8_ps(v, 1))) : _mm512_cvtss_f32(v);
}

/* Scores of up to MAXQ queries against keys b[0 .. 4) (nb of them, 2 or 4) into
   out[k * MAXQ + q]: eight chains a query in flight with four keys. */
static inline __attribute__((always_inline)) void dots4_n(
        const int nq, const float *const *a, const char *const *b, const int nb, int dt, int64_t d, float *out) {
    __m512 acc[MAXQ][2];
    const int np = nb / 2;
    for (int q = 0; q < nq; q++) acc[q][0] = acc[q][1] = _mm512_setzero_ps();
    const int64_t es = elem_size(dt);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        __m512 bv[2];
        for (int p = 0; p < np; p++) bv[p] = load8x2(b[2 * p] + i * es, b[2 * p + 1] + i * es, dt);
        for (int q = 0; q < nq; q++) {
            const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(a[q] + i));
            for (int p = 0; p < np; p++) acc[q][p] = _mm512_fmadd_ps(qv, bv[p], acc[q][p]);
        }
    }
    for (int q = 0; q < nq; q++)
        for (int k = 0; k < nb; k++) {
            float v = half_sum(acc[q][k / 2], k % 2);
            for (int64_t t = i; t < d; t++) v = fmaf(a[q][t], load_elem(b[k], dt, t), v);
            out[k * MAXQ + q] = v;
        }
}

/* Scores of up to 4 queries against eight keys b[0 .. 8) into out[k * MAXQ + q]: the
   chains of dots4_n, four vectors a query, and the eight keys' lanes summed together by
   one network of shuffles and adds that makes exactly lanes_sum's tree: pairs (lane 2m
   and 2m + 1), then pairs of pairs, then the two halves of the eight (each addition the
   same two operands as lanes_sum's; IEEE addition commutes). */
static inline __attribute__((always_inline)) void dots8_n(
        const int nq, const float *const *a, const char *const *b, int dt, int64_t d, float *out) {
    __m512 acc[4][4];
    for (int q = 0; q < nq; q++)
        for (int p = 0; p < 4; p++) acc[q][p] = _mm512_setzero_ps();
    const int64_t es = elem_size(dt);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        __m512 bv[4];
        for (int p = 0; p < 4; p++) bv[p] = load8x2(b[2 * p] + i * es, b[2 * p + 1] + i * es, dt);
        for (int q = 0; q < nq; q++) {
            const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(a[q] + i));
            for (int p = 0; p < 4; p++) acc[q][p] = _mm512_fmadd_ps(qv, bv[p], acc[q][p]);
        }
    }
    for (int q = 0; q < nq; q++) {
        /* acc[q][p]: key 2p's eight lanes in the lower half, key 2p + 1's in the upper;
           each 128-bit quarter four of one key's lanes */
        const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(acc[q][0], acc[q][1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_ps(acc[q][0], acc[q][1], _MM_SHUFFLE(3, 1, 3, 1)));
        const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(acc[q][2], acc[q][3], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_ps(acc[q][2], acc[q][3], _MM_SHUFFLE(3, 1, 3, 1)));
        const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
        /* x's quarters: keys 0, 2, 4, 6 lanes 0-3 | the same keys' lanes 4-7 | keys 1, 3, 5, 7
           lanes 0-3 | their lanes 4-7 */
        const __m512 y = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
        float t[16];
        _mm512_storeu_ps(t, y);
        for (int k = 0; k < 8; k++) {
            float v = t[(k % 2) * 8 + k / 2];
            for (int64_t u = i; u < d; u++) v = fmaf(a[q][u], load_elem(b[k], dt, u), v);
            out[k * MAXQ + q] = v;
        }
    }
}

/* dots8_n over up to MAXQ queries, four at a time, the count a constant */
static inline void dots8(const float *const *a, int nq, const char *const *b, int dt, int64_t d, float *out) {
    for (int q0 = 0; q0 < nq; q0 += 4) {
        switch (nq - q0) {
        case 1: dots8_n(1, a + q0, b, dt, d, out + q0); break;
        case 2: dots8_n(2, a + q0, b, dt, d, out + q0); break;
        case 3: dots8_n(3, a + q0, b, dt, d, out + q0); break;
        default: dots8_n(4, a + q0, b, dt, d, out + q0); break;
        }
    }
}

/* dots4_n with the query count a constant (its chains stay in registers) */
static inline void dots4(const float *const *a, int nq, const char *const *b, int nb, int dt, int64_t d,
                         float *out) {
#define D(Q) (nb == 4 ? dots4_n(Q, a, b, 4, dt, d, out) : dots4_n(Q, a, b, 2, dt, d, out))
    switch (nq) {
    case 1: D(1); return; case 2: D(2); return; case 3: D(3); return; case 4: D(4); return;
    case 5: D(5); return; case 6: D(6); return; case 7: D(7); return; default: D(8); return;
    }
#undef D
}
#endif

#if defined(UR_AVX512)
/* Scores of 2 * NP queries against NK float32 keys b[0 .. NK) into out[k * MAXQ + q], from
   the queries packed in pairs (pq: pair p's chunk c at pq + (p * d / 8 + c) * 16, query
   2p's 8 elements then 2p + 1's): each key's 8 elements broadcast to both halves (a load,
   no shuffle), so a vector holds two queries' chains against one key, each lane the chain
   dots() keeps in it, and the lanes summed by dots8_n's network with the queries in the
   keys' place: the same bits as dots(). */
static inline __attribute__((always_inline)) void dots_pairs_n(
        const int NP, const int NK, const float *pq, const char *const *b, int64_t d, float *out) {
    __m512 acc[4][8];
    for (int p = 0; p < NP; p++)
        for (int k = 0; k < NK; k++) acc[p][k] = _mm512_setzero_ps();
    const int64_t d8 = d / 8;
    for (int64_t c = 0; c < d8; c++) {
        __m512 bv[8];
        for (int k = 0; k < NK; k++) bv[k] = _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)b[k] + c * 8));
        for (int p = 0; p < NP; p++) {
            const __m512 qv = _mm512_load_ps(pq + (p * d8 + c) * 16);
            for (int k = 0; k < NK; k++) acc[p][k] = _mm512_fmadd_ps(qv, bv[k], acc[p][k]);
        }
    }
    for (int k = 0; k < NK; k++) {
        float t[16];
        if (NP == 4) {
            const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(acc[0][k], acc[1][k], _MM_SHUFFLE(2, 0, 2, 0)),
                                            _mm512_shuffle_ps(acc[0][k], acc[1][k], _MM_SHUFFLE(3, 1, 3, 1)));
            const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(acc[2][k], acc[3][k], _MM_SHUFFLE(2, 0, 2, 0)),
                                            _mm512_shuffle_ps(acc[2][k], acc[3][k], _MM_SHUFFLE(3, 1, 3, 1)));
            const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                           _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
            const __m512 y = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
            _mm512_storeu_ps(t, y);
            for (int q = 0; q < 8; q++) out[k * MAXQ + q] = t[(q % 2) * 8 + q / 2];
        } else {
            for (int p = 0; p < NP; p++) {
                out[k * MAXQ + 2 * p] = half_sum(acc[p][k], 0);
                out[k * MAXQ + 2 * p + 1] = half_sum(acc[p][k], 1);
            }
        }
    }
}
#endif

/* PV_GROUPS column groups (PV_GROUPS NR columns from a[0]) of qn queries' output chains
   (rows d apart, their weights p rows w apart) over the values of keys [ja, jb), in key
   order: a value row's columns read together, the chains in registers. */
#if defined(UR_AVX512)
#define PV_GROUPS 4
#else
#define PV_GROUPS 1
#endif
static inline __attribute__((always_inline)) void pvg(
        const int qn, float *a, int64_t d, const float *p, int64_t w, const char *vb, const int64_t *sl,
        int64_t slot_bytes, int64_t es, const int dt, int64_t ja, int64_t jb) {
    wvec a4[4][PV_GROUPS];
    for (int qi = 0; qi < qn; qi++)
        for (int h = 0; h < PV_GROUPS; h++) a4[qi][h] = wloadf(a + qi * d + h * NR, NR);
    for (int64_t j = ja; j < jb; j++) {
        const char *vr = vb + sl[j] * slot_bytes;
        wvec v[PV_GROUPS];
        for (int h = 0; h < PV_GROUPS; h++) v[h] = wload(vr + h * NR * es, dt);
        for (int qi = 0; qi < qn; qi++) {
            const float pj = p[qi * w + j];
            for (int h = 0; h < PV_GROUPS; h++) a4[qi][h] = WV_FMA(pj, v[h], a4[qi][h]);
        }
    }
    for (int qi = 0; qi < qn; qi++)
        for (int h = 0; h < PV_GROUPS; h++) wstore(a + qi * d + h * NR, a4[qi][h], NR);
}

/* keys a tile: read from memory once for all the queries of a block */
#define KTILE 64
#define KAHEAD 8   /* keys ahead whose rows are asked for while this one is read (prefetch_row: 1.3-1.6x
                      faster at 8k keys than without, measured on an AVX-512 machine) */

/* A block's keys and queries: rows [r0, r1) x heads h0 .. h0 + hn of KV head kh (G heads a
   KV head). The keys [lo, lo + n) any of its rows sees (*lo); each query's row, head and
   span of those keys [qa, qb). Returns n. */
static int64_t block_queries(const int64_t *first, const int64_t *count, int64_t r0, int64_t r1, int64_t G,
                             int64_t kh, int64_t h0, int64_t hn, int64_t *lo_, int64_t *qr, int64_t *qh, int64_t *qa,
                             int64_t *qb) {
    int64_t lo = first[r0], hi = first[r0] + count[r0];
    for (int64_t r = r0 + 1; r < r1; r++) {
        lo = first[r] < lo ? first[r] : lo;
        hi = first[r] + count[r] > hi ? first[r] + count[r] : hi;
    }
    for (int qi = 0; qi < (int)((r1 - r0) * hn); qi++) {
        qr[qi] = r0 + qi / hn;
        qh[qi] = kh * G + h0 + qi % hn;
        qa[qi] = first[qr[qi]] - lo;
        qb[qi] = qa[qi] + count[qr[qi]];
    }
    *lo_ = lo;
    return hi - lo;
}

/* The softmax of a block's scores (sc, rows ws apart, keys [0, n)): each query's maximum
   (exact in any order: lanes of partial maxima), its exponentials (elementwise), their
   sum in key order (the queries' sums side by side: independent chains; a key a query
   does not see adds a zero, which leaves it as it was); the weights left unnormalised in
   sc (zero outside a query's span [qa, qb), through column pad - 1), 1 / their sum in
   inv. */
static void softmax_block(float *sc, int nq, int64_t ws, int64_t n, int64_t pad, const int64_t *qa, const int64_t *qb,
                          const int64_t *qh, const float *sinks, float *inv) {
    float mxs[QBLOCK], ls[QBLOCK];
    for (int qi = 0; qi < nq; qi++) {
        const float *s = sc + qi * ws;
        float m[16];
        for (int l = 0; l < 16; l++) m[l] = -INFINITY;
        int64_t j = qa[qi];
        for (; j + 16 <= qb[qi]; j += 16)
            for (int l = 0; l < 16; l++) m[l] = s[j + l] > m[l] ? s[j + l] : m[l];
        float mx = -INFINITY;
        for (; j < qb[qi]; j++) mx = s[j] > mx ? s[j] : mx;
        for (int l = 0; l < 16; l++) mx = m[l] > mx ? m[l] : mx;
        const float sink = sinks ? sinks[qh[qi]] : -INFINITY;
        mxs[qi] = sink > mx ? sink : mx;
    }
    for (int qi = 0; qi < nq; qi++) {
        float *s = sc + qi * ws;
        const float mx = mxs[qi];
        const int64_t a = qa[qi], b = qb[qi];
        for (int64_t j = 0; j < a; j++) s[j] = 0.0f;
        for (int64_t j = a; j < b; j++) s[j] = ur_expf(s[j] - mx);
        for (int64_t j = b; j < pad; j++) s[j] = 0.0f;
        ls[qi] = 0.0f;
    }
    for (int64_t j = 0; j < n; j++)
        for (int qi = 0; qi < nq; qi++) ls[qi] += sc[qi * ws + j];
    for (int qi = 0; qi < nq; qi++) {
        float l = ls[qi];
        if (sinks) l += ur_expf(sinks[qh[qi]] - mxs[qi]);
        inv[qi] = 1.0f / l;
    }
}

/* Each group of 4 queries' span of keys: [ja4, jb4) over the keys any of them sees; with
   `pairs`, widened to whole pairs of keys from the block's first (to n + 1 where n is odd:
   the pad, weight 0). */
static void spans4(int nq, const int64_t *qa, const int64_t *qb, int pairs, int64_t *ja4, int64_t *jb4) {
    for (int q0 = 0; q0 < nq; q0 += 4) {
        const int qn = nq - q0 < 4 ? nq - q0 : 4;
        int64_t ja = qa[q0], jb = qb[q0];
        for (int qi = q0 + 1; qi < q0 + qn; qi++) {
            ja = qa[qi] < ja ? qa[qi] : ja;
            jb = qb[qi] > jb ? qb[qi] : jb;
        }
        ja4[q0 / 4] = pairs ? ja & ~(int64_t)1 : ja;
        jb4[q0 / 4] = pairs ? (jb + 1) & ~(int64_t)1 : jb;
    }
}

/* out = P V for a block (attend_block's, and the bfloat16 one's off AVX512-BF16): a tile of
   keys at a time; in it NR columns at a time, up to 4 queries at a time, over the keys
   [ja4, jb4) the 4 see (their chains start at the first of those keys), the last tile
   through key end - 1 (n, or n + 1 with a pad key); acc [nq, d]. */
static inline __attribute__((always_inline)) void pv_block(
    int nq, int64_t d, int64_t n, int64_t end, const float *sc, int64_t widest, const int64_t *ja4, const int64_t *jb4,
    const char *vb, const int64_t *sl, int64_t slot_bytes, int64_t row_bytes, int64_t es, const int dt, float *acc) {
    for (int qi = 0; qi < nq; qi++)
        for (int64_t c = 0; c < d; c++) acc[qi * d + c] = 0.0f;
    for (int64_t j = 0; j < (KTILE < n ? KTILE : n); j++) prefetch_row(vb + sl[j] * slot_bytes, row_bytes);
    for (int64_t t0 = 0; t0 < n; t0 += KTILE) {
        /* the last tile takes the pad key n where the spans were rounded to pairs */
        const int64_t t1 = t0 + KTILE < n ? t0 + KTILE : end;
        for (int64_t j = t1; j < (t1 + KTILE < n ? t1 + KTILE : n); j++)  /* the next tile's values */
            prefetch_row(vb + sl[j] * slot_bytes, row_bytes);
        /* a span of columns at a time, every query group over it: the span's slice of the
           tile's values (16 KB in float32 at 64 keys) stays in the first-level cache for
           all the groups (each chain's operations are the same in any loop order) */
        for (int64_t c0 = 0; c0 < d;) {
            const int64_t span = d - c0 >= PV_GROUPS * NR ? PV_GROUPS * NR : NR;
            for (int q0 = 0; q0 < nq; q0 += 4) {
                const int qn = nq - q0 < 4 ? nq - q0 : 4;
                const int64_t ja = ja4[q0 / 4] > t0 ? ja4[q0 / 4] : t0, jb = jb4[q0 / 4] < t1 ? jb4[q0 / 4] : t1;
                if (ja >= jb) continue;
                const int nc = d - c0 >= NR ? NR : (int)(d - c0);
                if (d - c0 >= PV_GROUPS * NR) {  /* column groups side by side: more chains in flight */
                    float *a0 = acc + q0 * d + c0;
                    const float *p0 = sc + q0 * widest;
                    const char *v0 = vb + c0 * es;
                    switch (qn) {
                    case 4: pvg(4, a0, d, p0, widest, v0, sl, slot_bytes, es, dt, ja, jb); break;
                    case 3: pvg(3, a0, d, p0, widest, v0, sl, slot_bytes, es, dt, ja, jb); break;
                    case 2: pvg(2, a0, d, p0, widest, v0, sl, slot_bytes, es, dt, ja, jb); break;
                    default: pvg(1, a0, d, p0, widest, v0, sl, slot_bytes, es, dt, ja, jb); break;
                    }
                } else if (nc == NR) {
                    wvec a4[4];
                    for (int qi = 0; qi < qn; qi++) a4[qi] = wloadf(acc + (q0 + qi) * d + c0, NR);
                    for (int64_t j = ja; j < jb; j++) {
                        wvec v = wload(vb + sl[j] * slot_bytes + c0 * es, dt);
                        for (int qi = 0; qi < qn; qi++)
                            a4[qi] = WV_FMA(sc[(q0 + qi) * widest + j], v, a4[qi]);
                    }
                    for (int qi = 0; qi < qn; qi++) wstore(acc + (q0 + qi) * d + c0, a4[qi], NR);
                } else {
                    for (int qi = 0; qi < qn; qi++) {
                        float *a = acc + (q0 + qi) * d + c0;
                        for (int c = 0; c < nc; c++) {
                            float x = a[c];
                            for (int64_t j = ja; j < jb; j++)
                                x = fmaf(sc[(q0 + qi) * widest + j], load_elem(vb + sl[j] * slot_bytes, dt, c0 + c), x);
                            a[c] = x;
                        }
                    }
                }
            }
            c0 += span;
        }
    }
}

/* One block of rows against KV head kh (ur_attention's body; dt a constant here, so the
   inner loops have no branch). The keys go by in tiles of KTILE: each tile's keys and
   values are read from memory once for all the block's queries (up to QBLOCK of them),
   and each query's chains carry on from one tile to the next exactly as they would over
   all its keys at once (an output chain is kept in `acc` between tiles). */

#if defined(UR_AVX512)
/* Blocks of at least PT_MINQ queries (a verify step's or a prefill chunk's rows times
   the heads a KV head serves) take their scores with the keys transposed, 16 a vector;
   a head of at most PT_MAXD elements (the transposed keys' scratch) */
#define PT_MINQ 16
#define PT_MAXD 512

/* r[m] lane k <- r[k] lane m, for 16 vectors of 16 int32 (a pair of bfloat16 each) */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* b[4i + e], 128-bit quarter q: element 4q + e of rows 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x88), d0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xDD);
        const __m512i c1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x88),
                      d1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xDD);
        r[e] = _mm512_shuffle_i32x4(c0, c1, 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(c0, c1, 0xDD);
        r[4 + e] = _mm512_shuffle_i32x4(d0, d1, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(d0, d1, 0xDD);
    }
}


/* 16 elements of a key row in dtype dt, as float32 (16-bit ones convert exactly);
   DT_F32 also reads 16 bfloat16 pairs as they lie (64 bytes, no conversion) */
static inline __m512i load16(const char *p, int dt) {
    if (dt == DT_F32) return _mm512_loadu_si512(p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dt == DT_BF16) return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    return _mm512_castps_si512(_mm512_cvtph_ps(h));
}

/* The key tile [j, j + 16) of a block's keys (slots sl, rows slot_bytes apart from kb):
   their rows into b (past the tile's end t1 its last key again, a score not kept),
   asking for the rows KAHEAD keys on (n keys in all); then their `chunks` runs of 16
   elements (of dtype dt, `chunk` bytes each) transposed into kt, 16 keys a line. */
static void keys_t(const char *kb, const int64_t *sl, int64_t j, int64_t t1, int64_t n, int64_t slot_bytes,
                   int64_t row_bytes, int dt, int64_t chunks, int64_t chunk, void *kt) {
    const char *b[16];
    for (int k = 0; k < 16; k++) {
        b[k] = kb + sl[j + k < t1 ? j + k : t1 - 1] * slot_bytes;
        if (j + k < t1 && j + k + KAHEAD < n) prefetch_row(kb + sl[j + k + KAHEAD] * slot_bytes, row_bytes);
    }
    for (int64_t c = 0; c < chunks; c++) {
        __m512i r[16];
        for (int k = 0; k < 16; k++) r[k] = load16(b[k] + c * chunk, dt);
        transpose16_epi32(r);
        for (int m = 0; m < 16; m++) _mm512_store_si512((int32_t *)kt + (16 * c + m) * 16, r[m]);
    }
}

/* Q float32 queries' scores against 16 keys transposed (kt: element e of key k at
   kt[e * 16 + k]), times the scale, lanes 0 .. kn - 1 into s[q * ws + k]: dots()'
   arithmetic, a lane a key. A query's chain l (elements 8c + l, c in order) is its own
   vector of 16 keys; the 8 chains are summed by lanes_sum's additions, whole vectors at a
   time, four chains a pass so that each key line serves the Q queries. d a multiple of 8. */
static inline __attribute__((always_inline)) void scores_t_n(
        const int Q, const float *const *qp, const float *kt, int64_t d, float scale, float *s, int64_t ws, int kn) {
    __m512 half[4][2];
    for (int h = 0; h < 2; h++) {
        __m512 acc[4][4];
        for (int q = 0; q < Q; q++)
            for (int i = 0; i < 4; i++) acc[q][i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d / 8; c++)
            for (int i = 0; i < 4; i++) {
                const int64_t e = 8 * c + 4 * h + i;
                const __m512 kv = _mm512_load_ps(kt + e * 16);
                for (int q = 0; q < Q; q++) acc[q][i] = _mm512_fmadd_ps(_mm512_set1_ps(qp[q][e]), kv, acc[q][i]);
            }
        for (int q = 0; q < Q; q++)
            half[q][h] = _mm512_add_ps(_mm512_add_ps(acc[q][0], acc[q][1]), _mm512_add_ps(acc[q][2], acc[q][3]));
    }
    const __mmask16 m = (__mmask16)((1u << kn) - 1u);
    for (int q = 0; q < Q; q++)
        _mm512_mask_storeu_ps(s + q * ws, m, _mm512_mul_ps(_mm512_add_ps(half[q][0], half[q][1]), _mm512_set1_ps(scale)));
}

/* nq queries' scores against 16 keys transposed (keys_t), the first kn kept, four
   queries at a time */
static void scores_t(const float *const *qp, int nq, const float *kt, int64_t d, float scale, float *s, int64_t ws,
                     int kn) {
    for (int q0 = 0; q0 < nq; q0 += 4) {
        switch (nq - q0) {
        case 1: scores_t_n(1, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        case 2: scores_t_n(2, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        case 3: scores_t_n(3, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        default: scores_t_n(4, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        }
    }
}
#endif

static inline __attribute__((always_inline)) void attend_block(
    const void *qv, int64_t H, int64_t d, const void *kpool, const void *vpool, const int dt, int64_t G,
    const int64_t *slots, const int64_t *first, const int64_t *count, float scale, const float *sinks, float *out,
    int64_t r0, int64_t r1, int64_t kh, int64_t h0, int64_t hn, float *sc, int64_t widest, float *acc, float *pq) {
    const float *q = (const float *)qv;
    const int64_t es = elem_size(dt), slot_bytes = (H / G) * d * es;
    int64_t lo, qa[QBLOCK], qb[QBLOCK], qh[QBLOCK], qr[QBLOCK];
    const int64_t n = block_queries(first, count, r0, r1, G, kh, h0, hn, &lo, qr, qh, qa, qb);
    const int nq = (int)((r1 - r0) * hn);
    const float *qp[QBLOCK];
    float inv[QBLOCK];
    for (int qi = 0; qi < nq; qi++) qp[qi] = q + (qr[qi] * H + qh[qi]) * d;
    const char *kb = (const char *)kpool + kh * d * es, *vb = (const char *)vpool + kh * d * es;
    const int64_t *sl = slots + lo;
    const int64_t row_bytes = d * es;
    float tmp[MAXQ];
#if defined(UR_AVX512)
    /* many queries: the keys transposed, 16 at a time, for all of them (scores_t_n) */
    const int transposed = nq >= PT_MINQ && d % 16 == 0 && d <= PT_MAXD;
    const int paired = !transposed && dt == DT_F32 && d % 8 == 0;   /* float32 keys: queries packed in pairs */
    if (paired)
        for (int qi = 0; qi < nq + (nq & 1); qi++)
            for (int64_t c = 0; c < d / 8; c++)
                for (int l = 0; l < 8; l++)
                    pq[((qi / 2) * (d / 8) + c) * 16 + (qi % 2) * 8 + l] = qi < nq ? qp[qi][c * 8 + l] : 0.0f;
#endif
    for (int64_t t0 = 0; t0 < n; t0 += KTILE) {
        const int64_t t1 = t0 + KTILE < n ? t0 + KTILE : n;
#if defined(UR_AVX512)
        if (transposed) {
            _Alignas(64) float kt[PT_MAXD * 16];
            for (int64_t j = t0; j < t1; j += 16) {
                keys_t(kb, sl, j, t1, n, slot_bytes, row_bytes, dt, d / 16, 16 * es, kt);
                scores_t(qp, nq, kt, d, scale, sc + j, widest, (int)(t1 - j < 16 ? t1 - j : 16));
            }
            continue;
        }
#endif
        for (int g0 = 0; g0 < nq; g0 += MAXQ) {
            const int gn = nq - g0 < MAXQ ? nq - g0 : MAXQ;
            int64_t j = t0;
#if defined(UR_AVX512)
            if (paired) {
                const int np = (gn + 1) / 2, nk = np > 2 ? 4 : 8;
                const float *pg = pq + (g0 / 2) * (d / 8) * 16;
                for (float t8[8 * MAXQ]; j + nk <= t1; j += nk) {
                    const char *b[8];
                    for (int k = 0; k < nk; k++) {
                        b[k] = kb + sl[j + k] * slot_bytes;
                        if (g0 == 0 && j + k + KAHEAD < n) prefetch_row(kb + sl[j + k + KAHEAD] * slot_bytes, row_bytes);
                    }
                    switch (np) {
                    case 4: dots_pairs_n(4, 4, pg, b, d, t8); break;
                    case 3: dots_pairs_n(3, 4, pg, b, d, t8); break;
                    case 2: dots_pairs_n(2, 8, pg, b, d, t8); break;
                    default: dots_pairs_n(1, 8, pg, b, d, t8); break;
                    }
                    for (int k = 0; k < nk; k++)
                        for (int qi = 0; qi < gn; qi++) sc[(g0 + qi) * widest + j + k] = t8[k * MAXQ + qi] * scale;
                }
            }
            for (float t8[8 * MAXQ]; j + 8 <= t1; j += 8) {
                const char *b[8];
                for (int k = 0; k < 8; k++) {
                    b[k] = kb + sl[j + k] * slot_bytes;
                    if (g0 == 0 && j + k + KAHEAD < n) prefetch_row(kb + sl[j + k + KAHEAD] * slot_bytes, row_bytes);
                }
                dots8(qp + g0, gn, b, dt, d, t8);
                for (int k = 0; k < 8; k++)
                    for (int qi = 0; qi < gn; qi++) sc[(g0 + qi) * widest + j + k] = t8[k * MAXQ + qi] * scale;
            }
            for (float t4[4 * MAXQ]; j + 2 <= t1; ) {
                const int nb = j + 4 <= t1 ? 4 : 2;
                const char *b[4];
                for (int k = 0; k < nb; k++) {
                    b[k] = kb + sl[j + k] * slot_bytes;
                    if (g0 == 0 && j + k + KAHEAD < n) prefetch_row(kb + sl[j + k + KAHEAD] * slot_bytes, row_bytes);
                }
                dots4(qp + g0, gn, b, nb, dt, d, t4);
                for (int k = 0; k < nb; k++)
                    for (int qi = 0; qi < gn; qi++) sc[(g0 + qi) * widest + j + k] = t4[k * MAXQ + qi] * scale;
                j += nb;
            }
#endif
            for (; j < t1; j++) {
                if (g0 == 0 && j + KAHEAD < n) prefetch_row(kb + sl[j + KAHEAD] * slot_bytes, row_bytes);
                dots(qp + g0, gn, kb + sl[j] * slot_bytes, dt, d, tmp);
                for (int qi = 0; qi < gn; qi++) sc[(g0 + qi) * widest + j] = tmp[qi] * scale;
            }
        }
    }
    softmax_block(sc, nq, widest, n, n, qa, qb, qh, sinks, inv);
    int64_t ja4[QBLOCK / 4 + 1], jb4[QBLOCK / 4 + 1];
    spans4(nq, qa, qb, 0, ja4, jb4);
    pv_block(nq, d, n, n, sc, widest, ja4, jb4, vb, sl, slot_bytes, row_bytes, es, dt, acc);
    for (int qi = 0; qi < nq; qi++) {
        float *o = out + (qr[qi] * H + qh[qi]) * d;
        for (int64_t c = 0; c < d; c++) o[c] = acc[qi * d + c] * inv[qi];
    }
}

/* ---------------------------------------------- bfloat16 queries, keys and values

   Where a model runs in bfloat16 its queries, keys and values are bfloat16 values, and
   attention's products take VDPBF16PS where the CPU has AVX512-BF16 (twice the
   multiply-adds a cycle of float32 FMAs, no conversion), the same steps elsewhere:
   - a score: 16 lanes, lane l taking the pairs of elements (2i, 2i + 1), i = l (mod 16),
     in order, each pair's odd element's product first, then the even one's (a head's
     tail past a multiple of 32 elements as zero pairs); the lanes summed as a tree in
     lane order (pairs, pairs of pairs, ...); times the scale;
   - the weighted sum: each output column one chain of multiply-adds over the keys in key
     order, as attend_block's, of each weight rounded to bfloat16 (as torch's and flash
     attention's bfloat16 kernels round the softmax before it meets the values); the
     keys go in pairs from the block's first, so a span may start one key early or end
     one late (or at a pad key past the last), with weight 0;
   both in VDPBF16PS's mode (denormal inputs read as zero, denormal results flushed:
   pair_mode_on), the softmax between them in float32 exactly as attend_block's. */

/* the 16 lanes' tree: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), then the halves */
static inline float tree16(const float *t) {
    return (((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7])))
         + (((t[8] + t[9]) + (t[10] + t[11])) + ((t[12] + t[13]) + (t[14] + t[15])));
}

#if defined(UR_AVX512)
#if defined(UR_BF16DP)
static inline __m512 pdp(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#else
/* VDPBF16PS's steps in float32 FMAs (in pair_mode_on's mode) */
static inline __m512 pdp(__m512 acc, __m512i a, __m512i b) {
    const __m512i m = _mm512_set1_epi32((int)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, m)), _mm512_castsi512_ps(_mm512_and_si512(b, m)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}
#endif

/* per 128-bit quarter: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] */
static inline __m512 sum_pairs2(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
/* [x.Q0 + x.Q1, x.Q2 + x.Q3, y.Q0 + y.Q1, y.Q2 + y.Q3] over quarters */
static inline __m512 sum_quarters2(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
/* lane i: tree16 of v[i]'s lanes (the same additions; IEEE addition commutes) */
static inline __m512 tree16x16(const __m512 *v) {
    __m512 x[4];
    for (int g = 0; g < 4; g++)
        x[g] = sum_pairs2(sum_pairs2(v[4 * g], v[4 * g + 1]), sum_pairs2(v[4 * g + 2], v[4 * g + 3]));
    return sum_quarters2(sum_quarters2(x[0], x[1]), sum_quarters2(x[2], x[3]));
}

/* Scores of NQ bfloat16 queries a[q] against NK bfloat16 keys b[k] (NQ * NK <= 16), times
   the scale, into t[q * NK + k]: one vector of chains for each, the keys read once for all
   queries. */
static inline __attribute__((always_inline)) void pdots_n(
        const int NQ, const int NK, const uint16_t *const *a, const char *const *b, int64_t d, float scale, float *t) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        __m512i kv[16];
        for (int k = 0; k < NK; k++) kv[k] = _mm512_loadu_si512(b[k] + 2 * i);
        for (int q = 0; q < NQ; q++) {
            const __m512i qv = _mm512_loadu_si512(a[q] + i);
            for (int k = 0; k < NK; k++) acc[q * NK + k] = pdp(acc[q * NK + k], qv, kv[k]);
        }
    }
    if (i < d) {   /* the tail: zero pairs past d */
        uint16_t z[32];
        __m512i kv[16];
        for (int k = 0; k < NK; k++) {
            memset(z, 0, sizeof z);
            memcpy(z, b[k] + 2 * i, (size_t)(d - i) * 2);
            kv[k] = _mm512_loadu_si512(z);
        }
        for (int q = 0; q < NQ; q++) {
            memset(z, 0, sizeof z);
            memcpy(z, a[q] + i, (size_t)(d - i) * 2);
            const __m512i qv = _mm512_loadu_si512(z);
            for (int k = 0; k < NK; k++) acc[q * NK + k] = pdp(acc[q * NK + k], qv, kv[k]);
        }
    }
    _mm512_storeu_ps(t, _mm512_mul_ps(tree16x16(acc), _mm512_set1_ps(scale)));
}

/* Q queries' scores against 16 keys transposed (kt: pair p of key k at kt[p * 16 + k]),
   times the scale, lanes 0 .. kn - 1 into s[q * ws + k]: pdots_n's arithmetic, a lane a
   key. A query's chain l (pairs 16c + l, c in order) is its own vector of 16 keys; the
   16 chains are summed by tree16x16's additions, whole vectors at a time (no shuffles),
   four chains a pass so that each key line serves the Q queries. */
static inline __attribute__((always_inline)) void pscores_t_n(
        const int Q, const uint16_t *const *qp, const int32_t *kt, int64_t d, float scale, float *s, int64_t ws,
        int kn) {
    __m512 quad[4][4];
    for (int g = 0; g < 4; g++) {
        __m512 acc[4][4];
        for (int q = 0; q < Q; q++)
            for (int i = 0; i < 4; i++) acc[q][i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d / 32; c++)
            for (int i = 0; i < 4; i++) {
                const int64_t p = 16 * c + 4 * g + i;
                const __m512i kv = _mm512_load_si512(kt + p * 16);
                for (int q = 0; q < Q; q++) {
                    int32_t two;
                    memcpy(&two, qp[q] + 2 * p, 4);
                    acc[q][i] = pdp(acc[q][i], _mm512_set1_epi32(two), kv);
                }
            }
        for (int q = 0; q < Q; q++)
            quad[q][g] = _mm512_add_ps(_mm512_add_ps(acc[q][0], acc[q][1]), _mm512_add_ps(acc[q][2], acc[q][3]));
    }
    const __mmask16 m = (__mmask16)((1u << kn) - 1u);
    for (int q = 0; q < Q; q++) {
        const __m512 t = _mm512_add_ps(_mm512_add_ps(quad[q][0], quad[q][1]), _mm512_add_ps(quad[q][2], quad[q][3]));
        _mm512_mask_storeu_ps(s + q * ws, m, _mm512_mul_ps(t, _mm512_set1_ps(scale)));
    }
}

/* nq queries' scores against 16 keys' pairs transposed (keys_t), the first kn kept, four
   queries at a time */
static void pscores_t(const uint16_t *const *qp, int nq, const int32_t *kt, int64_t d, float scale, float *s,
                      int64_t ws, int kn) {
    for (int q0 = 0; q0 < nq; q0 += 4) {
        switch (nq - q0) {
        case 1: pscores_t_n(1, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        case 2: pscores_t_n(2, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        case 3: pscores_t_n(3, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        default: pscores_t_n(4, qp + q0, kt, d, scale, s + q0 * ws, ws, kn); break;
        }
    }
}
#elif defined(UR_AVX2)
/* A query's elements split once into its pairs' odd and even ones, as float32, 32 a chunk:
   [chunk][lanes 0-7's odd, their even, lanes 8-15's odd, their even] (zeros past d). */
static void psplit(const uint16_t *q, int64_t d, float *o) {
    for (int64_t c = 0; c < (d + 31) / 32; c++) {
        uint16_t z[32] = {0};
        memcpy(z, q + 32 * c, (size_t)(d - 32 * c < 32 ? d - 32 * c : 32) * 2);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 8; l++) {
                o[c * 32 + h * 16 + l] = bf16_to_f32(z[16 * h + 2 * l + 1]);
                o[c * 32 + h * 16 + 8 + l] = bf16_to_f32(z[16 * h + 2 * l]);
            }
    }
}

/* Scores of NQ queries (psplit's) against one bfloat16 key, times the scale, into
   out[q]: lanes 0-7 and 8-15 of each query's chains in two vectors, the key's pairs
   split once for all; each vector's lanes summed by hadd's pairs (lanes_sum's tree), the
   two halves added last (tree16). */
static inline __attribute__((always_inline)) void pdots_n(
        const int NQ, const float *const *qs, const uint16_t *k, int64_t d, float scale, float *out) {
    __m256 lo[4], hi[4];
    for (int q = 0; q < 4; q++) lo[q] = hi[q] = _mm256_setzero_ps();
    const __m256i m = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t c = 0; c < (d + 31) / 32; c++) {
        const uint16_t *kc = k + 32 * c;
        uint16_t z[32];
        if (32 * c + 32 > d) {   /* the tail: zero pairs past d */
            memset(z, 0, sizeof z);
            memcpy(z, kc, (size_t)(d - 32 * c) * 2);
            kc = z;
        }
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)kc), x1 = _mm256_loadu_si256((const __m256i *)(kc + 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(x0, m)), e0 = _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(x1, m)), e1 = _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16));
        for (int q = 0; q < NQ; q++) {
            const float *s = qs[q] + 32 * c;
            lo[q] = _mm256_fmadd_ps(_mm256_loadu_ps(s), o0, lo[q]);
            lo[q] = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8), e0, lo[q]);
            hi[q] = _mm256_fmadd_ps(_mm256_loadu_ps(s + 16), o1, hi[q]);
            hi[q] = _mm256_fmadd_ps(_mm256_loadu_ps(s + 24), e1, hi[q]);
        }
    }
    const __m256 hl = _mm256_hadd_ps(_mm256_hadd_ps(lo[0], lo[1]), _mm256_hadd_ps(lo[2], lo[3]));
    const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(hi[0], hi[1]), _mm256_hadd_ps(hi[2], hi[3]));
    const __m128 sl = _mm_add_ps(_mm256_castps256_ps128(hl), _mm256_extractf128_ps(hl, 1));
    const __m128 sh = _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1));
    _mm_storeu_ps(out, _mm_mul_ps(_mm_add_ps(sl, sh), _mm_set1_ps(scale)));
}
#else
/* one score's chains, one at a time (the scalar build) */
static float pdot(const uint16_t *a, const uint16_t *b, int64_t d) {
    float t[16];
    for (int l = 0; l < 16; l++) t[l] = 0.0f;
    for (int64_t i = 0; i < (d + 31) / 32 * 32; i += 2) {
        const int l = (int)((i / 2) % 16);
        const float ao = i + 1 < d ? bf16_to_f32(a[i + 1]) : 0.0f, bo = i + 1 < d ? bf16_to_f32(b[i + 1]) : 0.0f;
        const float ae = i < d ? bf16_to_f32(a[i]) : 0.0f, be = i < d ? bf16_to_f32(b[i]) : 0.0f;
        t[l] = fmaf(ao, bo, t[l]);
        t[l] = fmaf(ae, be, t[l]);
    }
    return tree16(t);
}
#endif

#if defined(UR_BF16DP)
/* P V by VDPBF16PS for qn queries over keys [ja, jb) (ja even from the block's first, jb
   too: a pair a step) and NS groups of 32 columns from vb: the pair's two value rows
   interleaved (key j in each dword's upper half, the instruction's first product),
   against the two weights in the same order (pp: a query's pairs, pw apart). The chains
   lie in acc permuted: a group's first vector holds columns 0-3, 8-11, 16-19, 24-27, its
   second 4-7, 12-15, 20-23, 28-31 (pv_pairs_store puts them back). */
static inline __attribute__((always_inline)) void pv_pairs(
        const int qn, const int NS, float *acc, int64_t dp, const int32_t *pp, int64_t pw, const char *vb,
        const int64_t *sl, int64_t slot_bytes, int64_t ja, int64_t jb, int64_t tail) {
    __m512 a[4][4];
    for (int q = 0; q < qn; q++)
        for (int h = 0; h < 2 * NS; h++) a[q][h] = _mm512_loadu_ps(acc + q * dp + 16 * h);
    for (int64_t j = ja; j < jb; j += 2) {
        const char *r0 = vb + sl[j] * slot_bytes, *r1 = vb + sl[j + 1] * slot_bytes;
        __m512i v[4];
        for (int s = 0; s < NS; s++) {
            __m512i x0, x1;
            if (tail) {   /* a last group of fewer than 32 columns: zeros past them */
                uint16_t z0[32] = {0}, z1[32] = {0};
                memcpy(z0, r0, (size_t)tail * 2);
                memcpy(z1, r1, (size_t)tail * 2);
                x0 = _mm512_loadu_si512(z0);
                x1 = _mm512_loadu_si512(z1);
            } else {
                x0 = _mm512_loadu_si512(r0 + 64 * s);
                x1 = _mm512_loadu_si512(r1 + 64 * s);
            }
            v[2 * s] = _mm512_unpacklo_epi16(x1, x0);
            v[2 * s + 1] = _mm512_unpackhi_epi16(x1, x0);
        }
        for (int q = 0; q < qn; q++) {
            const __m512i w = _mm512_set1_epi32(pp[q * pw + j / 2]);
            for (int h = 0; h < 2 * NS; h++) a[q][h] = pdp(a[q][h], v[h], w);
        }
    }
    for (int q = 0; q < qn; q++)
        for (int h = 0; h < 2 * NS; h++) _mm512_storeu_ps(acc + q * dp + 16 * h, a[q][h]);
}

/* column c of pv_pairs' permuted chains */
static inline int64_t pv_pairs_at(int64_t c) {
    const int64_t g = c / 32, w = c % 32, k = w / 8, u = w % 8;
    return g * 32 + (u < 4 ? 0 : 16) + 4 * k + u % 4;
}
#endif

/* attend_block for bfloat16 queries (q16 [N, H, d]) over bfloat16 pools, d even: the
   arithmetic above. pp: the block's weights in pairs (AVX512-BF16); slp: its keys' slots
   with the last repeated (the pad key's). */
static void attend_block_pairs(
    const uint16_t *q16, int64_t H, int64_t d, const void *kpool, const void *vpool, int64_t G,
    const int64_t *slots, const int64_t *first, const int64_t *count, float scale, const float *sinks, float *out,
    int64_t r0, int64_t r1, int64_t kh, int64_t h0, int64_t hn, float *sc, int64_t widest, float *acc, int32_t *pp,
    int64_t *slp) {
    const int64_t es = 2, slot_bytes = (H / G) * d * es, row_bytes = d * es;
    int64_t lo, qa[QBLOCK], qb[QBLOCK], qh[QBLOCK], qr[QBLOCK];
    const int64_t n = block_queries(first, count, r0, r1, G, kh, h0, hn, &lo, qr, qh, qa, qb), end = n + (n & 1);
    const int nq = (int)((r1 - r0) * hn);
    const uint16_t *qp[QBLOCK];
    float inv[QBLOCK];
    for (int qi = 0; qi < nq; qi++) qp[qi] = q16 + (qr[qi] * H + qh[qi]) * d;
    const char *kb = (const char *)kpool + kh * d * es, *vb = (const char *)vpool + kh * d * es;
    const int64_t *sl = slots + lo;
    memcpy(slp, sl, sizeof(int64_t) * (size_t)n);
    slp[n] = n > 0 ? sl[n - 1] : 0;   /* the pad key: the last again (weight 0) */
    const int64_t dp = (d + 31) / 32 * 32;   /* a query's chains, in whole chunks of 32 */
    (void)dp;
    (void)pp;   /* (the builds that take neither) */
#if defined(UR_AVX2)
    for (int qi = 0; qi < nq; qi++) psplit(qp[qi], d, acc + qi * dp);   /* acc: free until the weighted sum */
#endif
    unsigned mode = pair_mode_on();
    for (int64_t t0 = 0; t0 < n; t0 += KTILE) {
        const int64_t t1 = t0 + KTILE < n ? t0 + KTILE : n;
#if defined(UR_AVX512)
        if (nq >= PT_MINQ && d % 32 == 0 && d <= PT_MAXD) {
            /* many queries: the keys transposed, 16 at a time, for all of them (the same
               scores as below: pscores_t_n) */
            _Alignas(64) int32_t kt[PT_MAXD / 2 * 16];
            for (int64_t j = t0; j < t1; j += 16) {   /* the pairs as they lie: 64 bytes, 16 pairs a run */
                keys_t(kb, sl, j, t1, n, slot_bytes, row_bytes, DT_F32, d / 32, 64, kt);
                pscores_t(qp, nq, kt, d, scale, sc + j, widest, (int)(t1 - j < 16 ? t1 - j : 16));
            }
        } else
        for (int g0 = 0; g0 < nq; g0 += 4) {
            const int gn = nq - g0 < 4 ? nq - g0 : 4, nk = gn == 1 ? 16 : gn == 2 ? 8 : 4;
            for (int64_t j = t0; j < t1; j += nk) {
                const char *b[16];
                float t[16];
                for (int k = 0; k < nk; k++) {   /* past the tile: its last key again, the score unused */
                    b[k] = kb + sl[j + k < t1 ? j + k : t1 - 1] * slot_bytes;
                    if (g0 == 0 && j + k < t1 && j + k + KAHEAD < n) prefetch_row(kb + sl[j + k + KAHEAD] * slot_bytes, row_bytes);
                }
                float *s0 = sc + g0 * widest + j;
                const int64_t kn = t1 - j < nk ? t1 - j : nk;
#define PD(Q, K) do {                                                                         \
                    pdots_n(Q, K, qp + g0, b, d, scale, t);                                 \
                    if (kn == K) for (int qi = 0; qi < Q; qi++) memcpy(s0 + qi * widest, t + qi * K, 4 * K); \
                    else for (int qi = 0; qi < Q; qi++) memcpy(s0 + qi * widest, t + qi * K, 4 * kn);     \
                } while (0)
                switch (gn) {
                case 1: PD(1, 16); break;
                case 2: PD(2, 8); break;
                case 3: PD(3, 4); break;
                default: PD(4, 4); break;
                }
#undef PD
            }
        }
#elif defined(UR_AVX2)
        for (int g0 = 0; g0 < nq; g0 += 4) {
            const int gn = nq - g0 < 4 ? nq - g0 : 4;
            const float *qs[4];
            for (int q = 0; q < gn; q++) qs[q] = acc + (g0 + q) * dp;
            for (int64_t j = t0; j < t1; j++) {
                float t[4];
                const uint16_t *k = (const uint16_t *)(kb + sl[j] * slot_bytes);
                switch (gn) {
                case 1: pdots_n(1, qs, k, d, scale, t); break;
                case 2: pdots_n(2, qs, k, d, scale, t); break;
                case 3: pdots_n(3, qs, k, d, scale, t); break;
                default: pdots_n(4, qs, k, d, scale, t); break;
                }
                for (int q = 0; q < gn; q++) sc[(g0 + q) * widest + j] = t[q];
            }
        }
#else
        for (int qi = 0; qi < nq; qi++)
            for (int64_t j = t0; j < t1; j++)
                sc[qi * widest + j] = pdot(qp[qi], (const uint16_t *)(kb + sl[j] * slot_bytes), d) * scale;
#endif
    }
    pair_mode_off(mode);
    softmax_block(sc, nq, widest, n, end, qa, qb, qh, sinks, inv);
    int64_t ja4[QBLOCK / 4 + 1], jb4[QBLOCK / 4 + 1];
    spans4(nq, qa, qb, 1, ja4, jb4);
    mode = pair_mode_on();
#if defined(UR_BF16DP)
    /* the weights in pairs, key 2t's in the upper half (the instruction's first product) */
    const int64_t pw = end / 2;
    for (int qi = 0; qi < nq; qi++) {
        const float *w = sc + qi * widest;
        int32_t *o = pp + qi * pw;
        int64_t t = 0;
        for (; t + 8 <= pw; t += 8) {   /* 16 weights rounded, each dword's halves swapped */
            const __m256i h = bf16x16(_mm512_loadu_ps(w + 2 * t));
            _mm256_storeu_si256((__m256i *)(o + t), _mm256_or_si256(_mm256_slli_epi32(h, 16), _mm256_srli_epi32(h, 16)));
        }
        for (; t < pw; t++) o[t] = (int32_t)((uint32_t)f32_to_bf16(w[2 * t]) << 16 | f32_to_bf16(w[2 * t + 1]));
    }
    for (int64_t i = 0; i < nq * dp; i++) acc[i] = 0.0f;
    for (int64_t j = 0; j < (KTILE < n ? KTILE : n); j++) prefetch_row(vb + sl[j] * slot_bytes, row_bytes);
    for (int64_t t0 = 0; t0 < n; t0 += KTILE) {
        const int64_t t1 = t0 + KTILE < n ? t0 + KTILE : end;
        for (int64_t j = t1; j < (t1 + KTILE < n ? t1 + KTILE : n); j++) prefetch_row(vb + sl[j] * slot_bytes, row_bytes);
        for (int64_t c0 = 0; c0 < d;) {
            const int ns = d - c0 >= 64 ? 2 : 1;
            const int64_t tail = d - c0 < 32 ? d - c0 : 0;
            for (int q0 = 0; q0 < nq; q0 += 4) {
                const int qn = nq - q0 < 4 ? nq - q0 : 4;
                const int64_t ja = ja4[q0 / 4] > t0 ? ja4[q0 / 4] : t0, jb = jb4[q0 / 4] < t1 ? jb4[q0 / 4] : t1;
                if (ja >= jb) continue;
                float *a0 = acc + q0 * dp + c0;
                const int32_t *p0 = pp + q0 * pw;
                const char *v0 = vb + c0 * es;
#define PV(Q) (ns == 2 ? pv_pairs(Q, 2, a0, dp, p0, pw, v0, slp, slot_bytes, ja, jb, 0) \
                       : pv_pairs(Q, 1, a0, dp, p0, pw, v0, slp, slot_bytes, ja, jb, tail))
                switch (qn) {
                case 4: PV(4); break;
                case 3: PV(3); break;
                case 2: PV(2); break;
                default: PV(1); break;
                }
#undef PV
            }
            c0 += 32 * ns;
        }
    }
    pair_mode_off(mode);
    /* pv_pairs' two vectors of a group back in column order: [a.q0, b.q0, a.q1, b.q1],
       [a.q2, b.q2, a.q3, b.q3] (quarters of 4 columns) */
    const __m512i lo_at = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_at = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int qi = 0; qi < nq; qi++) {
        float *o = out + (qr[qi] * H + qh[qi]) * d;
        const float *a = acc + qi * dp;
        const __m512 iv = _mm512_set1_ps(inv[qi]);
        int64_t c = 0;
        for (; c + 32 <= d; c += 32) {
            const __m512 x = _mm512_loadu_ps(a + c), y = _mm512_loadu_ps(a + c + 16);
            _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_permutex2var_ps(x, lo_at, y), iv));
            _mm512_storeu_ps(o + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(x, hi_at, y), iv));
        }
        for (; c < d; c++) o[c] = a[pv_pairs_at(c)] * inv[qi];
    }
#else
    /* the same chains one key at a time: each weight rounded to bfloat16 */
    for (int qi = 0; qi < nq; qi++) {
        float *w = sc + qi * widest;
        int64_t j = 0;
#if defined(UR_AVX512)
        for (; j + 16 <= end; j += 16) _mm512_storeu_ps(w + j, bf16r16(_mm512_loadu_ps(w + j)));
#endif
        for (; j < end; j++) w[j] = bf16_to_f32(f32_to_bf16(w[j]));
    }
    pv_block(nq, d, n, end, sc, widest, ja4, jb4, vb, slp, slot_bytes, row_bytes, es, DT_BF16, acc);
    pair_mode_off(mode);
    for (int qi = 0; qi < nq; qi++) {
        float *o = out + (qr[qi] * H + qh[qi]) * d;
        for (int64_t c = 0; c < d; c++) o[c] = acc[qi * d + c] * inv[qi];
    }
#endif
}

/* For each query row r and head h: out[r, h] = softmax(scale * q[r, h] . K_j) V_j over
   the keys j of row r: slots[first[r] .. first[r] + count[r]) (flat pool slots, in
   position order), plus a sink logit sinks[h] that joins the softmax with a zero value.
   q, out [N, H, d] float32; the pools [slots, KV, d] in dtype dt; head h reads KV head
   h / (H / KV).

   Each query's arithmetic is fixed: its scores (dots()), their maximum, the
   exponentials of its visible keys and their sum in key order, and each output column
   one chain of fused multiply-adds over the keys in key order, divided by the sum. For
   speed, the queries of a few rows that share a KV head and overlapping keys go
   together (each key and value read once for all of them); a key a query does not see
   gets the weight 0, which leaves its chains as they were. */
void ur_attention(const void *q, int qdt, int64_t N, int64_t H, int64_t d, const void *kpool, const void *vpool,
                  int dt, int64_t KV, const int64_t *slots, const int64_t *first, const int64_t *count,
                  float scale, const float *sinks, float *out, int nt) {
    const int64_t G = H / KV;
    /* a block's queries: rows x up to QBLOCK heads of one KV head (more heads a KV head
       than that: the heads in parts, HC of them) */
    const int64_t GB = G > QBLOCK ? QBLOCK : G, HC = (G + GB - 1) / GB;
    const int64_t RB = QBLOCK / GB;     /* rows per block */
    /* blocks of consecutive rows whose key ranges overlap */
    int64_t *bstart = (int64_t *)malloc(sizeof(int64_t) * (N + 1));
    int64_t nb = 0, widest = 1;
    for (int64_t r = 0; r < N;) {
        int64_t lo = first[r], hi = first[r] + count[r], e = r + 1;
        while (e < N && e - r < RB && first[e] < hi && first[e] + count[e] > lo) {
            lo = first[e] < lo ? first[e] : lo;
            hi = first[e] + count[e] > hi ? first[e] + count[e] : hi;
            e++;
        }
        bstart[nb++] = r;
        widest = hi - lo > widest ? hi - lo : widest;
        r = e;
    }
    bstart[nb] = N;
    const int pairs = qdt == DT_BF16 && dt == DT_BF16 && d % 2 == 0;   /* attend_block_pairs */
    const int64_t ws = widest + 1;   /* a score row: a query's keys and a pad key */
    const int64_t nqmax = QBLOCK;
#pragma omp parallel num_threads(nt) if (nt > 1 && nb * KV * HC > 1)
    {
        float *sc = (float *)malloc(sizeof(float) * nqmax * ws);
        float *acc = (float *)malloc(sizeof(float) * nqmax * ((d + 31) / 32 * 32));
        float *pq = (float *)aligned_alloc(64, (sizeof(float) * (nqmax + 1) * d + 63) / 64 * 64);
#if defined(UR_BF16DP)   /* the weights in pairs: only VDPBF16PS reads them so */
        int32_t *pp = pairs ? (int32_t *)malloc(sizeof(int32_t) * nqmax * (ws / 2 + 1)) : NULL;
#else
        int32_t *pp = NULL;
#endif
        int64_t *slp = pairs ? (int64_t *)malloc(sizeof(int64_t) * ws) : NULL;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t bi = 0; bi < nb; bi++) {
            for (int64_t kc = 0; kc < KV * HC; kc++) {
                const int64_t r0 = bstart[bi], r1 = bstart[bi + 1], kh = kc / HC, h0 = kc % HC * GB;
                const int64_t hn = G - h0 < GB ? G - h0 : GB;
                if (pairs)
                    attend_block_pairs((const uint16_t *)q, H, d, kpool, vpool, G, slots, first, count, scale, sinks,
                                       out, r0, r1, kh, h0, hn, sc, ws, acc, pp, slp);
                else if (dt == DT_F32)
                    attend_block(q, H, d, kpool, vpool, DT_F32, G, slots, first, count, scale, sinks, out, r0, r1, kh,
                                 h0, hn, sc, ws, acc, pq);
                else if (dt == DT_BF16)
                    attend_block(q, H, d, kpool, vpool, DT_BF16, G, slots, first, count, scale, sinks, out, r0, r1,
                                 kh, h0, hn, sc, ws, acc, pq);
                else
                    attend_block(q, H, d, kpool, vpool, DT_F16, G, slots, first, count, scale, sinks, out, r0, r1,
                                 kh, h0, hn, sc, ws, acc, pq);
            }
        }
        free(sc);
        free(acc);
        free(pq);
        free(pp);
        free(slp);
    }
    free(bstart);
}

/* ------------------------------------------------------------------------ recurrences */

/* The gated delta rule, token by token, for B sequences of T tokens each, on float32
   states S [B, H, dk, dv]: per token, S <- e^g S; u = beta (v - k^T S); S <- S + k u^T;
   out = q^T S. q, k [B, T, H, dk]; v, out [B, T, H, dv]; beta, g [B, T, H]. */
void ur_delta_rule(const float *q, const float *k, const float *v, const float *beta, const float *g, float *S,
                   float *out, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, int nt) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt) if (nt > 1 && B * H > 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            float *s = S + (b * H + h) * dk * dv;
            float *u = (float *)malloc(sizeof(float) * dv);
            for (int64_t t = 0; t < T; t++) {
                const int64_t bt = (b * T + t) * H + h;
                const float *qt = q + bt * dk, *kt = k + bt * dk, *vt = v + bt * dv;
                float *ot = out + bt * dv;
                const float decay = ur_expf(g[bt]), bw = beta[bt];
                for (int64_t j = 0; j < dv; j++) u[j] = 0.0f;
                for (int64_t i = 0; i < dk; i++) {
                    float *row = s + i * dv;
                    const float ki = kt[i];
                    for (int64_t j = 0; j < dv; j++) {
                        row[j] = row[j] * decay;
                        u[j] = fmaf(ki, row[j], u[j]);
                    }
                }
                for (int64_t j = 0; j < dv; j++) { u[j] = (vt[j] - u[j]) * bw; ot[j] = 0.0f; }
                for (int64_t i = 0; i < dk; i++) {
                    float *row = s + i * dv;
                    const float ki = kt[i], qi = qt[i];
                    for (int64_t j = 0; j < dv; j++) {
                        row[j] = fmaf(ki, u[j], row[j]);
                        ot[j] = fmaf(qi, row[j], ot[j]);
                    }
                }
            }
            free(u);
        }
    }
}

/* Mamba2's selective scan, token by token, for B sequences of T tokens, on float32
   states S [B, H, P, N]: per token and head, with a = e^(dt A), S <- a S + (x dt) B^T and
   y = S C. x, y [B, T, H, P]; dt [B, T, H] (after softplus and clamping); A [H];
   Bm, C [B, T, H, N] (groups already spread over heads). */
void ur_ssm_scan(const float *x, const float *dt, const float *A, const float *Bm, const float *C, float *S,
                 float *y, int64_t B, int64_t T, int64_t H, int64_t P, int64_t N, int nt) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt) if (nt > 1 && B * H > 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            float *s = S + (b * H + h) * P * N;
            for (int64_t t = 0; t < T; t++) {
                const int64_t bt = (b * T + t) * H + h;
                const float d = dt[bt], a = ur_expf(d * A[h]);
                const float *xt = x + bt * P, *bt_ = Bm + bt * N, *ct = C + bt * N;
                float *yt = y + bt * P;
                for (int64_t p = 0; p < P; p++) {
                    float *row = s + p * N;
                    const float xd = xt[p] * d;
                    for (int64_t n = 0; n < N; n++) row[n] = fmaf(xd, bt_[n], row[n] * a);
                    { const float *rp = row; dots(&rp, 1, ct, DT_F32, N, yt + p); }
                }
            }
        }
    }
}
