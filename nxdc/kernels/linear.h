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

// A weight's per-group scales or mins [N, ng], stored as fp32 or fp16 (--weights int4: fp16, as
// llama.cpp's Q4_1 / Q8_0 keep theirs), read a row at a time as fp32. An fp32 row is the tensor's
// own; an fp16 row is converted (exactly) into the caller's buffer of ng floats.
struct GroupRows {
  const void* p = nullptr;  // null: none (no min, or per-row scales)
  bool half = false;
  int64_t ng = 0;
  const float* row(int64_t n, float* buf) const;
  GroupRows from(int64_t n0) const;  // the rows from n0 on
};
// t: [N, ng] float32 or float16, contiguous; undefined: none
GroupRows group_rows(const at::Tensor& t);
// This thread's scratch of at least n floats (for GroupRows::row's buffers); valid until the
// thread's next call.
float* scratch_floats(int64_t n);
}  // namespace nxdc_cpu
