/* kvbench's CPU matrix-vector product for one-row float32 projections (model/gemv.py builds and loads it).
 *
 * y[o] = b[o] + W[o, :] . x  for o in [0, out): W (out, in) row-major, x (in,), b (out,) or NULL, y (out,).
 * Rows are split statically over `threads` OpenMP threads (torch's own pool where torch uses GNU OpenMP: the
 * library's libgomp.so.1 is the one torch has loaded). A thread reads `rows` rows at a time (1 or 4: one stream
 * or four, whichever streams faster on this CPU; model/gemv.py times both once per machine), each row in order.
 * A row is summed the same way in either: LANES running sums over its chunks of LANES floats, then its tail, then
 * the lanes in order. So y does not depend on `rows` or on the thread count, bit for bit.
 */
#include <stddef.h>

#define LANES 16

/* y[o0 + r] for r in [0, R): R rows read side by side. Inlined with a constant R, so the loops unroll. */
static inline __attribute__((always_inline)) void dot_rows(const float *restrict W, const float *restrict x,
                                                            const float *restrict b, float *restrict y, long o0,
                                                            const int R, long in) {
    const float *restrict w = W + o0 * in;
    float acc[4][LANES] = {{0}};
    long i = 0;
    for (; i + LANES <= in; i += LANES) {
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

void kv_gemv_f32(const float *restrict W, const float *restrict x, const float *restrict b, float *restrict y,
                 long out, long in, int threads, int rows) {
    const long grouped = rows == 4 ? out / 4 * 4 : 0; /* rows [0, grouped) four at a time, the rest one by one */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (long o = 0; o < grouped; o += 4) dot_rows(W, x, b, y, o, 4, in);
#pragma omp for schedule(static)
        for (long o = grouped; o < out; o++) dot_rows(W, x, b, y, o, 1, in);
    }
}
