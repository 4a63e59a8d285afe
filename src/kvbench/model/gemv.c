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
 */
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

/* A thread's share: rows [0, grouped) four at a time, the rest one by one. */
static inline __attribute__((always_inline)) void share(const float *restrict W, const float *restrict x,
                                                         const float *restrict b, float *restrict y, long out,
                                                         long in, long grouped, const int PF, long prefetch) {
    const char *end = (const char *)(W + out * in);
#pragma omp for schedule(static) nowait
    for (long o = 0; o < grouped; o += 4) dot_rows(W, x, b, y, o, 4, in, PF, prefetch, end);
#pragma omp for schedule(static)
    for (long o = grouped; o < out; o++) dot_rows(W, x, b, y, o, 1, in, PF, prefetch, end);
}

void kv_gemv_f32(const float *restrict W, const float *restrict x, const float *restrict b, float *restrict y,
                 long out, long in, int threads, int rows, long prefetch) {
    const long grouped = rows == 4 ? out / 4 * 4 : 0;
#pragma omp parallel num_threads(threads)
    {
        if (prefetch > 0)
            share(W, x, b, y, out, in, grouped, 1, prefetch);
        else
            share(W, x, b, y, out, in, grouped, 0, 0);
    }
}
