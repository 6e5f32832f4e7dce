// linear.cpp's exact ops, its ISA choice and its SiLU, for the ops that fall back to them or
// share them (prefill.cpp, decode_q8.cpp). Part of the library's digest (nxdc/kernels/__init__.py).
#pragma once
#include <torch/extension.h>

#include <optional>

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& min);
at::Tensor linear_i4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& min);
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& min);

namespace nxdc_cpu {
bool has_avx512();
// Whether the environment variable `name` is set to "0" (a path turned off).
bool turned_off(const char* name);
// o[0..n) = silu(g) * u, the same bits wherever an element sits
void silu_mul_row(const float* g, const float* u, float* o, int64_t n);
}  // namespace nxdc_cpu
