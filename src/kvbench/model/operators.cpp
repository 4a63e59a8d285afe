// The CPU kernels of kvbench's operators, registered with torch's dispatcher (model/operators.py).
//
// `--compile max` runs a decode step as Inductor's generated C++, which calls an operator Inductor cannot see into
// through the dispatcher. A kernel registered from Python makes each of those calls enter the interpreter (take the
// GIL, box the arguments, run the Python function, unbox its answer): about 20 us a call, 49 GEMVs and 12 attentions
// a gpt2 step. Registered here, the call stays in C++: the dispatcher, an output tensor, and the C kernel.
//
// The kernels are gemv.c's, as model/gemv.py built, checked and tuned them on this machine: operators.py hands their
// addresses and the way of reading rows to `kv_bind` before a compiled step runs. This file computes nothing itself,
// so it is built once per torch and compiler, not per CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <optional>

namespace {

// kv_gemv_f32(W, x, b, y, out, in, threads, rows, prefetch)
using GemvFn = void (*)(const float *, const float *, const float *, float *, long, long, int, int, long);
// kv_attend_f32(q, K, V, allowed, out, B, H, L, Dh, scratch, threads)
using AttendFn = void (*)(const float *, const float *, const float *, const unsigned char *, float *, long, long, long,
                          long, float *, int);

std::atomic<GemvFn> gemv_fn{nullptr};
std::atomic<AttendFn> attend_fn{nullptr};
std::atomic<int> rows{1};
std::atomic<long> prefetch{0};
std::atomic<long> gemv_calls{0};
std::atomic<long> attend_calls{0};

// x (..., in) one row, weight (out, in), bias (out,) or None; float32, contiguous (model/matmul.py checks) -> (..., out)
at::Tensor gemv(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    GemvFn fn = gemv_fn.load();
    TORCH_CHECK(fn != nullptr, "kvbench::gemv: no kernel bound (model/operators.py binds it before a compiled step)");
    const int64_t n_out = weight.size(0), n_in = weight.size(1);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n_out;
    at::Tensor y = at::empty(shape, x.options());
    fn(weight.const_data_ptr<float>(), x.const_data_ptr<float>(), bias ? bias->const_data_ptr<float>() : nullptr,
       y.mutable_data_ptr<float>(), n_out, n_in, at::get_num_threads(), rows.load(), prefetch.load());
    gemv_calls.fetch_add(1);
    return y;
}

// q (B, H, 1, Dh); k, v (B, H, L, Dh) contiguous; allowed (B, 1, 1, L) bool contiguous -> (B, H, 1, Dh)
at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &allowed) {
    AttendFn fn = attend_fn.load();
    TORCH_CHECK(fn != nullptr, "kvbench::decode_attention: no kernel bound (model/operators.py binds it)");
    const int64_t B = k.size(0), H = k.size(1), L = k.size(2), Dh = k.size(3);
    at::Tensor query = q.contiguous();  // c_attn's row seen per head is strided
    at::Tensor out = at::empty({B, H, 1, Dh}, q.options());
    at::Tensor scratch = at::empty({B * H * L}, q.options());  // each (row, head)'s scores
    fn(query.const_data_ptr<float>(), k.const_data_ptr<float>(), v.const_data_ptr<float>(),
       reinterpret_cast<const unsigned char *>(allowed.const_data_ptr<bool>()), out.mutable_data_ptr<float>(), B, H, L,
       Dh, scratch.mutable_data_ptr<float>(), at::get_num_threads());
    attend_calls.fetch_add(1);
    return out;
}

}  // namespace

extern "C" {
// The kernels the operators call, and how the GEMV reads its rows (gemv.py's Kernel).
void kv_bind(void *gemv, void *attend, int way_rows, long way_prefetch) {
    gemv_fn.store(reinterpret_cast<GemvFn>(gemv));
    attend_fn.store(reinterpret_cast<AttendFn>(attend));
    rows.store(way_rows);
    prefetch.store(way_prefetch);
}

// How many calls each operator has run in this process (bench reports which attention a compiled step ran).
long kv_gemv_calls(void) { return gemv_calls.load(); }
long kv_attend_calls(void) { return attend_calls.load(); }
}

TORCH_LIBRARY_IMPL(kvbench, CPU, m) {
    m.impl("gemv", &gemv);
    m.impl("decode_attention", &decode_attention);
}
