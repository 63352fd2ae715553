// Native CPU kernels of snack.SparseConv2d: a direct sparse convolution, registered as
// torch.ops.snack_cpu.* next to kernels.cpp (one library). The weight is the layer's sparse
// (out, C·kh·kw) matrix: connection k joins output channel row[k] to input channel
// c = col[k] / (kh·kw) at kernel tap (i, j) = divmod(col[k] % (kh·kw), kw). Both kernels take
// the input unpadded, x (N, C, H, W), with the zero padding = (left, right, top, bottom) to add
// (other padding modes the layer applies first): xp is x padded to (N, C, Hp, Wp) = (N, C, H + top
// + bottom, W + left + right). The kernels lay xp out themselves (source planes, conv_walk.h), so no
// inner loop tests a bound:
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
// How: the flat walk over source planes, samples folded on small images (conv_walk.h, shared with
// depthwise_kernels.cpp).
//
// Why the kernels pad: a caller that padded x and saved the copy for the backward (as this
// library did until 2026-12-02) kept a second copy of every convolution's input alive between
// forward and backward: a CIFAR ResNet-18 at 90% saved 228 MB of activations for its backward at
// batch 32, against 143 MB for the dense model (PyTorch's convolutions pad inside too). The
// backward lays out the padded input again, as it did already for strides and folded samples.
//
// Measured and dropped: register blocking of the forward (a block of 64 consecutive flat outputs
// of a sample summed in four vector registers over a row's connections, channel after channel,
// compacted into the output per block): the same bits, but 0.81-1.18x the time of the passes of
// multiply_add (AMD Zen 4, 2 threads). Both are bound by loading one window vector per multiply-add,
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

#include "conv_walk.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <tuple>

namespace {

using namespace snack_conv;

// The source planes of x (N, C, H, W), in one pass before the kernels walk them: x itself when
// g.in_place(), else (groups, C·phases, Hs, Ws·fold), channel c of a sample group at planes
// c·phases to (c + 1)·phases (lay_out_channel).
template <typename scalar_t>
at::Tensor source_planes(const at::Tensor& x, const Geometry& g) {
  if (g.in_place()) return x;
  auto planes = at::empty({g.groups, g.C * g.phases, g.Hs, g.Ws * g.fold}, x.options());
  const scalar_t* src = x.data_ptr<scalar_t>();
  scalar_t* dst = planes.data_ptr<scalar_t>();
  at::parallel_for(0, g.groups * g.C, 1, [&](int64_t begin, int64_t end) {
    const scalar_t* sample[kMaxFold];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t group = task / g.C, c = task % g.C;
      const int64_t samples = std::min(g.fold, g.N - group * g.fold);
      for (int64_t f = 0; f < samples; ++f) sample[f] = src + ((group * g.fold + f) * g.C + c) * g.plane_in();
      lay_out_channel(sample, samples, g, dst + task * g.phases * g.plane_source());
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

// The values gradient's flat walk over a block of sample groups: one run per group (the same
// output channel's dy plane, the same source plane's window), so that a block's dot products are
// reduced once. At 8×8 images (runs of 78 elements, before samples were folded) reducing per
// sample took most of the time: blocks of ceil(512 / run) groups, at most 8.
int64_t groups_per_block(const Geometry& g) { return std::clamp<int64_t>((512 + g.run() - 1) / g.run(), 1, 8); }
Walk sample_walk(const Geometry& g, int64_t groups, int64_t O) {
  return {groups, g.run(), O * g.Ho * g.Ws * g.fold, g.C * g.phases * g.plane_source()};
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
            // Most columns of a 3-D layer's tall kernel are empty (27 of its 1136 taps can hold a
            // connection for a 3×3×3 kernel at stride 2): skipped before tap_offset's divisions,
            // which took over half of that layer's input gradient.
            if (cp[column] == cp[column + 1]) continue;
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
