// Native CPU kernels of snack.SparseConv2d: a direct sparse convolution, registered as
// torch.ops.snack_cpu.* next to kernels.cpp (one library). The weight is the layer's sparse
// (out, C·kh·kw) matrix: connection k joins output channel row[k] to input channel
// c = col[k] / (kh·kw) at kernel tap (i, j) = divmod(col[k] % (kh·kw), kw). Both kernels take
// the input unpadded, x (N, C, H, W), with the zero padding = (left, right, top, bottom) to add
// (other padding modes the layer applies first): xp is x padded to (N, C, Hp, Wp) = (N, C, H + top
// + bottom, W + left + right). The kernels lay xp out themselves (see "Source planes"), so no inner
// loop tests a bound:
//
//   conv2d_forward (x, values (nnz,), rowptr (out + 1,), col (nnz,), bias (out,)?, kernel, stride,
//                   dilation, padding)                                 -> y (N, out, Ho, Wo)
//       y[n, o] = bias[o] + Σ_{k in row o} values[k] · window_k(xp[n, c_k])
//   conv2d_backward (dy (N, out, Ho, Wo), x, values, row, col, rowptr, csc_perm, colptr, kernel,
//                    stride, dilation, padding, input_grad, values_grad, bias_grad)
//                                          -> (dx (N, C, H, W), dvalues (nnz,), dbias (out,))
//       dx: the adjoint, each connection adds values[k] · dy[n, row_k] into its window of dxp[n, c_k],
//       of which dx is the inside (the padding cut off);
//       dvalues[k] = Σ_n Σ_{h,w} dy[n, row_k, h, w] · window_k(xp[n, c_k])[h, w];
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
// Flat walk: a window's rows lie Wp apart in the padded input, as the rows of an output plane laid out
// Wp wide do. So output position q = h·Wp + w reads input offset + q, and a whole window is one
// contiguous run of L = (Ho - 1)·Wp + Wo elements, walked by one vector loop; the Wp - Wo columns
// past each output row are computed and dropped (forward), or read as zeros of a widened dy
// (backward). Walking row by row instead ran a short loop per row: at 8×8 images (Wo = 8, half an
// AVX-512 vector) the values gradient ran scalar.
//
// Source planes: each call lays the padded input out as its kernels walk it (source_planes), once;
// x itself when there is nothing to change. Strides: the padded input is split into its stride
// phases (sh·sw planes per channel, of ceil(Hp/sh) × ceil(Wp/sw), phase (a, b) holding the
// elements at rows a + sh·i and columns b + sw·j), and only those some tap reads are kept (a 1×1
// kernel at stride 2 reads one of four). Tap (i, j) then reads phase (i·dh mod sh, j·dw mod sw)
// at stride 1, shifted by (i·dh div sh, j·dw div sw): every convolution is the flat walk over
// source planes (the padded input itself at stride 1). The row-by-row walk this replaced strode through memory, one short row
// at a time: 3×3 layers at stride 2 ran 2.2-3.8x slower than MKL-DNN's dense convolution, a 1×1
// one 12-17x (ResNet-18's downsampling layers at 90% ERK, batch 32, AMD Zen 4).
//
// Folded samples: on small images a run is short (22 elements for a 4×4 output plane: two
// vectors, one mostly empty, per connection and pass). There the source planes and dy hold a
// group of `fold` samples side by side at each position (element (i·Ws + j)·fold + f is sample f
// of the group at (i, j)): a tap's offset and the run grow fold times, and the kernels are the
// same. See fold_samples for the sizes and the measured gains.
//
// Why the kernels pad: a caller that padded x and saved the copy for the backward (as this
// library did until 2026-12-02) kept a second copy of every convolution's input alive between
// forward and backward: a CIFAR ResNet-18 at 90% saved 228 MB of activations for its backward at
// batch 32, against 143 MB for the dense model (PyTorch's convolutions pad inside too). The
// backward lays out the padded input again, as it did already for strides and folded samples.
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
// an order fixed by the topology and the shapes alone, so results do not depend on the thread
// count. Forward: tasks over (sample group, output channel). Input gradient: tasks over (sample
// group, input channel), walking that channel's connections in column order (csc_perm), so no two
// tasks write one plane. Values gradient: tasks over runs of output channels, each summing over
// sample groups in order (in blocks of a few groups whose sums are reduced together, a block size
// fixed by the image size).

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

void fold_samples(Geometry& g, int64_t nnz, int64_t O) {
  int64_t wanted = 1;  // a power of two: no padding at the usual batch sizes
  const bool heavy = 3 * nnz >= g.C * g.plane_padded() + O * g.plane_out();
  while (heavy && wanted * 2 <= std::min<int64_t>(kMaxFold, 2048 / g.positions())) wanted *= 2;
  g.groups = (g.N + wanted - 1) / wanted;
  g.fold = g.groups > 0 ? (g.N + g.groups - 1) / g.groups : 1;
}

// The geometry of a convolution of N samples of `input` = (C, H, W), zero padded by `padding` =
// (left, right, top, bottom), into O output channels by nnz connections (which decide whether
// samples fold).
Geometry geometry(int64_t N, at::IntArrayRef input, at::IntArrayRef kernel, at::IntArrayRef stride,
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

// The source planes of x (N, C, H, W): x itself when g.in_place(), else (groups, C·phases, Hs,
// Ws·fold) with phase p = (a, b) of channel c at plane c·phases + p, and sample group·fold + f of
// position (i, j) at element (i·Ws + j)·fold + f: padded input position (a + i·sh, b + j·sw).
// The padding, positions past the padded input (Hp, Wp not multiples of the stride) and the last
// group's missing samples are zeros: only dropped outputs read the latter two, but a values
// gradient multiplies them by a widened dy's zeros, and garbage could be NaN.
template <typename scalar_t>
at::Tensor source_planes(const at::Tensor& x, const Geometry& g) {
  if (g.in_place()) return x;
  auto planes = at::empty({g.groups, g.C * g.phases, g.Hs, g.Ws * g.fold}, x.options());
  const scalar_t* src = x.data_ptr<scalar_t>();
  scalar_t* dst = planes.data_ptr<scalar_t>();
  at::parallel_for(0, g.groups * g.C, 1, [&](int64_t begin, int64_t end) {
    const scalar_t* sample[kMaxFold];
    const scalar_t* row[kMaxFold];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t group = task / g.C, c = task % g.C;
      const int64_t samples = std::min(g.fold, g.N - group * g.fold);
      for (int64_t f = 0; f < samples; ++f) sample[f] = src + ((group * g.fold + f) * g.C + c) * g.plane_in();
      for (int64_t p = 0; p < g.phases; ++p) {
        const auto [a, b] = g.phase[p];
        scalar_t* plane = dst + (task * g.phases + p) * g.plane_source();
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
  });
  return planes;
}

// Where connection k's kernel tap sits: the source plane it reads (of a sample's C·phases) and
// its offset into that plane. Decoded once per call: the inner loops then only add offsets.
struct Taps {
  std::vector<int64_t> plane;   // c_k · phases + phase of the tap
  std::vector<int64_t> offset;  // ((i·dh div sh)·Ws + j·dw div sw)·fold
};

int64_t tap_offset(const Geometry& g, int64_t tap) {
  return ((tap / g.kw) * g.dh / g.sh * g.Ws + (tap % g.kw) * g.dw / g.sw) * g.fold;
}

Taps decode_taps(const at::Tensor& col, const Geometry& g) {
  const int64_t nnz = col.numel(), taps = g.kh * g.kw;
  const int32_t* c = col.data_ptr<int32_t>();
  Taps t{std::vector<int64_t>(nnz), std::vector<int64_t>(nnz)};
  for (int64_t k = 0; k < nnz; ++k) {
    const int64_t tap = c[k] % taps;
    t.plane[k] = c[k] / taps * g.phases + g.phase_of_tap[tap];
    t.offset[k] = tap_offset(g, tap);
  }
  return t;
}

// How a window and a plane are walked: `rows` runs of `len` elements; run r of the plane starts
// at r · plane_row, of the window at r · window_row: the values gradient's walk, one run per sample
// group of a block (sample_walk). The forward and the input gradient walk one run of g.run().
struct Walk {
  int64_t rows, len, plane_row, window_row;
};

// The values gradient's flat walk over a block of sample groups: one run per group (the same
// output channel's dy plane, the same source plane's window), so that a block's dot products are
// reduced once. At 8×8 images (runs of 78 elements, before samples were folded) reducing per
// sample took most of the time: blocks of ceil(512 / run) groups, at most 8.
int64_t groups_per_block(const Geometry& g) { return std::clamp<int64_t>((512 + g.run() - 1) / g.run(), 1, 8); }
Walk sample_walk(const Geometry& g, int64_t groups, int64_t O) {
  return {groups, g.run(), O * g.Ho * g.Ws * g.fold, g.C * g.phases * g.plane_source()};
}

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

// The kernels above for a run-time count of connections (1 to kPass).
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

void check_topology(const at::Tensor& values, const at::Tensor& col, const at::Tensor& rowptr, const char* what) {
  TORCH_CHECK(values.dim() == 1 && col.dim() == 1 && values.numel() == col.numel(), what,
              ": values and col must be (nnz,)");
  TORCH_CHECK(col.scalar_type() == at::kInt && rowptr.scalar_type() == at::kInt && rowptr.dim() == 1 &&
                  rowptr.numel() >= 1,
              what, ": col (nnz,) and rowptr (out + 1,) must be int32");
}

at::Tensor conv2d_forward(const at::Tensor& x, const at::Tensor& values, const at::Tensor& rowptr,
                          const at::Tensor& col, const c10::optional<at::Tensor>& bias, at::IntArrayRef kernel,
                          at::IntArrayRef stride, at::IntArrayRef dilation, at::IntArrayRef padding) {
  check_topology(values, col, rowptr, "conv2d_forward");
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && x.scalar_type() == values.scalar_type(),
              "conv2d_forward: x must be a contiguous (N, C, H, W) tensor of the values' dtype");
  const int64_t N = x.size(0), O = rowptr.numel() - 1;
  const Geometry g = geometry(N, x.sizes().slice(1), kernel, stride, dilation, padding, col.numel(), O);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == O && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "conv2d_forward: bias must be (out,) of x's dtype");
  auto y = at::empty({N, O, g.Ho, g.Wo}, x.options());
  if (y.numel() == 0) return y;
  const Taps taps = decode_taps(col, g);
  const int32_t* rp = rowptr.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_forward", [&] {
    const at::Tensor source = source_planes<scalar_t>(x, g);
    const scalar_t* xd = source.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    const scalar_t* bd = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yd = y.data_ptr<scalar_t>();
    const int64_t group_size = g.C * g.phases * g.plane_source();
    at::parallel_for(0, g.groups * O, 1, [&](int64_t begin, int64_t end) {
      // the flat walk sums into a plane laid out Ws wide (fold samples a position), then keeps
      // each sample's first Wo of each row
      std::vector<scalar_t> wide(g.run());
      const scalar_t* window[kPass];
      scalar_t* plane[kMaxFold];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t group = task / O, o = task % O;
        std::fill(wide.begin(), wide.end(), bd != nullptr ? bd[o] : scalar_t(0));
        const scalar_t* sample = xd + group * group_size;
        for (int64_t k = rp[o]; k < rp[o + 1]; k += kPass) {
          const int64_t count = std::min<int64_t>(kPass, rp[o + 1] - k);
          for (int64_t t = 0; t < count; ++t) {
            window[t] = sample + taps.plane[k + t] * g.plane_source() + taps.offset[k + t];
          }
          SNACK_CONV_DISPATCH(multiply_add, count, wide.data(), window, vd + k, g.run());
        }
        const int64_t samples = std::min(g.fold, N - group * g.fold);
        for (int64_t f = 0; f < samples; ++f) plane[f] = yd + ((group * g.fold + f) * O + o) * g.plane_out();
        for (int64_t h = 0; h < g.Ho; ++h) {
          deinterleave(wide.data() + h * g.Ws * g.fold, g.fold, samples, g.Wo, plane);
          for (int64_t f = 0; f < samples; ++f) plane[f] += g.Wo;
        }
      }
    });
  });
  return y;
}

// dy (N, out, Ho, Wo) as the flat walk reads it: (groups, out, Ho, Ws·fold), each row Ws
// positions wide, fold samples a position, zeros past a row's Wo and for the last group's missing
// samples (a zero times a window element adds nothing to a dot, and zero to a dx element). One
// pass, in parallel, row by row.
template <typename scalar_t>
at::Tensor widened(const at::Tensor& dy, const Geometry& g) {
  const int64_t O = dy.size(1), row = g.Ws * g.fold;
  auto wide = at::empty({g.groups, O, g.Ho, row}, dy.options());
  const scalar_t* src = dy.data_ptr<scalar_t>();
  scalar_t* dst = wide.data_ptr<scalar_t>();
  at::parallel_for(0, g.groups * O * g.Ho, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t group = r / (O * g.Ho), o = r / g.Ho % O, h = r % g.Ho;
      const int64_t samples = std::min(g.fold, g.N - group * g.fold);
      const scalar_t* in[kMaxFold];
      for (int64_t f = 0; f < samples; ++f) in[f] = src + (((group * g.fold + f) * O + o) * g.Ho + h) * g.Wo;
      scalar_t* out = dst + r * row;
      if (samples < g.fold) std::fill_n(out, g.Wo * g.fold, scalar_t(0));
      interleave(in, samples, g.Wo, 1, out, g.fold);
      std::fill(out + g.Wo * g.fold, out + row, scalar_t(0));
    }
  });
  return wide;
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

PhaseMerge phase_merge(const Geometry& g) {
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward(
    const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& values, const at::Tensor& row,
    const at::Tensor& col, const at::Tensor& rowptr, const at::Tensor& csc_perm, const at::Tensor& colptr,
    at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef dilation, at::IntArrayRef padding,
    bool input_grad, bool values_grad, bool bias_grad) {
  check_topology(values, col, rowptr, "conv2d_backward");
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && x.scalar_type() == values.scalar_type(),
              "conv2d_backward: x must be a contiguous (N, C, H, W) tensor of the values' dtype");
  const int64_t N = x.size(0), O = rowptr.numel() - 1, nnz = col.numel();
  const Geometry g = geometry(N, x.sizes().slice(1), kernel, stride, dilation, padding, nnz, O);
  const int64_t taps_per_channel = g.kh * g.kw;
  TORCH_CHECK(dy_in.dim() == 4 && dy_in.scalar_type() == x.scalar_type() && dy_in.size(0) == N &&
                  dy_in.size(1) == O && dy_in.size(2) == g.Ho && dy_in.size(3) == g.Wo,
              "conv2d_backward: dy must be (N, out, Ho, Wo) of x's dtype");
  TORCH_CHECK(row.numel() == nnz && row.scalar_type() == at::kInt && csc_perm.numel() == nnz &&
                  csc_perm.scalar_type() == at::kInt && colptr.numel() == g.C * taps_per_channel + 1 &&
                  colptr.scalar_type() == at::kInt,
              "conv2d_backward: row, csc_perm (nnz,) and colptr (C·kh·kw + 1,) int32 expected");
  // dx without the padding: each task sums its channel's source planes in a buffer of its own and
  // keeps the inside (merging the stride phases back), where a padded dx cut by autograd took
  // another pass over memory. Buffers are zeroed by their tasks, in cache (at::zeros was a pass of
  // its own); at stride 1, unfolded, without padding the task sums in dx.
  auto dx = at::empty({input_grad ? N : 0, g.C, g.H, g.W}, x.options());
  auto dvalues = at::zeros({values_grad ? nnz : 0}, x.options());
  auto dbias = at::zeros({bias_grad ? O : 0}, x.options());
  if (N == 0 || g.plane_out() == 0) {
    dx.zero_();
    return {dx, dvalues, dbias};
  }
  const at::Tensor contiguous = dy_in.contiguous();
  const Taps taps = decode_taps(col, g);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_backward", [&] {
    // the bias gradient sums dy's planes in either layout (the widened one's extra elements are 0)
    const bool walks = nnz > 0 && (input_grad || values_grad);
    const bool widen = walks && (g.Ws != g.Wo || g.fold != 1);
    const at::Tensor dy = widen ? widened<scalar_t>(contiguous, g) : contiguous;
    const int64_t plane_stride = g.Ho * dy.size(3), groups = widen ? g.groups : N;
    const scalar_t* dyd = dy.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    const int64_t channel_size = g.phases * g.plane_source();
    if (input_grad) {
      const int32_t* rd = row.data_ptr<int32_t>();
      const int32_t* perm = csc_perm.data_ptr<int32_t>();
      const int32_t* cp = colptr.data_ptr<int32_t>();
      scalar_t* dxd = dx.data_ptr<scalar_t>();
      const PhaseMerge merge = phase_merge(g);
      at::parallel_for(0, g.groups * g.C, 1, [&](int64_t begin, int64_t end) {
        scalar_t v[kPass];
        const scalar_t* plane[kPass];
        std::vector<scalar_t> buffer(g.in_place() ? 0 : channel_size);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t group = task / g.C, c = task % g.C;
          scalar_t* sums = g.in_place() ? dxd + task * g.plane_in() : buffer.data();
          std::fill_n(sums, channel_size, scalar_t(0));
          const scalar_t* sample = dyd + group * O * plane_stride;
          for (int64_t tap = 0; tap < taps_per_channel; ++tap) {
            const int64_t column = c * taps_per_channel + tap;
            scalar_t* window = sums + g.phase_of_tap[tap] * g.plane_source() + tap_offset(g, tap);
            for (int64_t p = cp[column]; p < cp[column + 1]; p += kPass) {
              const int64_t count = std::min<int64_t>(kPass, cp[column + 1] - p);
              for (int64_t t = 0; t < count; ++t) {
                const int64_t k = perm[p + t];
                v[t] = vd[k];
                plane[t] = sample + rd[k] * plane_stride;
              }
              SNACK_CONV_DISPATCH(multiply_add, count, window, plane, v, g.run());
            }
          }
          if (!g.in_place()) {
            const int64_t samples = std::min(g.fold, N - group * g.fold);
            merge.apply(sums, samples, dxd + (group * g.fold * g.C + c) * g.plane_in(), g.C * g.plane_in(), g);
          }
        }
      });
    }
    if (values_grad || bias_grad) {
      const at::Tensor source = values_grad ? source_planes<scalar_t>(x, g) : x;
      const scalar_t* xd = source.data_ptr<scalar_t>();
      const int32_t* rp = rowptr.data_ptr<int32_t>();
      scalar_t* dvd = dvalues.data_ptr<scalar_t>();
      scalar_t* dbd = dbias.data_ptr<scalar_t>();
      // sample groups outermost inside a task: a block of groups' input planes and output
      // gradients stay in cache while the task's connections are scored against them (and the
      // bias gradient sums each plane while it is there)
      const int64_t block = groups_per_block(g);
      at::parallel_for(0, O, 1, [&](int64_t first, int64_t last) {
        const scalar_t* window[kPass];
        scalar_t dots[kPass];
        for (int64_t g0 = 0; g0 < groups; g0 += block) {
          const int64_t in_block = std::min(block, groups - g0);
          const Walk walk = sample_walk(g, in_block, O);
          const scalar_t* sample = xd + g0 * g.C * channel_size;
          for (int64_t o = first; o < last; ++o) {
            const scalar_t* plane = dyd + (g0 * O + o) * plane_stride;
            if (bias_grad) {
              for (int64_t r = 0; r < in_block; ++r) dbd[o] += plane_sum(plane + r * O * plane_stride, plane_stride);
            }
            if (!values_grad) continue;
            for (int64_t k = rp[o]; k < rp[o + 1]; k += kPass) {
              const int64_t count = std::min<int64_t>(kPass, rp[o + 1] - k);
              for (int64_t t = 0; t < count; ++t) {
                window[t] = sample + taps.plane[k + t] * g.plane_source() + taps.offset[k + t];
              }
              SNACK_CONV_DISPATCH(window_dots, count, plane, window, walk, dots);
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
      "int[2] stride, int[2] dilation, int[4] padding) -> Tensor");
  m.def(
      "conv2d_backward(Tensor dy, Tensor x, Tensor values, Tensor row, Tensor col, Tensor rowptr, "
      "Tensor csc_perm, Tensor colptr, int[2] kernel, int[2] stride, int[2] dilation, int[4] padding, "
      "bool input_grad, bool values_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("conv2d_forward", &conv2d_forward);
  m.impl("conv2d_backward", &conv2d_backward);
}
