/* kvbench's CPU matrix-vector product for one-row float32 projections (model/gemv.py builds and loads it).
 *
 * y[o] = b[o] + W[o, :] . x  for o in [0, out): W (out, in) row-major, x (in,), b (out,) or NULL, y (out,).
 * Rows are shared out over `threads` OpenMP threads (`share`; torch's own pool where torch uses GNU OpenMP: the
 * library's libgomp.so.1 is the one torch has loaded). How a thread reads its rows is tuned per machine
 * (model/gemv.py times each way once): `rows` at a time (1 or 4: one stream or four side by side), and with
 * `prefetch` > 0 each stream asks for the bytes that far ahead of it into L2 (never past W's end), which keeps more
 * reads in flight than the hardware prefetcher alone on some CPUs.
 * A row is summed the same way in every case: LANES running sums over its chunks of LANES floats, then its tail,
 * then the lanes in order. So y depends neither on the way of reading nor on the thread count, bit for bit.
 *
 * More entry points run GPT-2's one-row decode step in fewer calls (model/gpt2.py): kv_step_f32, the whole step
 * over static caches' buffers; elsewhere two calls a block around the cache's own update and attention,
 * kv_ln_gemv_f32 (a LayerNorm, then a projection) and kv_block_tail_f32 (everything after attention). Each Python
 * call between two projections runs with caches the matrix just streamed through, at several times its warm cost;
 * these leave no such gap, or two a block, instead of eight (docs/performance.md).
 */
#include <math.h>
#include <stddef.h>

#define LANES 16

/* y[o0 + r] for r in [0, R): R rows read side by side, each asking for the line `prefetch` bytes ahead when PF.
 * Inlined with constant R and PF, so the loops unroll and the loop without prefetching has no test in it. */
static inline __attribute__((always_inline)) void dot_rows(const float *restrict W, const float *restrict x,
                                                            const float *restrict b, float *restrict y, long o0,
                                                            const int R, long in, const int PF, long prefetch,
                                                            const char *end) {
    const float *restrict w = W + o0 * in;
    float acc[4][LANES] = {{0}};
    long i = 0;
    for (; i + LANES <= in; i += LANES) {
        if (PF) {
            for (int r = 0; r < R; r++) {
                const char *ahead = (const char *)(w + r * in + i) + prefetch;
                if (ahead < end) __builtin_prefetch(ahead, 0, 2); /* read, into L2 (prefetcht1 on x86) */
            }
        }
        for (int r = 0; r < R; r++) {
#pragma omp simd
            for (int l = 0; l < LANES; l++) acc[r][l] += w[r * in + i + l] * x[i + l];
        }
    }
    for (int r = 0; r < R; r++) {
        float s = 0.f;
        for (long j = i; j < in; j++) s += w[r * in + j] * x[j];
        for (int l = 0; l < LANES; l++) s += acc[r][l];
        y[o0 + r] = b ? s + b[o0 + r] : s;
    }
}

/* A thread's share of W's rows, inside a parallel region: rows [0, grouped) four at a time, the rest one by one,
 * shared out guided: a thread takes half of what is left (a long stream of contiguous rows), and the last rows go in
 * chunks of CHUNK_ROWS to whichever thread is free. Two cores of a VM need not stream alike, and static halves left
 * the faster idle at every matrix's end (2-core AMD EPYC VM, 2026-12-07, medians: a gpt2 step's 49 matrices in one
 * parallel region 46 GB/s static, 55 guided, where a sum read 63; 32 and 34 where it read its usual 34.5; the same
 * matrices a call each, one row at a time without prefetching, 21.7 ms static against 14.9 guided, and four rows
 * 16 KiB ahead 14.75 against 14.68). Which thread sums a row does not change its bits. Ends at a barrier, so every
 * row of y is written when any thread goes on. */
#define CHUNK_ROWS 16
static inline __attribute__((always_inline)) void share(const float *restrict W, const float *restrict x,
                                                         const float *restrict b, float *restrict y, long out,
                                                         long in, int rows, long prefetch) {
    const long groups = rows == 4 ? out / 4 : 0, grouped = 4 * groups;
    const char *end = (const char *)(W + out * in);
    if (prefetch > 0) {
#pragma omp for schedule(guided, CHUNK_ROWS / 4) nowait
        for (long g = 0; g < groups; g++) dot_rows(W, x, b, y, 4 * g, 4, in, 1, prefetch, end);
#pragma omp for schedule(guided, CHUNK_ROWS)
        for (long o = grouped; o < out; o++) dot_rows(W, x, b, y, o, 1, in, 1, prefetch, end);
    } else {
#pragma omp for schedule(guided, CHUNK_ROWS / 4) nowait
        for (long g = 0; g < groups; g++) dot_rows(W, x, b, y, 4 * g, 4, in, 0, 0, end);
#pragma omp for schedule(guided, CHUNK_ROWS)
        for (long o = grouped; o < out; o++) dot_rows(W, x, b, y, o, 1, in, 0, 0, end);
    }
}

/* out = (x - mean) / sqrt(var + eps) * g + gb over one row of n (torch.nn.LayerNorm: the biased variance), its two
 * moments summed in double. One thread. */
static void layer_norm(const float *restrict x, const float *restrict g, const float *restrict gb,
                       float *restrict out, long n, float eps) {
    double sum = 0.0, sq = 0.0;
    for (long i = 0; i < n; i++) sum += x[i];
    const float mean = (float)(sum / n);
    for (long i = 0; i < n; i++) {
        const double d = (double)x[i] - mean;
        sq += d * d;
    }
    const float rstd = 1.f / sqrtf((float)(sq / n) + eps);
    for (long i = 0; i < n; i++) out[i] = (x[i] - mean) * rstd * g[i] + gb[i];
}

/* e^x in float to within an ulp or two, as arithmetic the compiler vectorises: libm's expf and tanhf take one
 * element a call, and in a gpt2 step at prompt 512 the softmax's and the GELU's cost 1-2 ms of 21. Cephes' expf:
 * e^x = 2^k e^r, k = round(x / ln 2), r = x - k ln 2 in two parts, e^r by a degree-7 polynomial. 0 below -87.3 (where
 * expf's result leaves the normal floats), x clamped at 88 (e^88 ~ 1.7e38; only the GELU asks that high), NaN kept.
 * k is computed from the clamped value, so it is always a small integer, NaN included. */
static inline float exp_f32(float x) {
    const float lo = -87.33654f;
    const float above = x > lo ? x : lo; /* NaN compares false: lo */
    const float z = above < 88.f ? above : 88.f;
    const float k = floorf(z * 1.44269504088896341f + 0.5f);
    const float r = (z - k * 0.693359375f) - k * -2.12194440e-4f; /* ln 2 = 0.693359375 - 2.12194440e-4 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const union { int i; float f; } two_k = {.i = ((int)k + 127) << 23}; /* 2^k from its exponent bits */
    return x < lo ? 0.f : (x == x ? p * two_k.f : x);
}

/* GPT-2's tanh-GELU (torch.nn.functional.gelu(approximate="tanh")): 0.5 v (1 + tanh(u)), written as v sigmoid(2u),
 * the same function with one exponential. */
static inline float gelu_tanh(float v) {
    const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return v / (1.f + exp_f32(-2.f * u));
}

/* y = b + W x. */
void kv_gemv_f32(const float *restrict W, const float *restrict x, const float *restrict b, float *restrict y,
                 long out, long in, int threads, int rows, long prefetch) {
#pragma omp parallel num_threads(threads)
    share(W, x, b, y, out, in, rows, prefetch);
}

/* y = b + W LN(x): a LayerNorm (g, gb, eps) and the projection after it (ln_1 and c_attn; ln_f and lm_head).
 * ln (in,): scratch for LN(x). */
void kv_ln_gemv_f32(const float *restrict x, const float *restrict g, const float *restrict gb, float eps,
                    const float *restrict W, const float *restrict b, float *restrict ln, float *restrict y, long out,
                    long in, int threads, int rows, long prefetch) {
    layer_norm(x, g, gb, ln, in, eps);
#pragma omp parallel num_threads(threads)
    share(W, ln, b, y, out, in, rows, prefetch);
}

/* The rest of a GPT-2 block after attention, for one row of width C (MLP width F), inside a parallel region:
 *     x1 = x + (bo + Wo a)                              attn.c_proj and the first residual
 *     y  = x1 + (bp + Wp gelu(bf + Wf LN(x1)))           ln_2, mlp.c_fc, GELU, mlp.c_proj, the second residual
 * Sums in the order the model's own code adds them. Scratch: x1 (C), ln (C), h (F). */
static inline __attribute__((always_inline)) void tail(
    const float *restrict x, const float *restrict a, const float *restrict Wo, const float *restrict bo,
    const float *restrict g, const float *restrict gb, float eps, const float *restrict Wf, const float *restrict bf,
    const float *restrict Wp, const float *restrict bp, float *restrict x1, float *restrict ln, float *restrict h,
    float *restrict y, long C, long F, int rows, long prefetch) {
    share(Wo, a, bo, x1, C, C, rows, prefetch);
#pragma omp for schedule(static)
    for (long i = 0; i < C; i++) x1[i] = x[i] + x1[i];
#pragma omp single
    layer_norm(x1, g, gb, ln, C, eps);
    share(Wf, ln, bf, h, F, C, rows, prefetch);
#pragma omp for simd schedule(static)
    for (long i = 0; i < F; i++) h[i] = gelu_tanh(h[i]);
    share(Wp, h, bp, y, C, F, rows, prefetch);
#pragma omp for schedule(static)
    for (long i = 0; i < C; i++) y[i] = x1[i] + y[i];
}

void kv_block_tail_f32(const float *restrict x, const float *restrict a, const float *restrict Wo,
                       const float *restrict bo, const float *restrict g, const float *restrict gb, float eps,
                       const float *restrict Wf, const float *restrict bf, const float *restrict Wp,
                       const float *restrict bp, float *restrict x1, float *restrict ln, float *restrict h,
                       float *restrict y, long C, long F, int threads, int rows, long prefetch) {
#pragma omp parallel num_threads(threads)
    tail(x, a, Wo, bo, g, gb, eps, Wf, bf, Wp, bp, x1, ln, h, y, C, F, rows, prefetch);
}

/* scores[s] = softmax(q K[s]^T / sqrt(Dh)) over slots [0, n) of one head's (L, Dh) K, the maximum subtracted first. */
static inline __attribute__((always_inline)) void softmax_scores(const float *restrict q, const float *restrict K,
                                                                  float *restrict scores, long n, const long Dh) {
    const float scale = 1.f / sqrtf((float)Dh);
    for (long s = 0; s < n; s++) {
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (long j = 0; j < Dh; j++) d += q[j] * K[s * Dh + j];
        scores[s] = d * scale;
    }
    float top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : top)
    for (long s = 0; s < n; s++) top = scores[s] > top ? scores[s] : top;
#pragma omp simd reduction(+ : sum)
    for (long s = 0; s < n; s++) {
        scores[s] = exp_f32(scores[s] - top);
        sum += scores[s];
    }
#pragma omp simd
    for (long s = 0; s < n; s++) scores[s] = scores[s] / sum;
}

/* acc = sum over slots s of p[s] V[s], for one head's (L, Dh) V: acc (Dh,) stays in registers where Dh is a
 * constant and acc a local array. */
static inline __attribute__((always_inline)) void weigh_values(const float *restrict p, const float *restrict V,
                                                                float *restrict acc, long n, const long Dh) {
    for (long j = 0; j < Dh; j++) acc[j] = 0.f;
    for (long s = 0; s < n; s++) {
#pragma omp simd
        for (long j = 0; j < Dh; j++) acc[j] += p[s] * V[s * Dh + j];
    }
}

/* One head's attention for one query over slots [0, n) of its (L, Dh) K and V: softmax(q K^T / sqrt(Dh)) V.
 * scores (n,): scratch. gpt2's head width, 64, gets its own copy, summing V's rows in registers. */
static void attend_head(const float *restrict q, const float *restrict K, const float *restrict V,
                        float *restrict out, float *restrict scores, long n, long Dh) {
    if (Dh == 64) {
        float acc[64];
        softmax_scores(q, K, scores, n, 64);
        weigh_values(scores, V, acc, n, 64);
        for (int j = 0; j < 64; j++) out[j] = acc[j];
    } else {
        softmax_scores(q, K, scores, n, Dh);
        weigh_values(scores, V, out, n, Dh);
    }
}

/* One query's attention for every (batch row, head) of (B, H, L, Dh) K and V buffers, where `allowed` (B, L), one
 * byte a slot, says which slots each row may see:
 *     out[b, h] = softmax(q[b, h] K[b, h, s]^T / sqrt(Dh) over the allowed s) V[b, h, s]
 * q and out (B, H, Dh). Slots after a row's last allowed one are not read; a row that may see every slot up to its
 * last reads as kv_step_f32's attention does, others skip the rest. A row that may see no slot gets zeros, as
 * torch's CPU SDPA answers an all-false mask (torch 2.13). scratch: B * H * L floats. */
void kv_attend_f32(const float *restrict q, const float *restrict K, const float *restrict V,
                   const unsigned char *restrict allowed, float *restrict out, long B, long H, long L, long Dh,
                   float *restrict scratch, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long bh = 0; bh < B * H; bh++) {
        const unsigned char *m = allowed + bh / H * L;
        const float *Kh = K + bh * L * Dh, *Vh = V + bh * L * Dh, *qh = q + bh * Dh;
        float *o = out + bh * Dh, *scores = scratch + bh * L;
        long n = L, seen = 0;
        while (n > 0 && !m[n - 1]) n--;
        for (long s = 0; s < n; s++) seen += m[s] != 0;
        if (seen == n && n > 0) {
            attend_head(qh, Kh, Vh, o, scores, n, Dh);
            continue;
        }
        for (long j = 0; j < Dh; j++) o[j] = 0.f;
        if (!n) continue;
        const float scale = 1.f / sqrtf((float)Dh);
        float top = -INFINITY, sum = 0.f;
        for (long s = 0; s < n; s++) {
            float d = 0.f;
            if (m[s]) {
#pragma omp simd reduction(+ : d)
                for (long j = 0; j < Dh; j++) d += qh[j] * Kh[s * Dh + j];
                top = d * scale > top ? d * scale : top;
            }
            scores[s] = d * scale;
        }
        for (long s = 0; s < n; s++) {
            scores[s] = m[s] ? exp_f32(scores[s] - top) : 0.f;
            sum += scores[s];
        }
        for (long s = 0; s < n; s++) {
            if (!m[s]) continue;
            const float p = scores[s] / sum;
#pragma omp simd
            for (long j = 0; j < Dh; j++) o[j] += p * Vh[s * Dh + j];
        }
    }
}

/* The pointers of one layer in kv_step_f32's table, in this order. */
enum { G1, GB1, WQ, BQ, KBUF, VBUF, WO, BO, G2, GB2, WF, BF, WP, BP, NPTR };

/* A whole GPT-2 decode step for one row over static caches (batch 1), to its logits, in one parallel region:
 *     for each of n_layer layers (NPTR pointers each in `table`, the order above):
 *         qkv = bq + Wq LN1(x)                                        ln_1, attn.c_attn
 *         K[h, slot], V[h, slot] = qkv's k and v of head h            the cache's write
 *         a[h] = softmax(q_h K[h, :slot+1]^T / sqrt(Dh)) V[h, :slot+1]   attention over every filled slot
 *         x = tail(x, a)                                              c_proj, ln_2, the MLP, both residuals
 *     logits = Wh LN_f(x)                                             ln_f, lm_head (no bias)
 * K and V are each layer's (H, L, Dh) buffers. Scratch: x twice (C each), ln (C), qkv (3C), a (C), x1 (C), h (F),
 * scores (H * (slot + 1)). */
void kv_step_f32(const float *restrict x0, const void *const *table, long n_layer, long L, long slot, long H,
                 float eps, const float *restrict gf, const float *restrict gbf, const float *restrict Wh,
                 float *restrict logits, long V, float *restrict scratch, long C, long F, int threads, int rows,
                 long prefetch) {
    const long Dh = C / H, n = slot + 1;
    float *xa = scratch, *xb = xa + C, *ln = xb + C, *qkv = ln + C, *a = qkv + 3 * C, *x1 = a + C, *h = x1 + C;
    float *scores = h + F;
    for (long i = 0; i < C; i++) xa[i] = x0[i];
#pragma omp parallel num_threads(threads)
    {
        float *xin = xa, *xout = xb; /* each thread swaps its own copies alike */
        for (long l = 0; l < n_layer; l++) {
            const float *const *p = (const float *const *)(table + l * NPTR);
            float *K = (float *)p[KBUF], *Vc = (float *)p[VBUF];
#pragma omp single
            layer_norm(xin, p[G1], p[GB1], ln, C, eps);
            share(p[WQ], ln, p[BQ], qkv, 3 * C, C, rows, prefetch);
#pragma omp for schedule(static)
            for (long hd = 0; hd < H; hd++) {
                float *Kh = K + hd * L * Dh, *Vh = Vc + hd * L * Dh;
                for (long j = 0; j < Dh; j++) {
                    Kh[slot * Dh + j] = qkv[C + hd * Dh + j];
                    Vh[slot * Dh + j] = qkv[2 * C + hd * Dh + j];
                }
                attend_head(qkv + hd * Dh, Kh, Vh, a + hd * Dh, scores + hd * n, n, Dh);
            }
            tail(xin, a, p[WO], p[BO], p[G2], p[GB2], eps, p[WF], p[BF], p[WP], p[BP], x1, ln, h, xout, C, F, rows,
                 prefetch);
            float *t = xin;
            xin = xout;
            xout = t;
        }
#pragma omp single
        layer_norm(xin, gf, gbf, ln, C, eps);
        share(Wh, ln, NULL, logits, V, C, rows, prefetch);
    }
}
