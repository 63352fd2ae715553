// The flat walk of snack's direct sparse convolutions on the CPU, shared by conv_kernels.cpp (any
// convolution) and depthwise_kernels.cpp: the geometry, how an input is laid out for the walk, and
// the inner loops. x (N, C, H, W) is zero padded by (left, right, top, bottom) to xp (N, C, Hp, Wp)
// = (N, C, H + top + bottom, W + left + right), and kernel tap (i, j) (of kh × kw, stride (sh, sw),
// dilation (dh, dw)) reads the (Ho, Wo) window(plane)[h, w] = plane[h·sh + i·dh, w·sw + j·dw] of a
// padded plane.
//
// Flat walk: a window's rows lie Wp apart in the padded input, as the rows of an output plane laid out
// Wp wide do. So output position q = h·Wp + w reads input offset + q, and a whole window is one
// contiguous run of L = (Ho - 1)·Wp + Wo elements, walked by one vector loop; the Wp - Wo columns
// past each output row are computed and dropped (forward), or read as zeros of a widened dy
// (backward). Walking row by row instead ran a short loop per row: at 8×8 images (Wo = 8, half an
// AVX-512 vector) the values gradient ran scalar.
//
// Source planes: the padded input laid out as the kernels walk it (lay_out_channel), channel by
// channel; x itself when there is nothing to change. Strides: the padded input is split into its
// stride phases (sh·sw planes per channel, of ceil(Hp/sh) × ceil(Wp/sw), phase (a, b) holding the
// elements at rows a + sh·i and columns b + sw·j), and only those some tap reads are kept (a 1×1
// kernel at stride 2 reads one of four). Tap (i, j) then reads phase (i·dh mod sh, j·dw mod sw)
// at stride 1, shifted by (i·dh div sh, j·dw div sw): every convolution is the flat walk over
// source planes (the padded input itself at stride 1). The row-by-row walk this replaced strode
// through memory, one short row at a time: 3×3 layers at stride 2 ran 2.2-3.8x slower than
// MKL-DNN's dense convolution, a 1×1 one 12-17x (ResNet-18's downsampling layers at 90% ERK, batch
// 32, AMD Zen 4).
//
// Folded samples: on small images a run is short (22 elements for a 4×4 output plane: two
// vectors, one mostly empty, per connection and pass). There the source planes and dy hold a
// group of `fold` samples side by side at each position (element (i·Ws + j)·fold + f is sample f
// of the group at (i, j)): a tap's offset and the run grow fold times, and the kernels are the
// same. See fold_samples for the sizes and the measured gains.
//
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace snack_conv {

struct Geometry {
  int64_t kh, kw, sh, sw, dh, dw;  // kernel, stride, dilation
  int64_t N, C, H, W;              // samples, input channels and size
  int64_t left, right, top, bottom;  // the zero padding
  int64_t Hp, Wp, Ho, Wo;          // the padded input's size, the output's
  // The source planes the kernels walk: per channel `phases` stride phases of Hs × Ws (see above),
  // each position holding `fold` samples side by side; the samples in `groups` of `fold`.
  int64_t phases, Hs, Ws, fold, groups;
  std::vector<int64_t> phase_of_tap;                // tap i·kw + j → its phase's index among those kept
  std::vector<std::pair<int64_t, int64_t>> phase;  // kept phase → (row a, column b)
  std::vector<int64_t> phase_at;                    // phase a·sw + b → its index among those kept, or -1

  int64_t plane_in() const { return H * W; }
  int64_t plane_padded() const { return Hp * Wp; }
  int64_t plane_out() const { return Ho * Wo; }
  int64_t plane_source() const { return Hs * Ws * fold; }
  bool strided() const { return sh != 1 || sw != 1; }
  bool padded() const { return Hp != H || Wp != W; }
  // the input itself is its source planes: no padding, one phase, one sample per position
  bool in_place() const { return !strided() && !padded() && fold == 1; }
  // the flat walk's run, in positions: output rows laid out Ws wide, the last one Wo long
  int64_t positions() const { return (Ho - 1) * Ws + Wo; }
  int64_t run() const { return positions() * fold; }
};

// Samples per position: a power of two up to 2048 / positions and 16, where a 4×4 output plane's
// run is 22 positions (two vectors, one mostly empty, and a pass's overhead per connection).
// Kernel A/B against the unfolded kernels (AMD Zen 4, 2 threads, batch 32, 3×3, forward / input
// gradient / values gradient): 4×4 planes of 512 channels (16 a group) 2.2 / 2.7 / 1.9x faster;
// 8×8 of 256 (16) 1.5 / 1.7 / 1.9x; 16×16 of 128 (4) 1.1 / 1.1 / 1.3x; 3×3 at stride 2 onto 8×8
// and 4×4 planes 1.3-1.5 / 1.1-2.0 / 1.8-2.6x. 32×32 planes (runs of 1088) are left unfolded:
// there the input gradient got slower with folding. Groups are balanced: 20 samples at 16 a group
// are 2 groups of 10, and a group short of samples reads zeros.
// Folding copies the input and the output (dy and dx) once more, which a sparse enough layer does
// not win back: at 99% the forward of 16×16 and 8×8 planes took twice as long folded (0.7 → 1.4
// ms), and at 95% 16×16 ones 1.25x. So a layer folds only when it has at least a third as many
// connections as an input and an output sample have elements (nnz ≥ (C·Hp·Wp + out·Ho·Wo) / 3):
// in those measurements every layer that gained, and none that lost.
constexpr int64_t kMaxFold = 16;

inline void fold_samples(Geometry& g, int64_t nnz, int64_t O) {
  int64_t wanted = 1;  // a power of two: no padding at the usual batch sizes
  const bool heavy = 3 * nnz >= g.C * g.plane_padded() + O * g.plane_out();
  while (heavy && wanted * 2 <= std::min<int64_t>(kMaxFold, 2048 / g.positions())) wanted *= 2;
  g.groups = (g.N + wanted - 1) / wanted;
  g.fold = g.groups > 0 ? (g.N + g.groups - 1) / g.groups : 1;
}

// The geometry of a convolution of N samples of `input` = (C, H, W), zero padded by `padding` =
// (left, right, top, bottom), into O output channels by nnz connections (which decide whether
// samples fold).
inline Geometry geometry(int64_t N, at::IntArrayRef input, at::IntArrayRef kernel, at::IntArrayRef stride,
                  at::IntArrayRef dilation, at::IntArrayRef padding, int64_t nnz, int64_t O) {
  TORCH_CHECK(input.size() == 3 && kernel.size() == 2 && stride.size() == 2 && dilation.size() == 2 &&
                  padding.size() == 4,
              "snack_cpu conv2d: input (C, H, W), kernel, stride and dilation pairs and padding (left, right, "
              "top, bottom) expected");
  Geometry g{kernel[0],  kernel[1],  stride[0],  stride[1],  dilation[0], dilation[1], N, input[0], input[1],
             input[2],   padding[0], padding[1], padding[2], padding[3]};
  TORCH_CHECK(g.kh > 0 && g.kw > 0 && g.sh > 0 && g.sw > 0 && g.dh > 0 && g.dw > 0,
              "snack_cpu conv2d: kernel, stride and dilation must be positive");
  TORCH_CHECK(g.left >= 0 && g.right >= 0 && g.top >= 0 && g.bottom >= 0,
              "snack_cpu conv2d: padding must not be negative");
  g.Hp = g.H + g.top + g.bottom;
  g.Wp = g.W + g.left + g.right;
  TORCH_CHECK(g.Hp >= g.dh * (g.kh - 1) + 1 && g.Wp >= g.dw * (g.kw - 1) + 1,
              "snack_cpu conv2d: the padded input is smaller than the dilated kernel");
  g.Ho = (g.Hp - g.dh * (g.kh - 1) - 1) / g.sh + 1;
  g.Wo = (g.Wp - g.dw * (g.kw - 1) - 1) / g.sw + 1;
  g.Hs = (g.Hp + g.sh - 1) / g.sh;
  g.Ws = (g.Wp + g.sw - 1) / g.sw;
  g.phase_at.assign(g.sh * g.sw, -1);
  for (int64_t i = 0; i < g.kh; ++i) {
    for (int64_t j = 0; j < g.kw; ++j) {
      const int64_t a = i * g.dh % g.sh, b = j * g.dw % g.sw;
      int64_t& index = g.phase_at[a * g.sw + b];
      if (index < 0) {
        index = static_cast<int64_t>(g.phase.size());
        g.phase.emplace_back(a, b);
      }
      g.phase_of_tap.push_back(index);
    }
  }
  g.phases = static_cast<int64_t>(g.phase.size());
  fold_samples(g, nnz, O);
  return g;
}

// Folding's layout changes, `samples` (≤ fold ≤ kMaxFold) rows of `count` elements: out[j·fold + f] =
// in[f][j·in_step] (interleave) and its inverse out[f][j] = in[j·fold + f] (deinterleave), through
// a small tile so that both the reads and the writes run along memory. Element by element (the
// group's samples innermost), the forward's copies took 1.6 ms, through the tile 0.6 ms, of a
// 6-7 ms convolution (32 samples of 256 channels of 8×8, 2 threads); ATen's permuting copies
// (permute + contiguous, constant_pad_nd) 1.9 ms. Unfolded (one sample) a strided row is one
// strided loop: through the tile, a stride-2 layer's stride phases cost most of its forward at
// batch 32 (kernel A/B, AMD Zen 4, 2 threads: forward 1.34-2.4x faster, values gradient 1.16-3.0x,
// on ResNet-18's stride-2 3×3 and 1×1 layers and 2×2 / 4×4 stride-2 transposed ones).
constexpr int64_t kTile = 64;

template <typename scalar_t>
void interleave(const scalar_t* const* in, int64_t samples, int64_t count, int64_t in_step, scalar_t* out,
                int64_t fold) {
  if (fold == 1) {
    const scalar_t* from = in[0];
    if (in_step == 1) {
      std::copy_n(from, count, out);
    } else if (in_step == 2 && count >= 16) {
      // a constant stride the compiler vectorises (with permutes): kernel A/B on 32×32 planes at stride
      // 2 (3×3 and 1×1 layers, ungrouped and depthwise; two runs): forwards 0.97-1.9x as fast,
      // backwards 1.1-1.4x; rows shorter than a vector gained nothing
      for (int64_t j = 0; j < count; ++j) out[j] = from[2 * j];
    } else {
      for (int64_t j = 0; j < count; ++j) out[j] = from[j * in_step];
    }
    return;
  }
  scalar_t tile[kMaxFold][kTile];
  for (int64_t j0 = 0; j0 < count; j0 += kTile) {
    const int64_t n = std::min(kTile, count - j0);
    for (int64_t f = 0; f < samples; ++f) {
      const scalar_t* from = in[f] + j0 * in_step;
      for (int64_t j = 0; j < n; ++j) tile[f][j] = from[j * in_step];
    }
    scalar_t* to = out + j0 * fold;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t f = 0; f < samples; ++f) to[j * fold + f] = tile[f][j];
    }
  }
}

template <typename scalar_t>
void deinterleave(const scalar_t* in, int64_t fold, int64_t samples, int64_t count, scalar_t* const* out) {
  if (fold == 1) {
    std::copy_n(in, count, out[0]);
    return;
  }
  scalar_t tile[kMaxFold][kTile];
  for (int64_t j0 = 0; j0 < count; j0 += kTile) {
    const int64_t n = std::min(kTile, count - j0);
    const scalar_t* from = in + j0 * fold;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t f = 0; f < samples; ++f) tile[f][j] = from[j * fold + f];
    }
    for (int64_t f = 0; f < samples; ++f) std::copy_n(tile[f], n, out[f] + j0);
  }
}

// One channel's source planes (phases · Hs · Ws·fold elements at `dst`) of the group's first
// `samples` samples, whose planes of that channel are `sample` (H × W each): phase p = (a, b) at
// dst + p·Hs·Ws·fold, sample f of position (i, j) at element (i·Ws + j)·fold + f, which is padded
// input position (a + i·sh, b + j·sw). The padding, positions past the padded input (Hp, Wp not
// multiples of the stride) and missing samples (samples < fold) are zeros: only dropped outputs
// read the latter two, but a values gradient multiplies them by a widened dy's zeros, and garbage
// could be NaN.
template <typename scalar_t>
void lay_out_channel(const scalar_t* const* sample, int64_t samples, const Geometry& g, scalar_t* dst) {
  const scalar_t* row[kMaxFold];
  for (int64_t p = 0; p < g.phases; ++p) {
    const auto [a, b] = g.phase[p];
    scalar_t* plane = dst + p * g.plane_source();
    if (!g.strided() && !g.padded()) {  // the plane is one run of the input's positions
      if (samples < g.fold) std::fill_n(plane, g.plane_source(), scalar_t(0));
      interleave(sample, samples, g.plane_in(), 1, plane, g.fold);
      continue;
    }
    std::fill_n(plane, g.plane_source(), scalar_t(0));
    // the phase's columns inside the input: j from `first` on, input column w0 + (j - first)·sw
    const int64_t first = (std::max<int64_t>(g.left - b, 0) + g.sw - 1) / g.sw;
    const int64_t w0 = b + first * g.sw - g.left;
    if (w0 >= g.W) continue;
    const int64_t columns = (g.W - w0 + g.sw - 1) / g.sw;
    for (int64_t i = 0; i < g.Hs; ++i) {
      const int64_t h = a + i * g.sh - g.top;  // the input row of the phase's row i
      if (h < 0 || h >= g.H) continue;
      for (int64_t f = 0; f < samples; ++f) row[f] = sample[f] + h * g.W + w0;
      interleave(row, samples, columns, g.sw, plane + (i * g.Ws + first) * g.fold, g.fold);
    }
  }
}

// Where tap i·kw + j's window starts in its phase's source plane.
inline int64_t tap_offset(const Geometry& g, int64_t tap) {
  return ((tap / g.kw) * g.dh / g.sh * g.Ws + (tap % g.kw) * g.dw / g.sw) * g.fold;
}

// How a window and a plane are walked: `rows` runs of `len` elements; run r of the plane starts
// at r · plane_row, of the window at r · window_row: the values gradient's walk, one run per sample
// group of a block (sample_walk, conv_kernels.cpp). The forward and the input gradient walk one run
// of g.run().
struct Walk {
  int64_t rows, len, plane_row, window_row;
};

// Up to kPass connections are handled per pass (kTaps): one load and store of each output element
// per kPass multiply-adds. Eight rather than four: forward and input gradient 1.05-1.25x faster
// (kernel A/B, AMD Zen 4; the values gradient, which stores nothing per element, the same within
// noise).
constexpr int kPass = 8;

// out[e] += Σ_t v[t] · in_t[e] for e < len: the forward (out an output plane laid out Ws wide,
// in_t windows of source planes) and the input gradient (out a window of a source plane's
// gradient, in_t the widened dy planes of connections of one tap, which write the same window).
template <typename scalar_t, int kTaps>
void multiply_add(scalar_t* __restrict out, const scalar_t* const* in, const scalar_t* v, int64_t len) {
  scalar_t w[kTaps];
  const scalar_t* s[kTaps];
  for (int t = 0; t < kTaps; ++t) {
    w[t] = v[t];
    s[t] = in[t];
  }
#pragma omp simd
  for (int64_t e = 0; e < len; ++e) {
    scalar_t sum = out[e];
#pragma GCC unroll 8
    for (int t = 0; t < kTaps; ++t) sum += w[t] * s[t][e];
    out[e] = sum;
  }
}

// result[t] = Σ_e plane[e] · window_t[e]: the values gradient, for connections of one output
// channel (one plane; the walk's runs may be several samples' planes, see sample_walk).
// Per-lane partial sums, reduced once at the end: a reduction per row cost more than the row.
template <typename scalar_t, int kTaps>
void window_dots(const scalar_t* __restrict plane, const scalar_t* const* window, const Walk& walk, scalar_t* result) {
  constexpr int kLanes = 16;
  scalar_t lanes[kTaps][kLanes] = {};
  for (int64_t r = 0; r < walk.rows; ++r) {
    const scalar_t* d = plane + r * walk.plane_row;
    const scalar_t* s[kTaps];
    for (int t = 0; t < kTaps; ++t) s[t] = window[t] + r * walk.window_row;
    int64_t e = 0;
    for (; e + kLanes <= walk.len; e += kLanes) {
      for (int t = 0; t < kTaps; ++t) {
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) lanes[t][l] += d[e + l] * s[t][e + l];
      }
    }
    for (int l = 0; e < walk.len; ++e, ++l) {
      for (int t = 0; t < kTaps; ++t) lanes[t][l] += d[e] * s[t][e];
    }
  }
  for (int t = 0; t < kTaps; ++t) {
    scalar_t sum = 0;
    for (int l = 0; l < kLanes; ++l) sum += lanes[t][l];
    result[t] = sum;
  }
}

inline void check_topology(const at::Tensor& values, const at::Tensor& col, const at::Tensor& rowptr,
                           const char* what) {
  TORCH_CHECK(values.dim() == 1 && col.dim() == 1 && values.numel() == col.numel(), what,
              ": values and col must be (nnz,)");
  TORCH_CHECK(col.scalar_type() == at::kInt && rowptr.scalar_type() == at::kInt && rowptr.dim() == 1 &&
                  rowptr.numel() >= 1,
              what, ": col (nnz,) and rowptr (out + 1,) must be int32");
}

// Where each element of an input plane's gradient (H, W, without the padding) lies in its channel's
// source planes: row h at (a, i) = divmod(h + top, sh), column w at (b, j) = divmod(w + left, sw),
// so element (h, w) of the group's sample f is source plane phase(a, b), element
// (i·Ws + j)·fold + f. A phase no tap reads has no connection into it: its elements' gradients are
// zero. Tabled once per call.
struct PhaseMerge {
  std::vector<int64_t> row_phase, row_offset, col_phase, col_offset;  // a·sw, i·Ws·fold; b, j·fold

  // dx (H, W) of the group's first `samples` samples, channel c, from the channel's source planes'
  // gradients `sums` (phases · plane_source); dx is the first sample's plane, the next ones lie
  // `sample_stride` apart
  template <typename scalar_t>
  void apply(const scalar_t* sums, int64_t samples, scalar_t* dx, int64_t sample_stride, const Geometry& g) const {
    const int64_t H = static_cast<int64_t>(row_phase.size()), W = static_cast<int64_t>(col_phase.size());
    for (int64_t h = 0; h < H; ++h, dx += W) {
      if (!g.strided()) {  // each row is a run of positions
        scalar_t* rows[kMaxFold];
        for (int64_t f = 0; f < samples; ++f) rows[f] = dx + f * sample_stride;
        deinterleave(sums + row_offset[h] + col_offset[0], g.fold, samples, W, rows);
        continue;
      }
      if (g.fold == 1) {
        // one sample: phase b's run of the row lands on every sw-th element from its first column
        // (element by element through the phase table, a stride-2 input gradient took 1.2-1.8x
        // as long at batch 32: kernel A/B as for interleave)
        for (int64_t b = 0; b < g.sw; ++b) {
          const int64_t w0 = ((b - g.left) % g.sw + g.sw) % g.sw;
          if (w0 >= W) continue;
          const int64_t p = g.phase_at[row_phase[h] + b];
          const scalar_t* from = p < 0 ? nullptr : sums + p * g.plane_source() + row_offset[h] + col_offset[w0];
          for (int64_t w = w0, j = 0; w < W; w += g.sw, ++j) dx[w] = from != nullptr ? from[j] : scalar_t(0);
        }
        continue;
      }
      for (int64_t w = 0; w < W; ++w) {
        const int64_t p = g.phase_at[row_phase[h] + col_phase[w]];
        if (p < 0) {
          for (int64_t f = 0; f < samples; ++f) dx[f * sample_stride + w] = scalar_t(0);
          continue;
        }
        const scalar_t* from = sums + p * g.plane_source() + row_offset[h] + col_offset[w];
        for (int64_t f = 0; f < samples; ++f) dx[f * sample_stride + w] = from[f];
      }
    }
  }
};

inline PhaseMerge phase_merge(const Geometry& g) {
  PhaseMerge m;
  for (int64_t h = 0; h < g.H; ++h) {
    m.row_phase.push_back((h + g.top) % g.sh * g.sw);
    m.row_offset.push_back((h + g.top) / g.sh * g.Ws * g.fold);
  }
  for (int64_t w = 0; w < g.W; ++w) {
    m.col_phase.push_back((w + g.left) % g.sw);
    m.col_offset.push_back((w + g.left) / g.sw * g.fold);
  }
  return m;
}

template <typename scalar_t>
scalar_t plane_sum(const scalar_t* __restrict plane, int64_t size) {
  scalar_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < size; ++e) sum += plane[e];
  return sum;
}

}  // namespace snack_conv

// The kernels above for a run-time count of connections (1 to kPass), in a dispatch on scalar_t.
#define SNACK_CONV_CASE(kernel, n, ...) \
  case n: kernel<scalar_t, n>(__VA_ARGS__); break;
#define SNACK_CONV_DISPATCH(kernel, count, ...) \
  do {                                          \
    switch (count) {                            \
      SNACK_CONV_CASE(kernel, 1, __VA_ARGS__)   \
      SNACK_CONV_CASE(kernel, 2, __VA_ARGS__)   \
      SNACK_CONV_CASE(kernel, 3, __VA_ARGS__)   \
      SNACK_CONV_CASE(kernel, 4, __VA_ARGS__)   \
      SNACK_CONV_CASE(kernel, 5, __VA_ARGS__)   \
      SNACK_CONV_CASE(kernel, 6, __VA_ARGS__)   \
      SNACK_CONV_CASE(kernel, 7, __VA_ARGS__)   \
      SNACK_CONV_CASE(kernel, 8, __VA_ARGS__)   \
    }                                           \
  } while (0)

