/* Decode attention over a batch of cached sequences: one new query token per row, every cached key and value read
 * once, from the engine's slot layout (engine/blocks.py). The reference is engine/blocks.py `attention_reference`
 * (torch ops); tests/test_engine_llama.py ties the two.
 *
 *   q    [S, H, d]          the new tokens' rotated queries (H = KV x G: query head j reads kv head j / G)
 *   k, v [S, KV, cap, d]    row b's positions 0 .. lens[b] - 1 are real (the new token's included)
 *   out  [S, H, d]          softmax(q k^T x scale) v, per row and head
 *
 * Why a kernel: torch's batched matmuls read these small per-head matrices at 11 GB/s on a 2-core EPYC, and copy a
 * strided view whole before they start; this reads them at about 25 of the 38 GB/s a plain sum reaches.
 *
 * One work item is a (row, kv head): its G query heads share each key and value row as it is read. Positions go in
 * blocks of BLOCK: the block's scores (fp32), an online softmax (the running maximum and sum rescale what came
 * before), then the block's values weighted into the accumulators. Arithmetic is fp32 whatever the storage type.
 * Work items run on the kernels' thread pool (pool.c); engine/native.py builds the library.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#define BLOCK 64

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---------------------------------------------------------------- the two storage types' row operations */

static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t d) {
    float dot = 0.f;
    int64_t i = 0;
#ifdef HAVE_AVX512_BF16 /* the bf16 dot-product instruction: products exact in fp32 */
    __m512 acc = _mm512_setzero_ps();
    for (; i + 32 <= d; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    dot = _mm512_reduce_add_ps(acc);
#endif
    for (; i < d; i++) dot += bf16_f32(a[i]) * bf16_f32(b[i]);
    return dot;
}

static inline float dot_f32(const float *a, const float *b, int64_t d) {
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < d; i++) dot += a[i] * b[i];
    return dot;
}

static inline void axpy_bf16(float p, const uint16_t *v, float *acc, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) acc[i] += p * bf16_f32(v[i]);
}

static inline void axpy_f32(float p, const float *v, float *acc, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) acc[i] += p * v[i];
}

/* acc [G][d] += sum over the block's positions w of p [g][w] v [w]: the generic loop, and for bf16 with AVX-512 at
 * d = 64 and G <= 4 (the common GQA shapes) one where the accumulators stay in registers and each value row is
 * converted once for all G heads */
#define DEFINE_BLOCK_SUM(NAME, T, AXPY)                                                                            \
    static inline void NAME(const float *p, int64_t nb, const T *v, int64_t G, int64_t d, float *acc) {            \
        for (int64_t w = 0; w < nb; w++)                                                                           \
            for (int64_t g = 0; g < G; g++) AXPY(p[g * BLOCK + w], v + w * d, acc + g * d, d);                     \
    }
DEFINE_BLOCK_SUM(block_sum_f32, float, axpy_f32)
DEFINE_BLOCK_SUM(block_sum_bf16_generic, uint16_t, axpy_bf16)

static inline void block_sum_bf16(const float *p, int64_t nb, const uint16_t *v, int64_t G, int64_t d, float *acc) {
#ifdef HAVE_AVX512_BF16
    if (d == 64 && G <= 4) {
        __m512 a[4][4];
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < 4; c++) a[g][c] = g < G ? _mm512_loadu_ps(acc + g * 64 + 16 * c) : _mm512_setzero_ps();
        for (int64_t w = 0; w < nb; w++) {
            __m512 x[4];
            for (int c = 0; c < 4; c++)
                x[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + w * 64 + 16 * c))), 16));
            for (int g = 0; g < 4 && g < G; g++) {
                const __m512 pg = _mm512_set1_ps(p[g * BLOCK + w]);
                for (int c = 0; c < 4; c++) a[g][c] = _mm512_fmadd_ps(pg, x[c], a[g][c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + 16 * c, a[g][c]);
        return;
    }
#endif
    block_sum_bf16_generic(p, nb, v, G, d, acc);
}

/* ---------------------------------------------------------------- one block's softmax update */

/* s [G][BLOCK] holds the block's scores; turns them into exp(s - m) under the running maxima m [G], rescaling the
 * running sums l [G] and accumulators acc [G][d] where a maximum grew */
static inline void online_softmax(float *s, int64_t nb, int64_t G, float *m, float *l, float *acc, int64_t d) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * BLOCK, top = m[g];
        for (int64_t w = 0; w < nb; w++) top = sg[w] > top ? sg[w] : top;
        if (top > m[g]) {
            const float c = expf(m[g] - top);
            l[g] *= c;
            for (int64_t i = 0; i < d; i++) acc[g * d + i] *= c;
            m[g] = top;
        }
        float total = 0.f;
        for (int64_t w = 0; w < nb; w++) {
            sg[w] = expf(sg[w] - top);
            total += sg[w];
        }
        l[g] += total;
    }
}

struct attention {
    const void *q, *k, *v;
    const int64_t *lens;
    void *out;
    int64_t H, KV, cap, d;
    float scale;
};

#define DEFINE_ATTENTION(NAME, T, DOT, BLOCK_SUM, STORE)                                                           \
    static void NAME##_item(void *arg, int64_t item) {                                                             \
        const struct attention *a = arg;                                                                           \
        const T *q = a->q, *k = a->k, *v = a->v;                                                                   \
        T *out = a->out;                                                                                           \
        const int64_t H = a->H, KV = a->KV, cap = a->cap, d = a->d, G = H / KV;                                    \
        const int64_t b = item / KV, h = item % KV, n = a->lens[b];                                                \
        float scratch[G * (BLOCK + d + 2)];                                                                        \
        float *s = scratch, *acc = s + G * BLOCK, *m = acc + G * d, *l = m + G;                                    \
        for (int64_t g = 0; g < G; g++) m[g] = -FLT_MAX, l[g] = 0.f;                                               \
        memset(acc, 0, sizeof(float) * G * d);                                                                     \
        const T *qb = q + (b * H + h * G) * d;                                                                     \
        const T *kb = k + (b * KV + h) * cap * d, *vb = v + (b * KV + h) * cap * d;                                \
        for (int64_t w0 = 0; w0 < n; w0 += BLOCK) {                                                                \
            const int64_t nb = n - w0 < BLOCK ? n - w0 : BLOCK;                                                    \
            for (int64_t w = 0; w < nb; w++)                                                                       \
                for (int64_t g = 0; g < G; g++) s[g * BLOCK + w] = DOT(qb + g * d, kb + (w0 + w) * d, d) * a->scale; \
            online_softmax(s, nb, G, m, l, acc, d);                                                                \
            BLOCK_SUM(s, nb, vb + w0 * d, G, d, acc);                                                              \
        }                                                                                                          \
        for (int64_t g = 0; g < G; g++) {                                                                          \
            const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;                                                       \
            for (int64_t i = 0; i < d; i++) out[(b * H + h * G + g) * d + i] = STORE(acc[g * d + i] * inv);        \
        }                                                                                                          \
    }                                                                                                              \
    int NAME(const T *q, const T *k, const T *v, const int64_t *lens, T *out, int64_t S, int64_t H, int64_t KV,    \
             int64_t cap, int64_t d, float scale, int threads) {                                                   \
        struct attention a = {q, k, v, lens, out, H, KV, cap, d, scale};                                           \
        pool_run(NAME##_item, &a, S * KV, threads);                                                                \
        return 0;                                                                                                  \
    }

#define IDENTITY(x) (x)
DEFINE_ATTENTION(decode_attention_bf16, uint16_t, dot_bf16, block_sum_bf16, f32_bf16)
DEFINE_ATTENTION(decode_attention_f32, float, dot_f32, block_sum_f32, IDENTITY)
