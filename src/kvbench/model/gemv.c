/* kvbench's CPU matrix-vector product for one-row float32 projections (model/gemv.py builds and loads it).
 *
 * y[o] = b[o] + W[o, :] . x  for o in [0, out): W (out, in) row-major, x (in,), b (out,) or NULL, y (out,).
 * Rows are split statically over `threads` OpenMP threads (torch's own pool where torch uses GNU OpenMP: the
 * library's libgomp.so.1 is the one torch has loaded). How a thread reads its rows is tuned per machine
 * (model/gemv.py times each way once): `rows` at a time (1 or 4: one stream or four side by side), and with
 * `prefetch` > 0 each stream asks for the bytes that far ahead of it into L2 (never past W's end), which keeps more
 * reads in flight than the hardware prefetcher alone on some CPUs.
 * A row is summed the same way in every case: LANES running sums over its chunks of LANES floats, then its tail,
 * then the lanes in order. So y depends neither on the way of reading nor on the thread count, bit for bit.
 *
 * Two more entry points run a GPT-2 block's one-row decode step as two calls around attention (model/gpt2.py):
 * kv_ln_gemv_f32 (a LayerNorm, then a projection) and kv_block_tail_f32 (everything after attention). Each Python
 * call between two projections runs with caches the matrix just streamed through, at several times its warm cost;
 * the two calls leave two such gaps a block instead of eight (docs/performance.md).
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

/* A thread's share of W's rows, inside a parallel region: rows [0, grouped) four at a time, the rest one by one.
 * Ends at a barrier, so every row of y is written when any thread goes on. */
static inline __attribute__((always_inline)) void share(const float *restrict W, const float *restrict x,
                                                         const float *restrict b, float *restrict y, long out,
                                                         long in, int rows, long prefetch) {
    const long grouped = rows == 4 ? out / 4 * 4 : 0;
    const char *end = (const char *)(W + out * in);
    if (prefetch > 0) {
#pragma omp for schedule(static) nowait
        for (long o = 0; o < grouped; o += 4) dot_rows(W, x, b, y, o, 4, in, 1, prefetch, end);
#pragma omp for schedule(static)
        for (long o = grouped; o < out; o++) dot_rows(W, x, b, y, o, 1, in, 1, prefetch, end);
    } else {
#pragma omp for schedule(static) nowait
        for (long o = 0; o < grouped; o += 4) dot_rows(W, x, b, y, o, 4, in, 0, 0, end);
#pragma omp for schedule(static)
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

/* GPT-2's tanh-GELU (torch.nn.functional.gelu(approximate="tanh")), in place. */
static inline float gelu_tanh(float v) {
    return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
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

/* The rest of a GPT-2 block after attention, for one row of width C (MLP width F):
 *     x1 = x + (bo + Wo a)                              attn.c_proj and the first residual
 *     y  = x1 + (bp + Wp gelu(bf + Wf LN(x1)))           ln_2, mlp.c_fc, GELU, mlp.c_proj, the second residual
 * in one parallel region. Sums in the order the model's own code adds them. Scratch: x1 (C), ln (C), h (F). */
void kv_block_tail_f32(const float *restrict x, const float *restrict a, const float *restrict Wo,
                       const float *restrict bo, const float *restrict g, const float *restrict gb, float eps,
                       const float *restrict Wf, const float *restrict bf, const float *restrict Wp,
                       const float *restrict bp, float *restrict x1, float *restrict ln, float *restrict h,
                       float *restrict y, long C, long F, int threads, int rows, long prefetch) {
#pragma omp parallel num_threads(threads)
    {
        share(Wo, a, bo, x1, C, C, rows, prefetch);
#pragma omp for schedule(static)
        for (long i = 0; i < C; i++) x1[i] = x[i] + x1[i];
#pragma omp single
        layer_norm(x1, g, gb, ln, C, eps);
        share(Wf, ln, bf, h, F, C, rows, prefetch);
#pragma omp for schedule(static)
        for (long i = 0; i < F; i++) h[i] = gelu_tanh(h[i]);
        share(Wp, h, bp, y, C, F, rows, prefetch);
#pragma omp for schedule(static)
        for (long i = 0; i < C; i++) y[i] = x1[i] + y[i];
    }
}
