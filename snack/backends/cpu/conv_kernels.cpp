// Native CPU kernels of snack.SparseConv2d: a direct sparse convolution, registered as
// torch.ops.snack_cpu.* next to kernels.cpp (one library). The weight is the layer's sparse
// (out, C·kh·kw) matrix: connection k joins output channel row[k] to input channel
// c = col[k] / (kh·kw) at kernel tap (i, j) = divmod(col[k] % (kh·kw), kw). The input comes
// padded (the layer pads it, with any padding mode), so no kernel tests a bound:
//
//   conv2d_forward (x (N, C, Hp, Wp), values (nnz,), rowptr (out + 1,), col (nnz,), bias (out,)?,
//                   kernel, stride, dilation)                          -> y (N, out, Ho, Wo)
//       y[n, o] = bias[o] + Σ_{k in row o} values[k] · window_k(x[n, c_k])
//   conv2d_backward (dy (N, out, Ho, Wo), x, values, row, col, rowptr, csc_perm, colptr, kernel,
//                    stride, dilation, crop, input_grad, values_grad, bias_grad)
//                                          -> (dx (N, C, H, W), dvalues (nnz,), dbias (out,))
//       dx: the adjoint, each connection adds values[k] · dy[n, row_k] into its window of dx[n, c_k],
//       less the zero padding crop = (left, right, top, bottom) the caller added to x (H = Hp -
//       top - bottom, W = Wp - left - right);
//       dvalues[k] = Σ_n Σ_{h,w} dy[n, row_k, h, w] · window_k(x[n, c_k])[h, w];
//       dbias[o] = Σ_n Σ_{h,w} dy[n, o, h, w]; each is empty (first dimension 0) when not asked for.
//
// window_k(plane)[h, w] = plane[h·sh + i·dh, w·sw + j·dw], the (Ho, Wo) patch tap (i, j) reads.
//
// Why direct, not im2col: unfolding the input into (N·Ho·Wo, C·kh·kw) rows for the sparse matrix
// product writes kh·kw copies of the input (a 3×3 layer of 64 channels on 32×32 images, batch 32:
// 75 MB), and that copy alone took longer than MKL-DNN's whole dense convolution. Here every
// connection is a multiply-add of one input window into one output plane: the planes of a sample
// stay in cache while its connections are walked, and nothing is unfolded.
//
// Flat walk (stride 1): a window's rows lie Wp apart in the input, as the rows of an output plane
// laid out Wp wide do. So output position q = h·Wp + w reads input offset + q, and a whole window
// is one contiguous run of L = (Ho - 1)·Wp + Wo elements, walked by one vector loop; the Wp - Wo
// columns past each output row are computed and dropped (forward), or read as zeros of a widened
// dy (backward). Walking row by row instead ran a short loop per row: at 8×8 images (Wo = 8, half
// an AVX-512 vector) the values gradient ran scalar. Other strides walk row by row.
//
// Measured and dropped: register blocking of the forward (a block of 64 consecutive flat outputs
// of a sample summed in four vector registers over a row's connections, channel after channel,
// compacted into the output per block): the same bits, but 0.81-1.18x the time of the passes
// below (AMD Zen 4, 2 threads). Both are bound by loading one window vector per multiply-add,
// mostly from L2 and split across cache lines; a vector is reused only by connections of one
// (channel, tap) column, which share no output. Also dropped: the values gradient's sample
// blocks in the forward (its passes write, not reduce): 0.92-1.04x, bit-identical.
//
// Parallelism and determinism: each output element is written by one task, and every sum runs in
// an order fixed by the topology alone, so results do not depend on the thread count. Forward:
// tasks over (sample, output channel). Input gradient: tasks over (sample, input channel), walking
// that channel's connections in column order (csc_perm), so no two tasks write one plane.
// Values gradient: tasks over runs of output channels, each summing over samples in order (in
// blocks of a few samples whose sums are reduced together, a block size fixed by the image size).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

struct Geometry {
  int64_t kh, kw, sh, sw, dh, dw;  // kernel, stride, dilation
  int64_t C, Hp, Wp, Ho, Wo;       // input channels and padded size, output size

  int64_t plane_in() const { return Hp * Wp; }
  int64_t plane_out() const { return Ho * Wo; }
  bool flat() const { return sh == 1 && sw == 1; }
  // the flat walk's run: output rows laid out Wp wide, the last one Wo long
  int64_t run() const { return (Ho - 1) * Wp + Wo; }
};

Geometry geometry(at::IntArrayRef input, at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef dilation) {
  TORCH_CHECK(input.size() == 3 && kernel.size() == 2 && stride.size() == 2 && dilation.size() == 2,
              "snack_cpu conv2d: input (C, Hp, Wp), kernel, stride and dilation pairs expected");
  Geometry g{kernel[0], kernel[1], stride[0], stride[1], dilation[0], dilation[1], input[0], input[1], input[2], 0, 0};
  TORCH_CHECK(g.kh > 0 && g.kw > 0 && g.sh > 0 && g.sw > 0 && g.dh > 0 && g.dw > 0,
              "snack_cpu conv2d: kernel, stride and dilation must be positive");
  TORCH_CHECK(g.Hp >= g.dh * (g.kh - 1) + 1 && g.Wp >= g.dw * (g.kw - 1) + 1,
              "snack_cpu conv2d: the padded input is smaller than the dilated kernel");
  g.Ho = (g.Hp - g.dh * (g.kh - 1) - 1) / g.sh + 1;
  g.Wo = (g.Wp - g.dw * (g.kw - 1) - 1) / g.sw + 1;
  return g;
}

// Where connection k's kernel tap sits, as an offset into a padded (Hp, Wp) input plane, and which
// input channel it reads. Decoded once per call: the inner loops then only add offsets.
struct Taps {
  std::vector<int64_t> channel;  // c_k
  std::vector<int64_t> offset;   // i·dh·Wp + j·dw
};

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

// How a window and a plane are walked: `rows` runs of `len` elements; run r of the plane starts
// at r · plane_row, of the window at r · window_row, whose elements lie window_col apart. The flat
// walk is one run (window_col 1); the row walk is Ho runs of Wo.
struct Walk {
  int64_t rows, len, plane_row, window_row, window_col;
};

Walk flat_walk(const Geometry& g) { return {1, g.run(), 0, 0, 1}; }

// The values gradient's flat walk over a block of samples: one run per sample (the same output
// channel's dy plane, the same channel's window), so that a block's dot products are reduced once.
// At 8×8 images (runs of 78 elements) reducing per sample took most of the time: blocks of
// ceil(512 / run) samples, at most 8 (whose input planes stay in L2 at such sizes).
int64_t samples_per_block(const Geometry& g) { return std::clamp<int64_t>((512 + g.run() - 1) / g.run(), 1, 8); }
Walk sample_walk(const Geometry& g, int64_t samples, int64_t O, int64_t dy_plane) {
  return {samples, g.run(), O * dy_plane, g.C * g.plane_in(), 1};
}
Walk row_walk(const Geometry& g) { return {g.Ho, g.Wo, g.Wo, g.sh * g.Wp, g.sw}; }

// Up to kPass connections are handled per pass (kTaps): one load and store of each output element
// per kPass multiply-adds. Eight rather than four: forward and input gradient 1.05-1.25x faster
// (kernel A/B, AMD Zen 4; the values gradient, which stores nothing per element, the same within
// noise). kUnit: window_col is 1, so the loop vectorises with plain loads rather than gathers.
constexpr int kPass = 8;

// out[r, e] += Σ_t v[t] · in_t[r, e] over a walk's runs, element (r, e) of out at r · out_row +
// e · out_col and of in_t at r · in_row + e · in_col: the forward (out a plane, in_t windows:
// multiply_add(plane, walk.plane_row, 1, windows, walk.window_row, walk.window_col, ...)) and the
// input gradient (out a window, in_t the dy planes of connections of one tap, which write the same
// window). With kUnit, both columns are 1.
template <typename scalar_t, int kTaps, bool kUnit>
void multiply_add(scalar_t* __restrict out, int64_t out_row, int64_t out_col, const scalar_t* const* in,
                  int64_t in_row, int64_t in_col, const scalar_t* v, const Walk& walk) {
  const int64_t out_step = kUnit ? 1 : out_col, in_step = kUnit ? 1 : in_col;
  scalar_t w[kTaps];
  for (int t = 0; t < kTaps; ++t) w[t] = v[t];
  for (int64_t r = 0; r < walk.rows; ++r) {
    scalar_t* __restrict o = out + r * out_row;
    const scalar_t* s[kTaps];
    for (int t = 0; t < kTaps; ++t) s[t] = in[t] + r * in_row;
#pragma omp simd
    for (int64_t e = 0; e < walk.len; ++e) {
      scalar_t sum = o[e * out_step];
#pragma GCC unroll 8
      for (int t = 0; t < kTaps; ++t) sum += w[t] * s[t][e * in_step];
      o[e * out_step] = sum;
    }
  }
}

template <typename scalar_t, int kTaps, bool kUnit>
void add_windows(scalar_t* plane, const scalar_t* const* window, const scalar_t* v, const Walk& walk) {
  multiply_add<scalar_t, kTaps, kUnit>(plane, walk.plane_row, 1, window, walk.window_row, walk.window_col, v, walk);
}

template <typename scalar_t, int kTaps, bool kUnit>
void scatter_planes(scalar_t* window, const scalar_t* const* plane, const scalar_t* v, const Walk& walk) {
  multiply_add<scalar_t, kTaps, kUnit>(window, walk.window_row, walk.window_col, plane, walk.plane_row, 1, v, walk);
}

// result[t] = Σ_e plane[e] · window_t[e]: the values gradient, for connections of one output
// channel (one plane; the flat walk's runs may be several samples' planes, see sample_walk).
// Per-lane partial sums, reduced once at the end: a reduction per row cost more than the row.
template <typename scalar_t, int kTaps, bool kUnit>
void window_dots(const scalar_t* __restrict plane, const scalar_t* const* window, const Walk& walk, scalar_t* result) {
  constexpr int kLanes = 16;
  const int64_t step = kUnit ? 1 : walk.window_col;
  scalar_t lanes[kTaps][kLanes] = {};
  for (int64_t r = 0; r < walk.rows; ++r) {
    const scalar_t* d = plane + r * walk.plane_row;
    const scalar_t* s[kTaps];
    for (int t = 0; t < kTaps; ++t) s[t] = window[t] + r * walk.window_row;
    int64_t e = 0;
    for (; e + kLanes <= walk.len; e += kLanes) {
      for (int t = 0; t < kTaps; ++t) {
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) lanes[t][l] += d[e + l] * s[t][(e + l) * step];
      }
    }
    for (int l = 0; e < walk.len; ++e, ++l) {
      for (int t = 0; t < kTaps; ++t) lanes[t][l] += d[e] * s[t][e * step];
    }
  }
  for (int t = 0; t < kTaps; ++t) {
    scalar_t sum = 0;
    for (int l = 0; l < kLanes; ++l) sum += lanes[t][l];
    result[t] = sum;
  }
}

// The kernels above for a run-time count of connections (1 to kPass) and walk.
#define SNACK_CONV_CASE(kernel, n, ...)                                                  \
  case 2 * n: kernel<scalar_t, n, false>(__VA_ARGS__); break;                             \
  case 2 * n + 1: kernel<scalar_t, n, true>(__VA_ARGS__); break;
#define SNACK_CONV_DISPATCH(kernel, count, unit, ...)                                   \
  do {                                                                                  \
    switch ((count) * 2 + ((unit) ? 1 : 0)) {                                           \
      SNACK_CONV_CASE(kernel, 1, __VA_ARGS__)                                           \
      SNACK_CONV_CASE(kernel, 2, __VA_ARGS__)                                           \
      SNACK_CONV_CASE(kernel, 3, __VA_ARGS__)                                           \
      SNACK_CONV_CASE(kernel, 4, __VA_ARGS__)                                           \
      SNACK_CONV_CASE(kernel, 5, __VA_ARGS__)                                           \
      SNACK_CONV_CASE(kernel, 6, __VA_ARGS__)                                           \
      SNACK_CONV_CASE(kernel, 7, __VA_ARGS__)                                           \
      SNACK_CONV_CASE(kernel, 8, __VA_ARGS__)                                           \
    }                                                                                   \
  } while (0)

void check_topology(const at::Tensor& values, const at::Tensor& col, const at::Tensor& rowptr, const char* what) {
  TORCH_CHECK(values.dim() == 1 && col.dim() == 1 && values.numel() == col.numel(), what,
              ": values and col must be (nnz,)");
  TORCH_CHECK(col.scalar_type() == at::kInt && rowptr.scalar_type() == at::kInt && rowptr.dim() == 1 &&
                  rowptr.numel() >= 1,
              what, ": col (nnz,) and rowptr (out + 1,) must be int32");
}

at::Tensor conv2d_forward(const at::Tensor& x, const at::Tensor& values, const at::Tensor& rowptr,
                          const at::Tensor& col, const c10::optional<at::Tensor>& bias, at::IntArrayRef kernel,
                          at::IntArrayRef stride, at::IntArrayRef dilation) {
  check_topology(values, col, rowptr, "conv2d_forward");
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && x.scalar_type() == values.scalar_type(),
              "conv2d_forward: x must be a contiguous (N, C, Hp, Wp) tensor of the values' dtype");
  const Geometry g = geometry(x.sizes().slice(1), kernel, stride, dilation);
  const int64_t N = x.size(0), O = rowptr.numel() - 1;
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == O && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "conv2d_forward: bias must be (out,) of x's dtype");
  auto y = at::empty({N, O, g.Ho, g.Wo}, x.options());
  if (y.numel() == 0) return y;
  const Taps taps = decode_taps(col, g);
  const int32_t* rp = rowptr.data_ptr<int32_t>();
  const bool flat = g.flat();
  const Walk walk = flat ? flat_walk(g) : row_walk(g);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_forward", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    const scalar_t* bd = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yd = y.data_ptr<scalar_t>();
    at::parallel_for(0, N * O, 1, [&](int64_t begin, int64_t end) {
      // the flat walk sums into a plane laid out Wp wide, then keeps each row's first Wo
      std::vector<scalar_t> wide(flat ? g.run() : 0);
      const scalar_t* window[kPass];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / O, o = task % O;
        const scalar_t start = bd != nullptr ? bd[o] : scalar_t(0);
        scalar_t* plane = yd + task * g.plane_out();
        scalar_t* sums = flat ? wide.data() : plane;
        std::fill_n(sums, flat ? g.run() : g.plane_out(), start);
        const scalar_t* sample = xd + n * g.C * g.plane_in();
        for (int64_t k = rp[o]; k < rp[o + 1]; k += kPass) {
          const int64_t count = std::min<int64_t>(kPass, rp[o + 1] - k);
          for (int64_t t = 0; t < count; ++t) window[t] = sample + taps.channel[k + t] * g.plane_in() + taps.offset[k + t];
          SNACK_CONV_DISPATCH(add_windows, count, flat || g.sw == 1, sums, window, vd + k, walk);
        }
        if (flat) {
          for (int64_t h = 0; h < g.Ho; ++h) std::copy_n(sums + h * g.Wp, g.Wo, plane + h * g.Wo);
        }
      }
    });
  });
  return y;
}

// dy (N, out, Ho, Wo) as the flat walk reads it: each row Wp wide, zeros past its Wo (a zero times
// a window element adds nothing to a dot, and zero to a dx element). One pass, in parallel: the
// zeros are written, not filled in first (constant_pad_nd filled everything, then copied).
template <typename scalar_t>
at::Tensor widened(const at::Tensor& dy, const Geometry& g) {
  auto wide = at::empty({dy.size(0), dy.size(1), g.Ho, g.Wp}, dy.options());
  const scalar_t* src = dy.data_ptr<scalar_t>();
  scalar_t* dst = wide.data_ptr<scalar_t>();
  at::parallel_for(0, dy.size(0) * dy.size(1) * g.Ho, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::copy_n(src + r * g.Wo, g.Wo, dst + r * g.Wp);
      std::fill_n(dst + r * g.Wp + g.Wo, g.Wp - g.Wo, scalar_t(0));
    }
  });
  return wide;
}

template <typename scalar_t>
scalar_t plane_sum(const scalar_t* __restrict plane, int64_t size) {
  scalar_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < size; ++e) sum += plane[e];
  return sum;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward(
    const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& values, const at::Tensor& row,
    const at::Tensor& col, const at::Tensor& rowptr, const at::Tensor& csc_perm, const at::Tensor& colptr,
    at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef dilation, at::IntArrayRef crop, bool input_grad,
    bool values_grad, bool bias_grad) {
  check_topology(values, col, rowptr, "conv2d_backward");
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && x.scalar_type() == values.scalar_type(),
              "conv2d_backward: x must be a contiguous (N, C, Hp, Wp) tensor of the values' dtype");
  const Geometry g = geometry(x.sizes().slice(1), kernel, stride, dilation);
  const int64_t N = x.size(0), O = rowptr.numel() - 1, nnz = col.numel(), taps_per_channel = g.kh * g.kw;
  TORCH_CHECK(dy_in.dim() == 4 && dy_in.scalar_type() == x.scalar_type() && dy_in.size(0) == N &&
                  dy_in.size(1) == O && dy_in.size(2) == g.Ho && dy_in.size(3) == g.Wo,
              "conv2d_backward: dy must be (N, out, Ho, Wo) of x's dtype");
  TORCH_CHECK(row.numel() == nnz && row.scalar_type() == at::kInt && csc_perm.numel() == nnz &&
                  csc_perm.scalar_type() == at::kInt && colptr.numel() == g.C * taps_per_channel + 1 &&
                  colptr.scalar_type() == at::kInt,
              "conv2d_backward: row, csc_perm (nnz,) and colptr (C·kh·kw + 1,) int32 expected");
  TORCH_CHECK(crop.size() == 4 && crop[0] >= 0 && crop[1] >= 0 && crop[2] >= 0 && crop[3] >= 0 &&
                  crop[0] + crop[1] < g.Wp && crop[2] + crop[3] < g.Hp,
              "conv2d_backward: crop must be (left, right, top, bottom), inside the padded input");
  // dx of the input before its zero padding (crop): each task sums a padded plane in a buffer of
  // its own and keeps the inside, where a padded dx cut by autograd took another pass over memory.
  // Planes are zeroed by their tasks, in cache (at::zeros was a pass of its own).
  const int64_t H = g.Hp - crop[2] - crop[3], W = g.Wp - crop[0] - crop[1];
  const bool cropped = H != g.Hp || W != g.Wp;
  auto dx = at::empty({input_grad ? N : 0, g.C, H, W}, x.options());
  auto dvalues = at::zeros({values_grad ? nnz : 0}, x.options());
  auto dbias = at::zeros({bias_grad ? O : 0}, x.options());
  if (N == 0 || g.plane_out() == 0) {
    dx.zero_();
    return {dx, dvalues, dbias};
  }
  const bool flat = g.flat();
  const Walk walk = flat ? flat_walk(g) : row_walk(g);
  const at::Tensor contiguous = dy_in.contiguous();
  const int64_t dy_plane = flat ? g.Ho * g.Wp : g.plane_out();
  const Taps taps = decode_taps(col, g);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_backward", [&] {
    const bool walks = nnz > 0 && (input_grad || values_grad);
    const at::Tensor dy = flat && g.Wp != g.Wo && walks ? widened<scalar_t>(contiguous, g) : contiguous;
    const int64_t plane_stride = dy.size(3) == g.Wp ? g.Ho * g.Wp : g.plane_out();
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* dyd = dy.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    const bool unit = flat || g.sw == 1;
    if (input_grad) {
      const int32_t* rd = row.data_ptr<int32_t>();
      const int32_t* perm = csc_perm.data_ptr<int32_t>();
      const int32_t* cp = colptr.data_ptr<int32_t>();
      scalar_t* dxd = dx.data_ptr<scalar_t>();
      at::parallel_for(0, N * g.C, 1, [&](int64_t begin, int64_t end) {
        scalar_t v[kPass];
        const scalar_t* plane[kPass];
        std::vector<scalar_t> padded(cropped ? g.plane_in() : 0);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t n = task / g.C, c = task % g.C;
          scalar_t* dx_plane = cropped ? padded.data() : dxd + task * g.plane_in();
          std::fill_n(dx_plane, g.plane_in(), scalar_t(0));
          const scalar_t* sample = dyd + n * O * plane_stride;
          for (int64_t column = c * taps_per_channel; column < (c + 1) * taps_per_channel; ++column) {
            for (int64_t p = cp[column]; p < cp[column + 1]; p += kPass) {
              const int64_t count = std::min<int64_t>(kPass, cp[column + 1] - p);
              for (int64_t t = 0; t < count; ++t) {
                const int64_t k = perm[p + t];
                v[t] = vd[k];
                plane[t] = sample + rd[k] * plane_stride;
              }
              SNACK_CONV_DISPATCH(scatter_planes, count, unit, dx_plane + taps.offset[perm[p]], plane, v, walk);
            }
          }
          if (cropped) {
            for (int64_t h = 0; h < H; ++h) {
              std::copy_n(dx_plane + (h + crop[2]) * g.Wp + crop[0], W, dxd + (task * H + h) * W);
            }
          }
        }
      });
    }
    if (values_grad || bias_grad) {
      const int32_t* rp = rowptr.data_ptr<int32_t>();
      scalar_t* dvd = dvalues.data_ptr<scalar_t>();
      scalar_t* dbd = dbias.data_ptr<scalar_t>();
      // samples outermost inside a task: one sample's input planes and output gradients stay in
      // cache while the task's connections are scored against them (and the bias gradient sums
      // each plane while it is there)
      const int64_t block = flat ? samples_per_block(g) : 1;
      at::parallel_for(0, O, 1, [&](int64_t first, int64_t last) {
        const scalar_t* window[kPass];
        scalar_t dots[kPass];
        for (int64_t n0 = 0; n0 < N; n0 += block) {
          const int64_t samples = std::min(block, N - n0);
          const Walk dots_walk = flat ? sample_walk(g, samples, O, plane_stride) : walk;
          const scalar_t* sample = xd + n0 * g.C * g.plane_in();
          for (int64_t o = first; o < last; ++o) {
            const scalar_t* plane = dyd + (n0 * O + o) * plane_stride;
            if (bias_grad) {  // a widened plane's extra columns are 0
              for (int64_t n = 0; n < samples; ++n) dbd[o] += plane_sum(plane + n * O * plane_stride, plane_stride);
            }
            if (!values_grad) continue;
            for (int64_t k = rp[o]; k < rp[o + 1]; k += kPass) {
              const int64_t count = std::min<int64_t>(kPass, rp[o + 1] - k);
              for (int64_t t = 0; t < count; ++t) {
                window[t] = sample + taps.channel[k + t] * g.plane_in() + taps.offset[k + t];
              }
              SNACK_CONV_DISPATCH(window_dots, count, unit, plane, window, dots_walk, dots);
              for (int64_t t = 0; t < count; ++t) dvd[k + t] += dots[t];
            }
          }
        }
      });
    }
  });
  return {dx, dvalues, dbias};
}

#undef SNACK_CONV_DISPATCH

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def(
      "conv2d_forward(Tensor x, Tensor values, Tensor rowptr, Tensor col, Tensor? bias, int[2] kernel, "
      "int[2] stride, int[2] dilation) -> Tensor");
  m.def(
      "conv2d_backward(Tensor dy, Tensor x, Tensor values, Tensor row, Tensor col, Tensor rowptr, "
      "Tensor csc_perm, Tensor colptr, int[2] kernel, int[2] stride, int[2] dilation, int[4] crop, "
      "bool input_grad, bool values_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("conv2d_forward", &conv2d_forward);
  m.impl("conv2d_backward", &conv2d_backward);
}
