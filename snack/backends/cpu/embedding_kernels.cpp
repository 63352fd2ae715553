// Native CPU kernels of the sparse embedding lookup (snack.SparseEmbedding), registered as
// torch.ops.snack_cpu.* next to the sparse kernels of kernels.cpp (one library):
//
//   embedding_lookup (values (nnz,), rowptr (V+1,) int32, col (nnz,) int32, ids (N,) int64, dim)
//                                                        -> (N, dim) in values' dtype
//       row ids[n] of the sparse (V, dim) table: zeros, and values[p] at col[p] for each
//       connection p of that row
//   embedding_values_grad (grad (N, dim), rowptr, col, ids)  -> (nnz,) in grad's dtype
//       dvalues[p] = sum over the n with ids[n] = row of p of grad[n, col[p]] (0 for rows not
//       looked up)
//
// Why: the torch calls that do the same (snack/embedding_ops.py) expand every looked-up
// connection into index tensors (token, position, output position: 24 bytes each) in a dozen
// passes; these walk each row's connections once. The backward groups the tokens by id first
// (a sort of the N ids), so that each table row is summed by one thread: no atomics, and each
// connection's gradient written once.
//
// Both check that every id lies in [0, V): the ops are public, and an id out of range would
// read out of bounds.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Tokens per parallel chunk: a token's row is dim elements to zero plus its connections.
constexpr int64_t kTokensPerChunk = 64;

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

void check_operands(const char* op, const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& ids) {
  TORCH_CHECK(rowptr.is_cpu() && rowptr.dim() == 1 && rowptr.scalar_type() == at::kInt && rowptr.numel() >= 1,
              "snack_cpu.", op, ": rowptr must be a non-empty 1-D int32 CPU tensor");
  TORCH_CHECK(col.is_cpu() && col.dim() == 1 && col.scalar_type() == at::kInt, "snack_cpu.", op,
              ": col must be a 1-D int32 CPU tensor");
  TORCH_CHECK(ids.is_cpu() && ids.dim() == 1 && ids.scalar_type() == at::kLong, "snack_cpu.", op,
              ": ids must be a 1-D int64 CPU tensor");
  const int64_t rows = rowptr.numel() - 1;
  if (ids.numel() > 0) {
    const auto [low, high] = at::aminmax(ids);
    TORCH_CHECK(low.item<int64_t>() >= 0 && high.item<int64_t>() < rows, "snack_cpu.", op, ": ids must lie in [0, ",
                rows, "), got ", low.item<int64_t>(), "..", high.item<int64_t>());
  }
}

at::Tensor embedding_lookup(const at::Tensor& values, const at::Tensor& rowptr, const at::Tensor& col,
                            const at::Tensor& ids, int64_t dim) {
  check_operands("embedding_lookup", rowptr, col, ids);
  TORCH_CHECK(values.is_cpu() && values.dim() == 1 && values.numel() == col.numel(),
              "snack_cpu.embedding_lookup: values must be a 1-D CPU tensor of col's length");
  TORCH_CHECK(dim >= 0, "snack_cpu.embedding_lookup: dim must be >= 0");
  const int64_t n_tokens = ids.numel();
  auto output = at::empty({n_tokens, dim}, values.options());
  const auto values_c = values.contiguous(), rowptr_c = rowptr.contiguous(), col_c = col.contiguous();
  const auto ids_c = ids.contiguous();
  const int32_t* ptr = rowptr_c.data_ptr<int32_t>();
  const int32_t* cols = col_c.data_ptr<int32_t>();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "embedding_lookup", [&] {
    const scalar_t* vals = values_c.data_ptr<scalar_t>();
    scalar_t* out = output.data_ptr<scalar_t>();
    at::parallel_for(0, n_tokens, kTokensPerChunk, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        scalar_t* row_out = out + n * dim;
        std::fill(row_out, row_out + dim, scalar_t(0));
        for (int64_t p = ptr[id[n]]; p < ptr[id[n] + 1]; ++p) row_out[cols[p]] = vals[p];
      }
    });
  });
  return output;
}

at::Tensor embedding_values_grad(const at::Tensor& grad, const at::Tensor& rowptr, const at::Tensor& col,
                                 const at::Tensor& ids) {
  check_operands("embedding_values_grad", rowptr, col, ids);
  TORCH_CHECK(grad.is_cpu() && grad.dim() == 2 && grad.size(0) == ids.numel(),
              "snack_cpu.embedding_values_grad: grad must be a (N, dim) CPU tensor, N = ids' length");
  const int64_t n_tokens = ids.numel(), dim = grad.size(1);
  auto dvalues = at::zeros({col.numel()}, grad.options());
  if (n_tokens == 0 || col.numel() == 0) return dvalues;
  const auto grad_c = grad.contiguous(), rowptr_c = rowptr.contiguous(), col_c = col.contiguous();
  const auto ids_c = ids.contiguous();
  const int32_t* ptr = rowptr_c.data_ptr<int32_t>();
  const int32_t* cols = col_c.data_ptr<int32_t>();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  // the tokens in order of id (then position): each run of one id is one table row's tokens
  std::vector<std::pair<int64_t, int64_t>> by_id(n_tokens);
  for (int64_t n = 0; n < n_tokens; ++n) by_id[n] = {id[n], n};
  std::sort(by_id.begin(), by_id.end());
  std::vector<int64_t> run_start;  // where each run begins in by_id, and n_tokens at the end
  for (int64_t i = 0; i < n_tokens; ++i)
    if (i == 0 || by_id[i].first != by_id[i - 1].first) run_start.push_back(i);
  run_start.push_back(n_tokens);
  const int64_t runs = static_cast<int64_t>(run_start.size()) - 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "embedding_values_grad", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* g = grad_c.data_ptr<scalar_t>();
    scalar_t* out = dvalues.data_ptr<scalar_t>();
    at::parallel_for(0, runs, kTokensPerChunk, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t row = by_id[run_start[r]].first;
        for (int64_t p = ptr[row]; p < ptr[row + 1]; ++p) {
          acc_t sum = 0;
          for (int64_t i = run_start[r]; i < run_start[r + 1]; ++i)
            sum += static_cast<acc_t>(g[by_id[i].second * dim + cols[p]]);
          out[p] = static_cast<scalar_t>(sum);
        }
      }
    });
  });
  return dvalues;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def("embedding_lookup(Tensor values, Tensor rowptr, Tensor col, Tensor ids, int dim) -> Tensor");
  m.def("embedding_values_grad(Tensor grad, Tensor rowptr, Tensor col, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("embedding_lookup", &embedding_lookup);
  m.impl("embedding_values_grad", &embedding_values_grad);
}
