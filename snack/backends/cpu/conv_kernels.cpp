// Native CPU kernels of snack.SparseConv2d: a direct sparse convolution, registered as
// torch.ops.snack_cpu.* next to kernels.cpp (one library). The weight is the layer's sparse
// (out, C·kh·kw) matrix: connection k joins output channel row[k] to input channel
// c = col[k] / (kh·kw) at kernel tap (i, j) = divmod(col[k] % (kh·kw), kw). The input comes
// padded (the layer pads it, with any padding mode), so no kernel tests a bound:
//
//   conv2d_forward (x (N, C, Hp, Wp), values (nnz,), rowptr (out + 1,), col (nnz,), bias (out,)?,
//                   kernel, stride, dilation)                          -> y (N, out, Ho, Wo)
//       y[n, o] = bias[o] + Σ_{k in row o} values[k] · window_k(x[n, c_k])
//   conv2d_input_grad (dy (N, out, Ho, Wo), values, row, col, csc_perm, colptr, input (C, Hp, Wp),
//                      kernel, stride, dilation)                       -> dx (N, C, Hp, Wp)
//       the adjoint: each connection adds values[k] · dy[n, row_k] into its window of dx[n, c_k]
//   conv2d_values_grad (dy, x, rowptr, col, kernel, stride, dilation)  -> dvalues (nnz,)
//       dvalues[k] = Σ_n Σ_{h,w} dy[n, row_k, h, w] · window_k(x[n, c_k])[h, w]
//
// window_k(plane)[h, w] = plane[h·sh + i·dh, w·sw + j·dw], the (Ho, Wo) patch tap (i, j) reads.
//
// Why direct, not im2col: unfolding the input into (N·Ho·Wo, C·kh·kw) rows for the sparse matrix
// product writes kh·kw copies of the input (a 3×3 layer of 64 channels on 32×32 images, batch 32:
// 75 MB), and that copy alone took longer than MKL-DNN's whole dense convolution. Here every
// connection is a multiply-add of one input window into one output plane: the planes of a sample
// stay in cache while its connections are walked, and nothing is unfolded.
//
// Parallelism and determinism: each output element is written by one task, and every sum runs in
// an order fixed by the topology alone, so results do not depend on the thread count. Forward:
// tasks over (sample, output channel). Input gradient: tasks over (sample, input channel), walking
// that channel's connections in column order (csc_perm), so no two tasks write one plane.
// Values gradient: tasks over runs of output channels, each summing over samples in order.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Where connection k's kernel tap sits, as offsets into a padded (Hp, Wp) input plane, and which
// input channel it reads. Decoded once per call: the kernels' inner loops then only add offsets.
struct Taps {
  std::vector<int64_t> channel;  // c_k
  std::vector<int64_t> offset;   // i·dh·Wp + j·dw
};

struct Geometry {
  int64_t kh, kw, sh, sw, dh, dw;  // kernel, stride, dilation
  int64_t C, Hp, Wp, Ho, Wo;       // input channels and padded size, output size

  int64_t plane_in() const { return Hp * Wp; }
  int64_t plane_out() const { return Ho * Wo; }
};

Geometry geometry(at::IntArrayRef input, at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef dilation) {
  TORCH_CHECK(input.size() == 3 && kernel.size() == 2 && stride.size() == 2 && dilation.size() == 2,
              "snack_cpu conv2d: input (C, Hp, Wp), kernel, stride and dilation pairs expected");
  Geometry g{kernel[0], kernel[1], stride[0], stride[1], dilation[0], dilation[1], input[0], input[1], input[2], 0, 0};
  TORCH_CHECK(g.kh > 0 && g.kw > 0 && g.sh > 0 && g.sw > 0 && g.dh > 0 && g.dw > 0,
              "snack_cpu conv2d: kernel, stride and dilation must be positive");
  g.Ho = (g.Hp - g.dh * (g.kh - 1) - 1) / g.sh + 1;
  g.Wo = (g.Wp - g.dw * (g.kw - 1) - 1) / g.sw + 1;
  TORCH_CHECK(g.Hp >= g.dh * (g.kh - 1) + 1 && g.Wp >= g.dw * (g.kw - 1) + 1,
              "snack_cpu conv2d: the padded input is smaller than the dilated kernel");
  return g;
}

Taps decode_taps(const at::Tensor& col, const Geometry& g) {
  const int64_t nnz = col.numel(), taps = g.kh * g.kw;
  const int32_t* c = col.data_ptr<int32_t>();
  Taps t{std::vector<int64_t>(nnz), std::vector<int64_t>(nnz)};
  for (int64_t k = 0; k < nnz; ++k) {
    const int64_t tap = c[k] % taps;
    t.channel[k] = c[k] / taps;
    t.offset[k] = (tap / g.kw) * g.dh * g.Wp + (tap % g.kw) * g.dw;
  }
  return t;
}

void check_common(const at::Tensor& values, const at::Tensor& col, const char* what) {
  TORCH_CHECK(values.dim() == 1 && col.dim() == 1 && values.numel() == col.numel(),
              what, ": values and col must be (nnz,)");
  TORCH_CHECK(col.scalar_type() == at::kInt, what, ": col must be int32");
}

// dst[h, w] += Σ_t v[t] · src_t[h·sh, w·sw] over a (Ho, Wo) window, for up to four taps t at
// once: one pass over the output plane per four connections, not per connection.
template <typename scalar_t, int kTaps>
void add_windows(scalar_t* __restrict dst, const scalar_t* const* src, const scalar_t* v, const Geometry& g) {
  for (int64_t h = 0; h < g.Ho; ++h) {
    scalar_t* __restrict out = dst + h * g.Wo;
    const int64_t in_row = h * g.sh * g.Wp;
    const scalar_t* __restrict s0 = src[0] + in_row;
    const scalar_t* __restrict s1 = src[kTaps > 1 ? 1 : 0] + in_row;
    const scalar_t* __restrict s2 = src[kTaps > 2 ? 2 : 0] + in_row;
    const scalar_t* __restrict s3 = src[kTaps > 3 ? 3 : 0] + in_row;
    const int64_t sw = g.sw;
#pragma omp simd
    for (int64_t w = 0; w < g.Wo; ++w) {
      scalar_t sum = out[w] + v[0] * s0[w * sw];
      if (kTaps > 1) sum += v[1] * s1[w * sw];
      if (kTaps > 2) sum += v[2] * s2[w * sw];
      if (kTaps > 3) sum += v[3] * s3[w * sw];
      out[w] = sum;
    }
  }
}

template <typename scalar_t>
void add_windows_any(scalar_t* dst, const scalar_t* const* src, const scalar_t* v, int64_t count, const Geometry& g) {
  switch (count) {
    case 1: return add_windows<scalar_t, 1>(dst, src, v, g);
    case 2: return add_windows<scalar_t, 2>(dst, src, v, g);
    case 3: return add_windows<scalar_t, 3>(dst, src, v, g);
    default: return add_windows<scalar_t, 4>(dst, src, v, g);
  }
}

// The adjoint of add_windows: dst[h·sh, w·sw] += Σ_t v[t] · src_t[h, w], dst a window of a
// padded input plane, src_t output planes, for up to four connections of one tap (one column),
// which write the same window.
template <typename scalar_t, int kTaps>
void scatter_windows(scalar_t* __restrict dst, const scalar_t* const* src, const scalar_t* v, const Geometry& g) {
  const int64_t sw = g.sw;
  for (int64_t h = 0; h < g.Ho; ++h) {
    scalar_t* __restrict out = dst + h * g.sh * g.Wp;
    const int64_t in_row = h * g.Wo;
    const scalar_t* __restrict s0 = src[0] + in_row;
    const scalar_t* __restrict s1 = src[kTaps > 1 ? 1 : 0] + in_row;
    const scalar_t* __restrict s2 = src[kTaps > 2 ? 2 : 0] + in_row;
    const scalar_t* __restrict s3 = src[kTaps > 3 ? 3 : 0] + in_row;
#pragma omp simd
    for (int64_t w = 0; w < g.Wo; ++w) {
      scalar_t sum = out[w * sw] + v[0] * s0[w];
      if (kTaps > 1) sum += v[1] * s1[w];
      if (kTaps > 2) sum += v[2] * s2[w];
      if (kTaps > 3) sum += v[3] * s3[w];
      out[w * sw] = sum;
    }
  }
}

template <typename scalar_t>
void scatter_windows_any(scalar_t* dst, const scalar_t* const* src, const scalar_t* v, int64_t count,
                         const Geometry& g) {
  switch (count) {
    case 1: return scatter_windows<scalar_t, 1>(dst, src, v, g);
    case 2: return scatter_windows<scalar_t, 2>(dst, src, v, g);
    case 3: return scatter_windows<scalar_t, 3>(dst, src, v, g);
    default: return scatter_windows<scalar_t, 4>(dst, src, v, g);
  }
}

at::Tensor conv2d_forward(const at::Tensor& x, const at::Tensor& values, const at::Tensor& rowptr,
                          const at::Tensor& col, const c10::optional<at::Tensor>& bias, at::IntArrayRef kernel,
                          at::IntArrayRef stride, at::IntArrayRef dilation) {
  check_common(values, col, "conv2d_forward");
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && x.scalar_type() == values.scalar_type(),
              "conv2d_forward: x must be a contiguous (N, C, Hp, Wp) tensor of the values' dtype");
  TORCH_CHECK(rowptr.dim() == 1 && rowptr.numel() >= 1 && rowptr.scalar_type() == at::kInt,
              "conv2d_forward: rowptr must be (out + 1,) int32");
  const Geometry g = geometry(x.sizes().slice(1), kernel, stride, dilation);
  const int64_t N = x.size(0), O = rowptr.numel() - 1;
  auto y = at::empty({N, O, g.Ho, g.Wo}, x.options());
  if (bias.has_value()) TORCH_CHECK(bias->dim() == 1 && bias->numel() == O && bias->is_contiguous(),
                                    "conv2d_forward: bias must be (out,)");
  if (y.numel() == 0) return y;
  const Taps taps = decode_taps(col, g);
  const int32_t* rp = rowptr.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_forward", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    const scalar_t* bd = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yd = y.data_ptr<scalar_t>();
    at::parallel_for(0, N * O, 1, [&](int64_t begin, int64_t end) {
      const scalar_t* src[4];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / O, o = task % O;
        scalar_t* plane = yd + task * g.plane_out();
        const scalar_t start = bd != nullptr ? bd[o] : scalar_t(0);
        for (int64_t e = 0; e < g.plane_out(); ++e) plane[e] = start;
        const scalar_t* sample = xd + n * g.C * g.plane_in();
        for (int64_t k = rp[o]; k < rp[o + 1]; k += 4) {
          const int64_t count = std::min<int64_t>(4, rp[o + 1] - k);
          for (int64_t t = 0; t < count; ++t) src[t] = sample + taps.channel[k + t] * g.plane_in() + taps.offset[k + t];
          add_windows_any(plane, src, vd + k, count, g);
        }
      }
    });
  });
  return y;
}

at::Tensor conv2d_input_grad(const at::Tensor& dy, const at::Tensor& values, const at::Tensor& row,
                             const at::Tensor& col, const at::Tensor& csc_perm, const at::Tensor& colptr,
                             at::IntArrayRef input, at::IntArrayRef kernel, at::IntArrayRef stride,
                             at::IntArrayRef dilation) {
  check_common(values, col, "conv2d_input_grad");
  const Geometry g = geometry(input, kernel, stride, dilation);
  TORCH_CHECK(dy.dim() == 4 && dy.is_contiguous() && dy.scalar_type() == values.scalar_type() &&
                  dy.size(2) == g.Ho && dy.size(3) == g.Wo,
              "conv2d_input_grad: dy must be a contiguous (N, out, Ho, Wo) tensor of the values' dtype");
  TORCH_CHECK(row.numel() == col.numel() && csc_perm.numel() == col.numel() &&
                  colptr.numel() == g.C * g.kh * g.kw + 1 && row.scalar_type() == at::kInt &&
                  csc_perm.scalar_type() == at::kInt && colptr.scalar_type() == at::kInt,
              "conv2d_input_grad: row, csc_perm (nnz,) and colptr (C·kh·kw + 1,) int32 expected");
  const int64_t N = dy.size(0), O = dy.size(1), taps_per_channel = g.kh * g.kw;
  auto dx = at::zeros({N, g.C, g.Hp, g.Wp}, dy.options());
  if (dx.numel() == 0 || dy.numel() == 0) return dx;
  const Taps taps = decode_taps(col, g);
  const int32_t* rd = row.data_ptr<int32_t>();
  const int32_t* perm = csc_perm.data_ptr<int32_t>();
  const int32_t* cp = colptr.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES(dy.scalar_type(), "conv2d_input_grad", [&] {
    const scalar_t* dyd = dy.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    scalar_t* dxd = dx.data_ptr<scalar_t>();
    at::parallel_for(0, N * g.C, 1, [&](int64_t begin, int64_t end) {
      scalar_t v[4];
      const scalar_t* src[4];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / g.C, c = task % g.C;
        scalar_t* plane = dxd + task * g.plane_in();
        const scalar_t* sample = dyd + n * O * g.plane_out();
        for (int64_t column = c * taps_per_channel; column < (c + 1) * taps_per_channel; ++column) {
          for (int64_t p = cp[column]; p < cp[column + 1]; p += 4) {
            const int64_t count = std::min<int64_t>(4, cp[column + 1] - p);
            for (int64_t t = 0; t < count; ++t) {
              const int64_t k = perm[p + t];
              v[t] = vd[k];
              src[t] = sample + rd[k] * g.plane_out();
            }
            scatter_windows_any(plane + taps.offset[perm[p]], src, v, count, g);
          }
        }
      }
    });
  });
  return dx;
}

// Σ over a (Ho, Wo) window of dy[h, w] · src[h·sh, w·sw], for four taps at once against one dy
// plane (the connections of one output channel share it).
template <typename scalar_t>
void window_dots(const scalar_t* __restrict dy, const scalar_t* const* src, int64_t count, const Geometry& g,
                 scalar_t* result) {
  // per-lane partial sums, reduced once at the end: a reduction per row cost more than the row
  constexpr int kLanes = 16;
  scalar_t lanes[4][kLanes] = {};
  const int64_t sw = g.sw;
  for (int64_t h = 0; h < g.Ho; ++h) {
    const scalar_t* d = dy + h * g.Wo;
    const int64_t in_row = h * g.sh * g.Wp;
    const scalar_t* s0 = src[0] + in_row;
    const scalar_t* s1 = src[count > 1 ? 1 : 0] + in_row;
    const scalar_t* s2 = src[count > 2 ? 2 : 0] + in_row;
    const scalar_t* s3 = src[count > 3 ? 3 : 0] + in_row;
    int64_t w = 0;
    for (; w + kLanes <= g.Wo; w += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const scalar_t dv = d[w + l];
        lanes[0][l] += dv * s0[(w + l) * sw];
        lanes[1][l] += dv * s1[(w + l) * sw];
        lanes[2][l] += dv * s2[(w + l) * sw];
        lanes[3][l] += dv * s3[(w + l) * sw];
      }
    }
    for (int l = 0; w < g.Wo; ++w, ++l) {
      const scalar_t dv = d[w];
      lanes[0][l] += dv * s0[w * sw];
      lanes[1][l] += dv * s1[w * sw];
      lanes[2][l] += dv * s2[w * sw];
      lanes[3][l] += dv * s3[w * sw];
    }
  }
  for (int64_t t = 0; t < count; ++t) {
    scalar_t sum = 0;
    for (int l = 0; l < kLanes; ++l) sum += lanes[t][l];
    result[t] = sum;
  }
}

at::Tensor conv2d_values_grad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rowptr,
                              const at::Tensor& col, at::IntArrayRef kernel, at::IntArrayRef stride,
                              at::IntArrayRef dilation) {
  TORCH_CHECK(col.dim() == 1 && col.scalar_type() == at::kInt, "conv2d_values_grad: col must be (nnz,) int32");
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && dy.dim() == 4 && dy.is_contiguous() &&
                  x.scalar_type() == dy.scalar_type() && x.size(0) == dy.size(0),
              "conv2d_values_grad: dy (N, out, Ho, Wo) and x (N, C, Hp, Wp) must be contiguous, of one dtype");
  const Geometry g = geometry(x.sizes().slice(1), kernel, stride, dilation);
  TORCH_CHECK(dy.size(2) == g.Ho && dy.size(3) == g.Wo && rowptr.numel() == dy.size(1) + 1 &&
                  rowptr.scalar_type() == at::kInt,
              "conv2d_values_grad: dy's size does not match x and the kernel, or rowptr is not (out + 1,) int32");
  const int64_t N = x.size(0), O = dy.size(1), nnz = col.numel();
  auto dvalues = at::zeros({nnz}, x.options());
  if (nnz == 0 || N == 0 || g.plane_out() == 0) return dvalues;
  const Taps taps = decode_taps(col, g);
  const int32_t* rp = rowptr.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_values_grad", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* dyd = dy.data_ptr<scalar_t>();
    scalar_t* dvd = dvalues.data_ptr<scalar_t>();
    // samples outermost inside a task: one sample's input planes and output gradients stay in
    // cache while the task's connections are scored against them
    at::parallel_for(0, O, 1, [&](int64_t first, int64_t last) {
      const scalar_t* src[4];
      scalar_t dots[4];
      for (int64_t n = 0; n < N; ++n) {
        const scalar_t* sample = xd + n * g.C * g.plane_in();
        for (int64_t o = first; o < last; ++o) {
          const scalar_t* plane = dyd + (n * O + o) * g.plane_out();
          for (int64_t k = rp[o]; k < rp[o + 1]; k += 4) {
            const int64_t count = std::min<int64_t>(4, rp[o + 1] - k);
            for (int64_t t = 0; t < count; ++t) src[t] = sample + taps.channel[k + t] * g.plane_in() + taps.offset[k + t];
            window_dots(plane, src, count, g, dots);
            for (int64_t t = 0; t < count; ++t) dvd[k + t] += dots[t];
          }
        }
      }
    });
  });
  return dvalues;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def(
      "conv2d_forward(Tensor x, Tensor values, Tensor rowptr, Tensor col, Tensor? bias, int[2] kernel, "
      "int[2] stride, int[2] dilation) -> Tensor");
  m.def(
      "conv2d_input_grad(Tensor dy, Tensor values, Tensor row, Tensor col, Tensor csc_perm, Tensor colptr, "
      "int[3] input, int[2] kernel, int[2] stride, int[2] dilation) -> Tensor");
  m.def(
      "conv2d_values_grad(Tensor dy, Tensor x, Tensor rowptr, Tensor col, int[2] kernel, int[2] stride, "
      "int[2] dilation) -> Tensor");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("conv2d_forward", &conv2d_forward);
  m.impl("conv2d_input_grad", &conv2d_input_grad);
  m.impl("conv2d_values_grad", &conv2d_values_grad);
}
