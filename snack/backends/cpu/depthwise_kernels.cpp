// Native CPU kernels of snack.SparseConv2d's depthwise layers (groups = in_channels), registered
// as torch.ops.snack_cpu.* next to conv_kernels.cpp. Output channel o of out = m·C reads input
// channel c = o / m only, and the layer's own (out, kh·kw) topology names taps: connection k is
// tap col[k] = i·kw + j of channel row[k] / m. Shapes, padding and results as conv2d_forward and
// conv2d_backward's (conv_kernels.cpp), which compute the same from the ungrouped topology:
//
//   depthwise_conv2d_forward (x (N, C, H, W), values (nnz,), rowptr (out + 1,), col (nnz,),
//                             bias (out,)?, kernel, stride, dilation, padding)  -> y (N, out, Ho, Wo)
//   depthwise_conv2d_backward (dy (N, out, Ho, Wo), x, values, rowptr, col, kernel, stride,
//                              dilation, padding, input_grad, values_grad, bias_grad)
//                                           -> (dx (N, C, H, W), dvalues (nnz,), dbias (out,))
//
// Why kernels of their own: conv2d_forward and conv2d_backward lay out the whole padded input (and
// widen the whole dy) in passes of their own before they walk it, which pays where many connections
// walk each plane. A depthwise plane has at most kh·kw, and there that layout cost more than
// oneDNN's whole dense convolution (a 95% MobileNetV2's depthwise layers at batch 32: 0.2-1.2x
// dense). Here a task lays out one (sample, channel) plane in a buffer of its own (in cache) and
// walks it at once: kernel A/B on those layers' shapes (AMD Zen 4, 2 threads, batch 32 and 1, 3×3
// at 46% density, 4×4 to 32×32 planes), forward 1.3-1.9x and backward 1.3-2.2x as fast as the
// ungrouped kernels. A training step is still 0.2-0.85x oneDNN's dense depthwise convolution's on
// 4×4 to 8×8 planes and 16×16 ones at stride 2, where a plane's bookkeeping (layout, a pass per
// tap, the copy back) outweighs its few multiply-adds; 1.0-1.3x on 16×16 planes, 1.4-4x on 32×32
// ones (benchmarks/mobilenet_step.py, three runs; oneDNN's own time there varied 2-3x).
// Measured and dropped: folding samples (16 side by side on 4×4 and 8×8 planes, as the ungrouped
// kernels do for heavy layers): the forward 1.1-2.3x slower, the transposes cost more than the
// few connections of a plane save; the backward's dots reduced over blocks of samples, and
// copies and fills of rows inline rather than by memmove and memset: within noise.
//
// Parallelism and determinism: forward tasks over (sample, channel); backward tasks over (chunk of
// samples, block of channels), partial sums per chunk reduced in chunk order (see kMaxChunks): every
// sum runs in an order fixed by the shapes, so results do not depend on the thread count.

#include "conv_walk.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <tuple>

namespace {

using namespace snack_conv;

// Each connection's window offset in its channel's source planes (fold 1); col must be taps.
std::vector<int64_t> depthwise_offsets(const at::Tensor& col, const Geometry& g, const char* what) {
  const int64_t nnz = col.numel(), taps = g.kh * g.kw;
  const int32_t* c = col.data_ptr<int32_t>();
  std::vector<int64_t> offset(nnz);
  for (int64_t k = 0; k < nnz; ++k) {
    TORCH_CHECK(c[k] >= 0 && c[k] < taps, what, ": col must hold kernel taps, in [0, kh·kw)");
    offset[k] = g.phase_of_tap[c[k]] * g.plane_source() + tap_offset(g, c[k]);
  }
  return offset;
}

Geometry depthwise_geometry(const at::Tensor& x, const at::Tensor& rowptr, at::IntArrayRef kernel,
                            at::IntArrayRef stride, at::IntArrayRef dilation, at::IntArrayRef padding,
                            const char* what) {
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous(), what, ": x must be a contiguous (N, C, H, W) tensor");
  const int64_t C = x.size(1), O = rowptr.numel() - 1;
  TORCH_CHECK(C > 0 && O % C == 0, what, ": out channels (", O, ") must be a multiple of the input's (", C, ")");
  // no connections: samples never fold (a task's buffers hold one sample)
  return geometry(x.size(0), x.sizes().slice(1), kernel, stride, dilation, padding, 0, O);
}

at::Tensor depthwise_conv2d_forward(const at::Tensor& x, const at::Tensor& values, const at::Tensor& rowptr,
                                    const at::Tensor& col, const c10::optional<at::Tensor>& bias,
                                    at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef dilation,
                                    at::IntArrayRef padding) {
  const char* what = "depthwise_conv2d_forward";
  check_topology(values, col, rowptr, what);
  const Geometry g = depthwise_geometry(x, rowptr, kernel, stride, dilation, padding, what);
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), what, ": x must have the values' dtype");
  const int64_t N = g.N, C = g.C, O = rowptr.numel() - 1, m = O / C;
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == O && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                what, ": bias must be (out,) of x's dtype");
  auto y = at::empty({N, O, g.Ho, g.Wo}, x.options());
  if (y.numel() == 0) return y;
  const std::vector<int64_t> offset = depthwise_offsets(col, g, what);
  const int32_t* rp = rowptr.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depthwise_conv2d", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    const scalar_t* bd = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yd = y.data_ptr<scalar_t>();
    at::parallel_for(0, N * C, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> source(g.in_place() ? 0 : g.phases * g.plane_source());
      // the flat walk's plane, Ws wide; y's plane itself where rows are not widened
      std::vector<scalar_t> wide(g.Ws == g.Wo ? 0 : g.run());
      const scalar_t* window[kPass];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / C, c = task % C;
        const scalar_t* plane = xd + task * g.plane_in();
        const scalar_t* src = plane;
        if (!g.in_place()) {
          lay_out_channel(&plane, 1, g, source.data());
          src = source.data();
        }
        for (int64_t o = c * m; o < (c + 1) * m; ++o) {
          scalar_t* out = yd + (n * O + o) * g.plane_out();
          scalar_t* sum = wide.empty() ? out : wide.data();
          std::fill_n(sum, g.run(), bd != nullptr ? bd[o] : scalar_t(0));
          for (int64_t k = rp[o]; k < rp[o + 1]; k += kPass) {
            const int64_t count = std::min<int64_t>(kPass, rp[o + 1] - k);
            for (int64_t t = 0; t < count; ++t) window[t] = src + offset[k + t];
            SNACK_CONV_DISPATCH(multiply_add, count, sum, window, vd + k, g.run());
          }
          if (!wide.empty()) {
            for (int64_t h = 0; h < g.Ho; ++h) std::copy_n(sum + h * g.Ws, g.Wo, out + h * g.Wo);
          }
        }
      }
    });
  });
  return y;
}

// The backward's samples in chunks (a size fixed by N alone, so that results do not depend on the
// thread count): each chunk sums its own partial dvalues and dbias, reduced in chunk order at the
// end, and a task walks a chunk's samples over a block of channels, along memory (a sample's
// channels lie one after another). Tasks over channels, each walking all samples, read planes
// kilobytes apart: kernel A/B on MobileNetV2's depthwise shapes, the backward in chunks 1.1-1.4x
// as fast (alone or right after a forward).
// Channel blocks of up to kMaxChannelBlock, smaller where that leaves too few tasks for the threads
// (a batch of one): a block's size changes no sum (a dvalues element belongs to one channel), so it
// may follow the thread count.
constexpr int64_t kMaxChunks = 16;
constexpr int64_t kMaxChannelBlock = 32;

// total[i] = Σ_c partial[c, i], the chunks in order.
void sum_chunks(const at::Tensor& partial, at::Tensor& total) {
  const int64_t chunks = partial.size(0), count = partial.size(1);
  AT_DISPATCH_FLOATING_TYPES(total.scalar_type(), "sum_chunks", [&] {
    const scalar_t* p = partial.data_ptr<scalar_t>();
    scalar_t* t = total.data_ptr<scalar_t>();
    for (int64_t i = 0; i < count; ++i) {
      scalar_t sum = p[i];
      for (int64_t c = 1; c < chunks; ++c) sum += p[c * count + i];
      t[i] = sum;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> depthwise_conv2d_backward(
    const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& values, const at::Tensor& rowptr,
    const at::Tensor& col, at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef dilation,
    at::IntArrayRef padding, bool input_grad, bool values_grad, bool bias_grad) {
  const char* what = "depthwise_conv2d_backward";
  check_topology(values, col, rowptr, what);
  const Geometry g = depthwise_geometry(x, rowptr, kernel, stride, dilation, padding, what);
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), what, ": x must have the values' dtype");
  const int64_t N = g.N, C = g.C, O = rowptr.numel() - 1, m = O / C, nnz = col.numel();
  TORCH_CHECK(dy_in.dim() == 4 && dy_in.scalar_type() == x.scalar_type() && dy_in.size(0) == N &&
                  dy_in.size(1) == O && dy_in.size(2) == g.Ho && dy_in.size(3) == g.Wo,
              what, ": dy must be (N, out, Ho, Wo) of x's dtype");
  auto dx = at::empty({input_grad ? N : 0, C, g.H, g.W}, x.options());
  auto dvalues = at::zeros({values_grad ? nnz : 0}, x.options());
  auto dbias = at::zeros({bias_grad ? O : 0}, x.options());
  if (N == 0) return {dx, dvalues, dbias};
  const at::Tensor dy = dy_in.contiguous();
  const std::vector<int64_t> offset = depthwise_offsets(col, g, what);
  const int32_t* rp = rowptr.data_ptr<int32_t>();
  const int64_t channel_size = g.phases * g.plane_source();
  const bool widen = g.Ws != g.Wo;
  const Walk walk{1, g.run(), 0, 0};
  const PhaseMerge merge = phase_merge(g);
  const int64_t chunk = (N + kMaxChunks - 1) / kMaxChunks, chunks = (N + chunk - 1) / chunk;
  const int64_t block = std::clamp<int64_t>(C * chunks / (4 * at::get_num_threads()), 1, kMaxChannelBlock);
  const int64_t blocks = (C + block - 1) / block;
  // each chunk's partial sums; the result itself when there is one chunk
  auto partial_values = chunks > 1 ? at::zeros({chunks, dvalues.numel()}, x.options()) : dvalues;
  auto partial_bias = chunks > 1 ? at::zeros({chunks, dbias.numel()}, x.options()) : dbias;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depthwise_conv2d", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* dyd = dy.data_ptr<scalar_t>();
    const scalar_t* vd = values.data_ptr<scalar_t>();
    scalar_t* dxd = dx.data_ptr<scalar_t>();
    at::parallel_for(0, chunks * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> source(values_grad && !g.in_place() ? channel_size : 0);
      std::vector<scalar_t> sums(input_grad && !g.in_place() ? channel_size : 0);
      std::vector<scalar_t> wide(widen ? g.run() : 0);
      const scalar_t* window[kPass];
      scalar_t dots[kPass];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = task / blocks * chunk, last = std::min(N, first + chunk);
        const int64_t c0 = task % blocks * block, c1 = std::min(C, c0 + block);
        scalar_t* dvd = partial_values.data_ptr<scalar_t>() + task / blocks * dvalues.numel();
        scalar_t* dbd = partial_bias.data_ptr<scalar_t>() + task / blocks * dbias.numel();
        for (int64_t n = first; n < last; ++n) {
          for (int64_t c = c0; c < c1; ++c) {
            scalar_t* dx_plane = dxd + (n * C + c) * g.plane_in();
            if (rp[c * m] == rp[(c + 1) * m] && !bias_grad) {  // no connection: dx is zero
              if (input_grad) std::fill_n(dx_plane, g.plane_in(), scalar_t(0));
              continue;
            }
            const scalar_t* plane = xd + (n * C + c) * g.plane_in();
            const scalar_t* src = plane;
            if (values_grad && !g.in_place()) {
              lay_out_channel(&plane, 1, g, source.data());
              src = source.data();
            }
            // the input gradient's source planes: dx's plane itself when they are x's
            scalar_t* target = g.in_place() ? dx_plane : sums.data();
            if (input_grad) std::fill_n(target, channel_size, scalar_t(0));
            for (int64_t o = c * m; o < (c + 1) * m; ++o) {
              const scalar_t* d = dyd + (n * O + o) * g.plane_out();
              if (bias_grad) dbd[o] += plane_sum(d, g.plane_out());
              if (rp[o] == rp[o + 1]) continue;
              if (widen) {
                for (int64_t h = 0; h < g.Ho; ++h) {
                  std::copy_n(d + h * g.Wo, g.Wo, wide.data() + h * g.Ws);
                  if (h + 1 < g.Ho) std::fill_n(wide.data() + h * g.Ws + g.Wo, g.Ws - g.Wo, scalar_t(0));
                }
                d = wide.data();
              }
              for (int64_t k = rp[o]; k < rp[o + 1]; k += kPass) {
                const int64_t count = std::min<int64_t>(kPass, rp[o + 1] - k);
                if (values_grad) {
                  for (int64_t t = 0; t < count; ++t) window[t] = src + offset[k + t];
                  SNACK_CONV_DISPATCH(window_dots, count, d, window, walk, dots);
                  for (int64_t t = 0; t < count; ++t) dvd[k + t] += dots[t];
                }
                // each connection adds into a window of its own (they overlap): one pass each
                for (int64_t t = 0; t < count && input_grad; ++t) {
                  multiply_add<scalar_t, 1>(target + offset[k + t], &d, vd + k + t, g.run());
                }
              }
            }
            if (input_grad && !g.in_place()) merge.apply(sums.data(), 1, dx_plane, 0, g);
          }
        }
      }
    });
  });
  if (chunks > 1) {
    sum_chunks(partial_values, dvalues);
    sum_chunks(partial_bias, dbias);
  }
  return {dx, dvalues, dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def(
      "depthwise_conv2d_forward(Tensor x, Tensor values, Tensor rowptr, Tensor col, Tensor? bias, int[2] kernel, "
      "int[2] stride, int[2] dilation, int[4] padding) -> Tensor");
  m.def(
      "depthwise_conv2d_backward(Tensor dy, Tensor x, Tensor values, Tensor rowptr, Tensor col, int[2] kernel, "
      "int[2] stride, int[2] dilation, int[4] padding, bool input_grad, bool values_grad, bool bias_grad) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("depthwise_conv2d_forward", &depthwise_conv2d_forward);
  m.impl("depthwise_conv2d_backward", &depthwise_conv2d_backward);
}
