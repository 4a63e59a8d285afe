/* kvbench's CPU matrix-vector product for one-row float32 projections (model/gemv.py builds and loads it).
 *
 * y[o] = b[o] + W[o, :] . x  for o in [0, out): W (out, in) row-major, x (in,), b (out,) or NULL, y (out,).
 * Rows are split statically over `threads` OpenMP threads (torch's own pool where torch uses GNU OpenMP: the
 * library's libgomp.so.1 is the one torch has loaded). Each row is one sequential read of its `in` floats, summed
 * in SIMD lanes (the compiler's, for the CPU it was built on), so a row's sum does not depend on the thread count.
 */
#include <stddef.h>

void kv_gemv_f32(const float *restrict W, const float *restrict x, const float *restrict b, float *restrict y,
                 long out, long in, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++) {
        const float *restrict w = W + o * in;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < in; i++) s += w[i] * x[i];
        y[o] = b ? s + b[o] : s;
    }
}
