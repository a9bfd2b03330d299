// The kernels of qmm_t.c as MLX primitives: nodes of MLX's own graph, run
// on its CPU stream when the graph is evaluated.
//
// Why: engine.mlx.qmm_linear first called the kernels from Python, which
// has to evaluate each layer's input before the call (mx.eval, a round trip
// to MLX's CPU stream thread) and wrap the result back into an array: ~40-70
// us a call, ~200 calls a decode step, and the graph cut into ~120 pieces.
// On SmolLM2-135M that overhead ate the float32 kernel's whole gain; on the
// Qwen 1.5B it was ~30 ms of a ~100 ms step (python -m bench.cpu.qmm_step).
// As primitives the kernels cost what MLX's own matmul costs to schedule.
//
// Built by engine.mlx.mlx_ops against the installed MLX's headers and the
// nanobind MLX's Python module was built with (its ABI and domain "mlx":
// only then does an mx.array cross into these functions). The arithmetic
// is qmm_t.c's, unchanged: qmm keeps MLX's quantized_matmul bits (or the
// dot path's, where asked), fmm is the float32 kernel.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
using namespace mlx::core;

extern "C" {
int fmm_t(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, int nthreads);
int fmm_t_available(void);
int qmm_t(float* y, const float* x, const uint32_t* w, const float* scales, const float* biases, int64_t M,
          int64_t N, int64_t K, int bits, int group_size, int nthreads);
int qmm_t_dot(float* y, const float* x, const uint32_t* w, const float* scales, const float* biases, int64_t M,
              int64_t N, int64_t K, int bits, int group_size, int nthreads);
}

namespace {

void check_inputs(const std::vector<array>& inputs, const char* name) {
  for (const auto& a : inputs)
    if (!a.flags().row_contiguous)  // the builders below make them so
      throw std::runtime_error(std::string(name) + ": an input is not row-contiguous");
}

// y = x @ w^T, float32 x (..., K) and w (N, K).
class EmberFmm : public UnaryPrimitive {
 public:
  EmberFmm(Stream s, int threads) : UnaryPrimitive(s), threads_(threads) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    check_inputs(inputs, name());
    const array& x = inputs[0];
    const array& w = inputs[1];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& enc = cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_input_array(w);
    enc.set_output_array(out);
    const int64_t K = w.shape(1), N = w.shape(0), M = x.size() / K;
    enc.dispatch([xp = x.data<float>(), wp = w.data<float>(), yp = out.data<float>(), M, N, K, t = threads_]() {
      if (fmm_t(yp, xp, wp, M, N, K, t) != 0) throw std::runtime_error("fmm_t refused its arguments");
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override { throw std::runtime_error("EmberFmm runs on the CPU"); }
  const char* name() const override { return "EmberFmm"; }
  bool is_equivalent(const Primitive& other) const override {
    return threads_ == static_cast<const EmberFmm&>(other).threads_;
  }

 private:
  int threads_;
};

// y = x @ dequantize(w, scales, biases)^T for MLX's affine quantization.
class EmberQmm : public UnaryPrimitive {
 public:
  EmberQmm(Stream s, int bits, int group_size, bool dot, int threads)
      : UnaryPrimitive(s), bits_(bits), group_size_(group_size), dot_(dot), threads_(threads) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    check_inputs(inputs, name());
    const array& x = inputs[0];
    const array& w = inputs[1];
    const array& s = inputs[2];
    const array& b = inputs[3];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& enc = cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    const int64_t N = w.shape(0), K = w.shape(1) * 32 / bits_, M = x.size() / K;
    enc.dispatch([xp = x.data<float>(), wp = w.data<uint32_t>(), sp = s.data<float>(), bp = b.data<float>(),
                  yp = out.data<float>(), M, N, K, bits = bits_, gs = group_size_, dot = dot_, t = threads_]() {
      // the dot path declines what it does not take (then the exact kernel runs)
      if (dot && qmm_t_dot(yp, xp, wp, sp, bp, M, N, K, bits, gs, t) == 0) return;
      if (qmm_t(yp, xp, wp, sp, bp, M, N, K, bits, gs, t) != 0) throw std::runtime_error("qmm_t refused its arguments");
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override { throw std::runtime_error("EmberQmm runs on the CPU"); }
  const char* name() const override { return "EmberQmm"; }
  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const EmberQmm&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && dot_ == o.dot_ && threads_ == o.threads_;
  }

 private:
  int bits_, group_size_;
  bool dot_;
  int threads_;
};

Shape out_shape(const array& x, int n) {
  Shape s = x.shape();
  s.back() = n;
  return s;
}

array fmm(const array& x, const array& w, int threads) {
  if (!fmm_t_available()) throw std::invalid_argument("fmm: this build has no float32 kernel (no AVX-512)");
  if (x.dtype() != float32 || w.dtype() != float32 || w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("fmm: float32 x (..., K) and w (N, K)");
  auto st = default_stream(Device::cpu);
  return array(out_shape(x, w.shape(0)), float32, std::make_shared<EmberFmm>(st, threads),
               {contiguous(x, false, st), contiguous(w, false, st)});
}

array qmm(const array& x, const array& w, const array& scales, const array& biases, int bits, int group_size,
          bool dot, int threads) {
  if (x.dtype() != float32 || w.dtype() != uint32 || scales.dtype() != float32 || biases.dtype() != float32 ||
      w.ndim() != 2 || x.ndim() < 1 || (bits != 2 && bits != 4 && bits != 8) ||
      x.shape(-1) != w.shape(1) * 32 / bits)
    throw std::invalid_argument("qmm: float32 x (..., K), uint32 w (N, K*bits/32), float32 scales and biases");
  const int64_t K = x.shape(-1);
  if (group_size <= 0 || K % group_size || group_size % (32 / bits) || scales.ndim() != 2 ||
      scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size || biases.shape() != scales.shape())
    throw std::invalid_argument("qmm: the groups do not match (what qmm_t would refuse)");
  auto st = default_stream(Device::cpu);
  return array(out_shape(x, w.shape(0)), float32, std::make_shared<EmberQmm>(st, bits, group_size, dot, threads),
               {contiguous(x, false, st), contiguous(w, false, st), contiguous(scales, false, st),
                contiguous(biases, false, st)});
}

}  // namespace

NB_MODULE(_ember_mlx_ops, m) {
  m.def("fmm", &fmm, nb::arg("x"), nb::arg("w"), nb::arg("threads"));
  m.def("qmm", &qmm, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"),
        nb::arg("group_size"), nb::arg("dot"), nb::arg("threads"));
  m.def("fmm_available", []() { return fmm_t_available() != 0; });
}
