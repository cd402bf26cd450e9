/* out = x W^T (+ bias) (+ residual) for a decode step's few rows: x [M, K] bf16, W [N, K] bf16 packed by
 * engine/linear.py `pack` into column blocks of 32 with k in pairs, [ceil(N / 32)][K / 2][32][2], the layout the
 * AVX-512 BF16 dot-product instruction reads. The reference is torch's F.linear on the unpacked weight
 * (engine/linear.py `linear_reference`); tests/test_engine_llama.py ties the two.
 *
 * Why: at 1-64 rows a linear layer is bound by reading its weight, and torch's bf16 GEMM reads these weights at about
 * 10 of the 38 GB/s a plain sum reaches on a 2-core EPYC (it repacks the weight on every call). Here each weight
 * element is read once per call: a tile of up to 12 rows x 32 columns keeps its 24 accumulators in registers, each
 * k pair of a column block is one 64-byte load feeding 12 x 2 dot-product instructions (products exact in fp32), and
 * threads take column blocks, so a block's weights are read by one thread only and the row tiles after the first
 * find them in its cache.
 *
 * Rounding follows torch's: the fp32 sum plus the bias is rounded to bf16 (nearest even), and with a residual, that
 * result is added to the residual and rounded again (transformers adds the projection to the residual stream after
 * the linear layer has rounded it). out_kind 1 stores the sum (plus bias) in fp32 unrounded, 2 in fp32 after rounding
 * it to bf16 (logits as a bf16 model computes them, widened for the softmax).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

/* What the rows of x are before the product (`prep`), each computed as transformers computes it in bf16:
 *   PREP_NONE      x itself, [M, K]
 *   PREP_RMSNORM   w * bf16(x / rms(x)), the statistics in fp32 (LlamaRMSNorm): x [M, K], w [K]
 *   PREP_SILU_MUL  bf16(silu(x[:, :K])) * x[:, K:], the gated MLP's input to its down projection: x [M, 2K] */
enum { PREP_NONE = 0, PREP_RMSNORM = 1, PREP_SILU_MUL = 2 };

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float rnd(float f) { return bf16_f32(f32_bf16(f)); }

/* row r of the prepared input into dst [K] */
static void prepare_row(const uint16_t *x, int64_t r, int64_t K, int prep, const uint16_t *w, float eps,
                        uint16_t *dst) {
    if (prep == PREP_RMSNORM) {
        const uint16_t *xr = x + r * K;
        float sq = 0.f;
        for (int64_t i = 0; i < K; i++) sq += bf16_f32(xr[i]) * bf16_f32(xr[i]);
        const float inv = 1.f / sqrtf(sq / (float)K + eps);
        for (int64_t i = 0; i < K; i++) dst[i] = f32_bf16(bf16_f32(w[i]) * rnd(bf16_f32(xr[i]) * inv));
    } else { /* PREP_SILU_MUL */
        const uint16_t *g = x + r * 2 * K, *u = g + K;
        for (int64_t i = 0; i < K; i++) {
            const float a = bf16_f32(g[i]);
            dst[i] = f32_bf16(rnd(a / (1.f + expf(-a))) * bf16_f32(u[i]));
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m512 round_bf16(__m512 v) { /* to bf16 and back: nearest even */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline void store(__m512 acc, int64_t row, int64_t n, int64_t N, __mmask16 m, const uint16_t *bias,
                         const uint16_t *res, void *out, int out_kind) {
    if (bias) acc = _mm512_add_ps(acc, load_bf16(bias + n, m));
    if (out_kind) {
        _mm512_mask_storeu_ps((float *)out + row * N + n, m, out_kind == 2 ? round_bf16(acc) : acc);
        return;
    }
    if (res) acc = _mm512_add_ps(round_bf16(acc), load_bf16(res + row * N + n, m));
    _mm256_mask_storeu_epi16((uint16_t *)out + row * N + n, m, (__m256i)_mm512_cvtneps_pbh(acc));
}

/* rows m0 .. m0 + MR - 1, columns 32 j .. 32 j + 31 */
#define DEFINE_TILE(MR)                                                                                            \
    static void tile_##MR(const uint16_t *x, int64_t m0, int64_t K, const uint16_t *wb, int64_t n0, int64_t N,    \
                          const uint16_t *bias, const uint16_t *res, void *out, int out_kind) {                     \
        __m512 acc[MR][2];                                                                                         \
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                                 \
        for (int64_t p = 0; p < K / 2; p++) {                                                                      \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * 64);                                         \
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + p * 64 + 32);                                    \
            for (int r = 0; r < MR; r++) {                                                                         \
                int32_t pair;                                                                                      \
                memcpy(&pair, x + (m0 + r) * K + 2 * p, 4);                                                        \
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                                              \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);                                                    \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);                                                    \
            }                                                                                                      \
        }                                                                                                          \
        for (int c = 0; c < 2; c++) {                                                                              \
            const int64_t n = n0 + 16 * c, left = N - n;                                                           \
            if (left <= 0) break;                                                                                  \
            const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);                   \
            for (int r = 0; r < MR; r++) store(acc[r][c], m0 + r, n, N, m, bias, res, out, out_kind);              \
        }                                                                                                          \
    }
DEFINE_TILE(12)
DEFINE_TILE(8)
DEFINE_TILE(4)
DEFINE_TILE(2)
DEFINE_TILE(1)

struct gemm {
    const uint16_t *x, *w, *bias, *res;
    void *out;
    int64_t M, K, N;
    int out_kind;
};

static void gemm_block(void *arg, int64_t j) { /* every row of column block j */
    const struct gemm *a = arg;
    const uint16_t *x = a->x, *bias = a->bias, *res = a->res, *wb = a->w + j * a->K * 32;
    const int64_t M = a->M, K = a->K, N = a->N;
    void *out = a->out;
    const int out_kind = a->out_kind;
    int64_t m0 = 0;
    for (; m0 + 12 <= M; m0 += 12) tile_12(x, m0, K, wb, 32 * j, N, bias, res, out, out_kind);
    if (M - m0 >= 8) tile_8(x, m0, K, wb, 32 * j, N, bias, res, out, out_kind), m0 += 8;
    if (M - m0 >= 4) tile_4(x, m0, K, wb, 32 * j, N, bias, res, out, out_kind), m0 += 4;
    if (M - m0 >= 2) tile_2(x, m0, K, wb, 32 * j, N, bias, res, out, out_kind), m0 += 2;
    if (M - m0 >= 1) tile_1(x, m0, K, wb, 32 * j, N, bias, res, out, out_kind);
}

int small_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const uint16_t *bias,
                    const uint16_t *res, void *out, int out_kind, int prep, const uint16_t *prep_w, float eps,
                    int threads) {
    if (K % 2) return 1;
    uint16_t *prepared = NULL;
    if (prep != PREP_NONE) { /* a few rows: the calling thread prepares them while the workers still spin */
        prepared = malloc(sizeof(uint16_t) * M * K);
        if (!prepared) return 2;
        for (int64_t r = 0; r < M; r++) prepare_row(x, r, K, prep, prep_w, eps, prepared + r * K);
        x = prepared;
    }
    struct gemm a = {x, w, bias, res, out, M, K, N, out_kind};
    pool_run(gemm_block, &a, (N + 31) / 32, threads);
    free(prepared);
    return 0;
}

int small_gemm_available(void) { return 1; }

#else /* no AVX-512 BF16 on this CPU: callers take torch's linear */

int small_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const uint16_t *bias,
                    const uint16_t *res, void *out, int out_kind, int prep, const uint16_t *prep_w, float eps,
                    int nthreads) {
    (void)x; (void)M; (void)K; (void)w; (void)N; (void)bias; (void)res; (void)out; (void)out_kind; (void)prep;
    (void)prep_w; (void)eps; (void)nthreads;
    return 1;
}

int small_gemm_available(void) { return 0; }

#endif
