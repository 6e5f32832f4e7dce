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

// A weight's per-group scales or mins, read a row at a time as fp32 (model/quant.py: group_values):
//   F32 / F16: [N, ng] float32 or float16 (--weights int4: fp16, as llama.cpp's Q4_1 / Q8_0 keep
//              theirs); an fp32 row is the tensor's own, an fp16 row is converted exactly;
//   K: uint8 [N, 2 * nsb + ng], a GGUF K-quant's two-level scales for rows of K = 256 * nsb
//      inputs: per row the nsb fp16 factors d (one a super-block of 256 weights), then the ng
//      int8 factors c (one a group); a group's value is d * c, exact in fp32 (11 + 8 bits).
// Converted rows go into the caller's buffer of ng floats.
constexpr int64_t SUPER = 256;  // weights a super-block of two-level scales (GGUF's QK_K)
struct GroupRows {
  enum class Kind { F32, F16, K };
  const void* p = nullptr;  // null: none (no min, or per-row scales)
  Kind kind = Kind::F32;
  int64_t ng = 0;   // groups a row
  int64_t nsb = 0;  // K: super-blocks a row
  const float* row(int64_t n, float* buf) const;
  GroupRows from(int64_t n0) const;  // the rows from n0 on
  int64_t row_bytes() const;
};
// t: contiguous, as above, for rows of K inputs; undefined: none
GroupRows group_rows(const at::Tensor& t, int64_t K);
// Groups a row of group scales t ([N, ng] float, or the K layout for K inputs); 0 for anything else.
int64_t scale_groups(const at::Tensor& t, int64_t K);
// Group scales or mins of any layout (rows of K inputs) as a float32 [N, ng] tensor.
at::Tensor scales_f32(const at::Tensor& t, int64_t K);
// This thread's scratch of at least n floats (for GroupRows::row's buffers); valid until the
// thread's next call.
float* scratch_floats(int64_t n);
}  // namespace nxdc_cpu
