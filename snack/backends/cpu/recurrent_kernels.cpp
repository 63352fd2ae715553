// Native CPU kernels of the elementwise part of one recurrent step (snack.SparseLSTM and
// snack.SparseGRU), registered as torch.ops.snack_cpu.* next to the sparse kernels (one library):
//
//   lstm_cell (pre (N, 4H), c (N, H)) -> (h (N, H), c_new (N, H))
//       pre = x·W_ihᵀ + h·W_hhᵀ + biases, gates in nn.LSTM's order (i, f, g, o):
//       c_new = σ(f)·c + σ(i)·tanh(g),  h = σ(o)·tanh(c_new)
//   lstm_cell_backward (dh?, dc_new?, pre, c, c_new) -> (dpre (N, 4H), dc (N, H))
//       the gradients of both inputs for the outputs' gradients (an absent one counts as zeros)
//   gru_cell (gx (N, 3H), gh (N, 3H), h (N, H)) -> h_new (N, H)
//       gx = x·W_ihᵀ + b_ih, gh = h·W_hhᵀ + b_hh, gates in nn.GRU's order (r, z, n):
//       r = σ(gx_r + gh_r), z = σ(gx_z + gh_z), n = tanh(gx_n + r·gh_n), h_new = n + z·(h − n)
//   gru_cell_backward (dh_new, gx, gh, h) -> (dgx (N, 3H), dgh (N, 3H), dh (N, H))
//
// Why: written as torch calls, a step is about a dozen elementwise ops forward and as many backward,
// each its own pass over memory and (training) its own autograd node. At N = 32, H = 256 (snack
// train --model lstm) those calls took about 240 us per LSTM step forward and backward on this
// project's 2-core CPU, about 40% of a SparseLSTM training step (a profile); here each direction
// is one pass, the backward recomputing the gates from pre (less to keep than the gates).
//
// float32 and float64, in at::vec::Vectorized registers of the instruction set the library is
// built for. float32's tanh is SLEEF's 3.5-ulp form (about 2x faster here than the 1-ulp form
// torch.tanh runs); the sigmoid is torch.sigmoid's own formula, 1 / (1 + exp(−x)).

// The vector width of this build (the flags come from snack/backends/cpu/__init__.py): the
// Vectorized headers pick their implementation from these macros, as ATen's own kernels do.
#if defined(__AVX512F__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

namespace {

template <typename scalar_t>
using Vec = at::vec::Vectorized<scalar_t>;

// Hidden units per parallel chunk (each a handful of exp and tanh: about 3 ns of float32 work
// here): below it a call runs on one thread, as waking the pool costs more.
constexpr int64_t kGrain = 2048;

template <typename scalar_t>
Vec<scalar_t> sigmoid(Vec<scalar_t> x) {
  return (Vec<scalar_t>(1) + x.neg().exp()).reciprocal();
}

template <typename scalar_t>
Vec<scalar_t> tanh(Vec<scalar_t> x) {
  return x.tanh();
}

template <>
Vec<float> tanh(Vec<float> x) {
#if defined(CPU_CAPABILITY_AVX512)
  return Sleef_tanhf16_u35(x);
#elif defined(CPU_CAPABILITY_AVX2)
  return Sleef_tanhf8_u35(x);
#else
  return x.tanh();
#endif
}

// Calls body(offset, count) over [0, width) in steps of one vector (the last one partial).
template <typename scalar_t, typename Body>
void over_vectors(int64_t width, const Body& body) {
  constexpr int64_t step = Vec<scalar_t>::size();
  for (int64_t j = 0; j < width; j += step) {
    body(j, std::min(step, width - j));
  }
}

template <typename scalar_t>
Vec<scalar_t> load(const scalar_t* data, int64_t count) {
  return Vec<scalar_t>::loadu(data, count);
}

// count entries of an optional gradient from offset on, or zeros where it is absent (base null).
template <typename scalar_t>
Vec<scalar_t> load_or_zero(const scalar_t* base, int64_t offset, int64_t count) {
  return base == nullptr ? Vec<scalar_t>(0) : load(base + offset, count);
}

// Rows [begin, end) of an (N, H) computation in parallel chunks of about kGrain hidden units.
template <typename Body>
void over_rows(int64_t rows, int64_t hidden, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, hidden));
  at::parallel_for(0, rows, grain, body);
}

void check_state(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like, int64_t rows,
                 int64_t width) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == like.scalar_type(), "snack_cpu.", op, ": ", name,
              " must be a CPU tensor of dtype ", like.scalar_type(), ", got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width, "snack_cpu.", op, ": ", name,
              " must have shape (", rows, ", ", width, "), got ", t.sizes());
}

// The hidden size H of gates (N, gates·H), checking gates' device, dtype and width.
int64_t hidden_size(const char* op, const at::Tensor& gates, int64_t count) {
  TORCH_CHECK(gates.device().is_cpu() && gates.dim() == 2, "snack_cpu.", op,
              ": the gates must be a 2-D CPU tensor, got shape ", gates.sizes(), " on ", gates.device());
  TORCH_CHECK(gates.scalar_type() == at::kFloat || gates.scalar_type() == at::kDouble, "snack_cpu.", op,
              ": the gates must be float32 or float64, got ", gates.scalar_type());
  TORCH_CHECK(gates.size(1) % count == 0, "snack_cpu.", op, ": the gates' width must be a multiple of ", count,
              ", got ", gates.size(1));
  return gates.size(1) / count;
}

const at::Tensor* present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

std::tuple<at::Tensor, at::Tensor> lstm_cell(const at::Tensor& pre_in, const at::Tensor& c_in) {
  const int64_t H = hidden_size("lstm_cell", pre_in, 4), N = pre_in.size(0);
  check_state("lstm_cell", "c", c_in, pre_in, N, H);
  const at::Tensor pre = pre_in.contiguous(), c = c_in.contiguous();
  at::Tensor h = at::empty({N, H}, pre.options()), c_new = at::empty({N, H}, pre.options());
  AT_DISPATCH_FLOATING_TYPES(pre.scalar_type(), "snack_cpu_lstm_cell", [&] {
    const scalar_t* pre_data = pre.data_ptr<scalar_t>();
    const scalar_t* c_data = c.data_ptr<scalar_t>();
    scalar_t* h_data = h.data_ptr<scalar_t>();
    scalar_t* c_new_data = c_new.data_ptr<scalar_t>();
    over_rows(N, H, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* p = pre_data + n * 4 * H;
        const int64_t row = n * H;
        over_vectors<scalar_t>(H, [&](int64_t j, int64_t k) {
          const auto i = sigmoid(load(p + j, k)), f = sigmoid(load(p + H + j, k));
          const auto g = tanh(load(p + 2 * H + j, k)), o = sigmoid(load(p + 3 * H + j, k));
          const auto cell = f * load(c_data + row + j, k) + i * g;
          cell.store(c_new_data + row + j, k);
          (o * tanh(cell)).store(h_data + row + j, k);
        });
      }
    });
  });
  return {h, c_new};
}

std::tuple<at::Tensor, at::Tensor> lstm_cell_backward(const std::optional<at::Tensor>& dh_in,
                                                      const std::optional<at::Tensor>& dc_new_in,
                                                      const at::Tensor& pre_in, const at::Tensor& c_in,
                                                      const at::Tensor& c_new_in) {
  const int64_t H = hidden_size("lstm_cell_backward", pre_in, 4), N = pre_in.size(0);
  check_state("lstm_cell_backward", "c", c_in, pre_in, N, H);
  check_state("lstm_cell_backward", "c_new", c_new_in, pre_in, N, H);
  const at::Tensor* dh_given = present(dh_in);
  const at::Tensor* dc_given = present(dc_new_in);
  if (dh_given != nullptr) check_state("lstm_cell_backward", "dh", *dh_given, pre_in, N, H);
  if (dc_given != nullptr) check_state("lstm_cell_backward", "dc_new", *dc_given, pre_in, N, H);
  const at::Tensor pre = pre_in.contiguous(), c = c_in.contiguous(), c_new = c_new_in.contiguous();
  const at::Tensor dh = dh_given != nullptr ? dh_given->contiguous() : at::Tensor();
  const at::Tensor dc_new = dc_given != nullptr ? dc_given->contiguous() : at::Tensor();
  at::Tensor dpre = at::empty({N, 4 * H}, pre.options()), dc = at::empty({N, H}, pre.options());
  AT_DISPATCH_FLOATING_TYPES(pre.scalar_type(), "snack_cpu_lstm_cell_backward", [&] {
    using V = Vec<scalar_t>;
    const scalar_t* pre_data = pre.data_ptr<scalar_t>();
    const scalar_t* c_data = c.data_ptr<scalar_t>();
    const scalar_t* c_new_data = c_new.data_ptr<scalar_t>();
    const scalar_t* dh_data = dh.defined() ? dh.data_ptr<scalar_t>() : nullptr;
    const scalar_t* dc_new_data = dc_new.defined() ? dc_new.data_ptr<scalar_t>() : nullptr;
    scalar_t* dpre_data = dpre.data_ptr<scalar_t>();
    scalar_t* dc_data = dc.data_ptr<scalar_t>();
    const V one(1);
    over_rows(N, H, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* p = pre_data + n * 4 * H;
        scalar_t* dp = dpre_data + n * 4 * H;
        const int64_t row = n * H;
        over_vectors<scalar_t>(H, [&](int64_t j, int64_t k) {
          const auto i = sigmoid(load(p + j, k)), f = sigmoid(load(p + H + j, k));
          const auto g = tanh(load(p + 2 * H + j, k)), o = sigmoid(load(p + 3 * H + j, k));
          const auto tanh_cell = tanh(load(c_new_data + row + j, k));
          const auto dh_row = load_or_zero(dh_data, row + j, k);
          // the cell's gradient: from c_new directly and through h = o·tanh(c_new)
          const auto dcell = load_or_zero(dc_new_data, row + j, k) + dh_row * o * (one - tanh_cell * tanh_cell);
          (dcell * g * i * (one - i)).store(dp + j, k);
          (dcell * load(c_data + row + j, k) * f * (one - f)).store(dp + H + j, k);
          (dcell * i * (one - g * g)).store(dp + 2 * H + j, k);
          (dh_row * tanh_cell * o * (one - o)).store(dp + 3 * H + j, k);
          (dcell * f).store(dc_data + row + j, k);
        });
      }
    });
  });
  return {dpre, dc};
}

at::Tensor gru_cell(const at::Tensor& gx_in, const at::Tensor& gh_in, const at::Tensor& h_in) {
  const int64_t H = hidden_size("gru_cell", gx_in, 3), N = gx_in.size(0);
  check_state("gru_cell", "gh", gh_in, gx_in, N, 3 * H);
  check_state("gru_cell", "h", h_in, gx_in, N, H);
  const at::Tensor gx = gx_in.contiguous(), gh = gh_in.contiguous(), h = h_in.contiguous();
  at::Tensor h_new = at::empty({N, H}, gx.options());
  AT_DISPATCH_FLOATING_TYPES(gx.scalar_type(), "snack_cpu_gru_cell", [&] {
    const scalar_t* gx_data = gx.data_ptr<scalar_t>();
    const scalar_t* gh_data = gh.data_ptr<scalar_t>();
    const scalar_t* h_data = h.data_ptr<scalar_t>();
    scalar_t* h_new_data = h_new.data_ptr<scalar_t>();
    over_rows(N, H, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* x = gx_data + n * 3 * H;
        const scalar_t* s = gh_data + n * 3 * H;
        const int64_t row = n * H;
        over_vectors<scalar_t>(H, [&](int64_t j, int64_t k) {
          const auto r = sigmoid(load(x + j, k) + load(s + j, k));
          const auto z = sigmoid(load(x + H + j, k) + load(s + H + j, k));
          const auto candidate = tanh(load(x + 2 * H + j, k) + r * load(s + 2 * H + j, k));
          (candidate + z * (load(h_data + row + j, k) - candidate)).store(h_new_data + row + j, k);
        });
      }
    });
  });
  return h_new;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gru_cell_backward(const at::Tensor& dh_new_in, const at::Tensor& gx_in,
                                                                 const at::Tensor& gh_in, const at::Tensor& h_in) {
  const int64_t H = hidden_size("gru_cell_backward", gx_in, 3), N = gx_in.size(0);
  check_state("gru_cell_backward", "gh", gh_in, gx_in, N, 3 * H);
  check_state("gru_cell_backward", "h", h_in, gx_in, N, H);
  check_state("gru_cell_backward", "dh_new", dh_new_in, gx_in, N, H);
  const at::Tensor gx = gx_in.contiguous(), gh = gh_in.contiguous(), h = h_in.contiguous();
  const at::Tensor dh_new = dh_new_in.contiguous();
  at::Tensor dgx = at::empty({N, 3 * H}, gx.options()), dgh = at::empty({N, 3 * H}, gx.options());
  at::Tensor dh = at::empty({N, H}, gx.options());
  AT_DISPATCH_FLOATING_TYPES(gx.scalar_type(), "snack_cpu_gru_cell_backward", [&] {
    using V = Vec<scalar_t>;
    const scalar_t* gx_data = gx.data_ptr<scalar_t>();
    const scalar_t* gh_data = gh.data_ptr<scalar_t>();
    const scalar_t* h_data = h.data_ptr<scalar_t>();
    const scalar_t* dh_new_data = dh_new.data_ptr<scalar_t>();
    scalar_t* dgx_data = dgx.data_ptr<scalar_t>();
    scalar_t* dgh_data = dgh.data_ptr<scalar_t>();
    scalar_t* dh_data = dh.data_ptr<scalar_t>();
    const V one(1);
    over_rows(N, H, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* x = gx_data + n * 3 * H;
        const scalar_t* s = gh_data + n * 3 * H;
        scalar_t* dx = dgx_data + n * 3 * H;
        scalar_t* ds = dgh_data + n * 3 * H;
        const int64_t row = n * H;
        over_vectors<scalar_t>(H, [&](int64_t j, int64_t k) {
          const auto r = sigmoid(load(x + j, k) + load(s + j, k));
          const auto z = sigmoid(load(x + H + j, k) + load(s + H + j, k));
          const auto s_n = load(s + 2 * H + j, k);
          const auto candidate = tanh(load(x + 2 * H + j, k) + r * s_n);
          const auto grad = load(dh_new_data + row + j, k);
          const auto h_row = load(h_data + row + j, k);
          const auto dcandidate = grad * (one - z) * (one - candidate * candidate);  // before its tanh
          const auto dr = dcandidate * s_n * r * (one - r);                            // before its sigmoid
          const auto dz = grad * (h_row - candidate) * z * (one - z);
          dr.store(dx + j, k);
          dr.store(ds + j, k);
          dz.store(dx + H + j, k);
          dz.store(ds + H + j, k);
          dcandidate.store(dx + 2 * H + j, k);
          (dcandidate * r).store(ds + 2 * H + j, k);
          (grad * z).store(dh_data + row + j, k);
        });
      }
    });
  });
  return {dgx, dgh, dh};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def("lstm_cell(Tensor pre, Tensor c) -> (Tensor, Tensor)");
  m.def("lstm_cell_backward(Tensor? dh, Tensor? dc_new, Tensor pre, Tensor c, Tensor c_new) -> (Tensor, Tensor)");
  m.def("gru_cell(Tensor gx, Tensor gh, Tensor h) -> Tensor");
  m.def("gru_cell_backward(Tensor dh_new, Tensor gx, Tensor gh, Tensor h) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("lstm_cell", &lstm_cell);
  m.impl("lstm_cell_backward", &lstm_cell_backward);
  m.impl("gru_cell", &gru_cell);
  m.impl("gru_cell_backward", &gru_cell_backward);
}
