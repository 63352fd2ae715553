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
//   embedding_bag (values, rowptr, col, ids, bag (N,) int64, weights (N,), bags, dim)
//                                                        -> (bags, dim) in values' dtype
//       out[b] = sum over the n with bag[n] = b of weights[n] * row ids[n]; bag is
//       non-decreasing (each bag's ids are consecutive), in [0, bags)
//   embedding_bag_values_grad (grad (bags, dim), rowptr, col, ids, bag, weights) -> (nnz,)
//       dvalues[p] = sum over the n with ids[n] = row of p of weights[n] * grad[bag[n], col[p]]
//
// Why: the torch calls that do the same (snack/embedding_ops.py) expand every looked-up
// connection into index tensors (token, position, output position: 24 bytes each) in a dozen
// passes; these walk each row's connections once. The backward groups the tokens by id first
// (a sort of the N ids), so that each table row is summed by one thread: no atomics, and each
// connection's gradient written once.
//
// The bag kernels (snack.SparseEmbeddingBag's sums and means) reduce each bag as they read its
// ids' connections, a bag per thread at a time (no atomics). Without them a bag layer looked up
// (N, dim) rows, then added them up: 3.75 ms for 2,048 bags of 20 ids of a 1,000,000 x 64 table at
// 90% (nn.EmbeddingBag: 0.96 ms), where the bag kernel takes 0.70-0.79 ms.
//
// All check that every id lies in [0, V): the ops are public, and an id out of range would
// read out of bounds.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Tokens per parallel chunk: a token's row is dim elements to zero plus its connections.
constexpr int64_t kTokensPerChunk = 64;
// Bags per parallel chunk of the bag kernel: a bag is many tokens (tens, in a recommender).
constexpr int64_t kBagsPerChunk = 8;

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

// The positions of ids in order of id (then position): each run of one id is one table row's
// tokens. ``sorted_ids[i]`` is the i-th smallest id, ``position[i]`` where it stood in ids;
// ``run_start`` where each run begins, with n_tokens at the end.
struct RunsOfIds {
  at::Tensor sorted_ids, position;  // (N,) int64 each: kept alive for the pointers below
  const int64_t* id = nullptr;
  const int64_t* where = nullptr;
  std::vector<int64_t> run_start;
  int64_t runs() const { return static_cast<int64_t>(run_start.size()) - 1; }
};

RunsOfIds runs_of_ids(const at::Tensor& ids) {
  RunsOfIds runs;
  // at::sort (stable: positions in order within a run) runs in parallel: std::sort of (id, n)
  // pairs took 2-3.5 ms of a 4-6 ms gradient for 40,960 ids, at::sort 0.6 ms
  std::tie(runs.sorted_ids, runs.position) = at::sort(ids, /*stable=*/std::optional<bool>(true), /*dim=*/0);
  runs.id = runs.sorted_ids.data_ptr<int64_t>();
  runs.where = runs.position.data_ptr<int64_t>();
  const int64_t n_tokens = ids.numel();
  for (int64_t i = 0; i < n_tokens; ++i)
    if (i == 0 || runs.id[i] != runs.id[i - 1]) runs.run_start.push_back(i);
  runs.run_start.push_back(n_tokens);
  return runs;
}

// dvalues[p] for every connection p of a looked-up row: the sum over that row's tokens n of
// term(n, col[p]), one thread per row (each connection written once, no atomics).
template <typename scalar_t, typename Term>
void sum_per_connection(const RunsOfIds& runs, const int32_t* ptr, const int32_t* cols, scalar_t* out, Term term) {
  using acc_t = acc_type<scalar_t>;
  at::parallel_for(0, runs.runs(), kTokensPerChunk, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = runs.id[runs.run_start[r]];
      for (int64_t p = ptr[row]; p < ptr[row + 1]; ++p) {
        acc_t sum = 0;
        for (int64_t i = runs.run_start[r]; i < runs.run_start[r + 1]; ++i)
          sum += term(runs.where[i], cols[p]);
        out[p] = static_cast<scalar_t>(sum);
      }
    }
  });
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
  const RunsOfIds runs = runs_of_ids(ids_c);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "embedding_values_grad", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* g = grad_c.data_ptr<scalar_t>();
    sum_per_connection(runs, rowptr_c.data_ptr<int32_t>(), col_c.data_ptr<int32_t>(), dvalues.data_ptr<scalar_t>(),
                       [&](int64_t n, int32_t c) { return static_cast<acc_t>(g[n * dim + c]); });
  });
  return dvalues;
}

void check_bags(const char* op, const at::Tensor& ids, const at::Tensor& bag, const at::Tensor& weights,
                int64_t bags) {
  TORCH_CHECK(bag.is_cpu() && bag.dim() == 1 && bag.scalar_type() == at::kLong && bag.numel() == ids.numel(),
              "snack_cpu.", op, ": bag must be a 1-D int64 CPU tensor of ids' length");
  TORCH_CHECK(weights.is_cpu() && weights.dim() == 1 && weights.numel() == ids.numel(), "snack_cpu.", op,
              ": weights must be a 1-D CPU tensor of ids' length");
  TORCH_CHECK(bags >= 0, "snack_cpu.", op, ": bags must be >= 0");
  if (bag.numel() > 0) {
    // consecutive bags: each bag's ids are one range (what lets a thread sum a bag alone)
    const auto steps = bag.slice(0, 1) - bag.slice(0, 0, bag.numel() - 1);
    TORCH_CHECK(bag.min().item<int64_t>() >= 0 && bag.max().item<int64_t>() < bags &&
                    (steps.numel() == 0 || steps.min().item<int64_t>() >= 0),
                "snack_cpu.", op, ": bag must be non-decreasing, in [0, ", bags, ")");
  }
}

// How far ahead the bag kernel fetches the ids' rows. Each id's row is two dependent random
// reads (a table of millions of rows is not in cache): its row pointer, then its connections. The
// pointer is fetched 2 * kRowPrefetchDistance ids ahead, the connections kRowPrefetchDistance ids
// ahead from the pointer fetched before. 2,048 bags of 20 ids of a 1,000,000 x 64 table: 0.70 ms
// against 1.25 at 90%, 0.51 against 0.60 at 99% (twice the distance: 0.76 and 0.49).
constexpr int64_t kRowPrefetchDistance = 8;

// sum[col[p]] += weight * values[p] for the connections p in [first, last) of one row.
template <typename scalar_t, typename acc_t>
inline void add_row(acc_t* sum, acc_t weight, const scalar_t* vals, const int32_t* cols, int64_t first, int64_t last) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    // A row's columns are distinct, so 16 connections at a time are gathered, added and scattered
    // without conflicts. Rows are short (6.4 connections on average in a 64-wide table at 90%):
    // the scalar loop's branch mispredicted at the end of nearly every row, and this masked form
    // runs one iteration per 16 connections (2,048 bags of 20 ids of a 64-wide table at 90%, in
    // cache: 0.30 ms against 0.38). Four accumulators taken in turn by consecutive ids were no
    // faster (measured).
    const __m512 weight_v = _mm512_set1_ps(weight);
    for (int64_t p = first; p < last; p += 16) {
      const __mmask16 mask = last - p >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (last - p)) - 1);
      const __m512i c = _mm512_maskz_loadu_epi32(mask, cols + p);
      const __m512 v = _mm512_maskz_loadu_ps(mask, vals + p);
      const __m512 old = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, c, sum, 4);
      _mm512_mask_i32scatter_ps(sum, mask, c, _mm512_fmadd_ps(weight_v, v, old), 4);
    }
    return;
  }
#endif
  for (int64_t p = first; p < last; ++p) sum[cols[p]] += weight * static_cast<acc_t>(vals[p]);
}

at::Tensor embedding_bag(const at::Tensor& values, const at::Tensor& rowptr, const at::Tensor& col,
                         const at::Tensor& ids, const at::Tensor& bag, const at::Tensor& weights, int64_t bags,
                         int64_t dim) {
  check_operands("embedding_bag", rowptr, col, ids);
  check_bags("embedding_bag", ids, bag, weights, bags);
  TORCH_CHECK(values.is_cpu() && values.dim() == 1 && values.numel() == col.numel(),
              "snack_cpu.embedding_bag: values must be a 1-D CPU tensor of col's length");
  TORCH_CHECK(weights.scalar_type() == values.scalar_type(),
              "snack_cpu.embedding_bag: weights must have values' dtype");
  TORCH_CHECK(dim >= 0, "snack_cpu.embedding_bag: dim must be >= 0");
  auto output = at::empty({bags, dim}, values.options());
  const auto values_c = values.contiguous(), rowptr_c = rowptr.contiguous(), col_c = col.contiguous();
  const auto ids_c = ids.contiguous(), bag_c = bag.contiguous(), weights_c = weights.contiguous();
  const int32_t* ptr = rowptr_c.data_ptr<int32_t>();
  const int32_t* cols = col_c.data_ptr<int32_t>();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const int64_t* bag_of = bag_c.data_ptr<int64_t>();
  const int64_t n_tokens = ids.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "embedding_bag", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* vals = values_c.data_ptr<scalar_t>();
    const scalar_t* w = weights_c.data_ptr<scalar_t>();
    scalar_t* out = output.data_ptr<scalar_t>();
    // a chunk of bags sums its ids' rows in one accumulator row each
    at::parallel_for(0, bags, kBagsPerChunk, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sum(dim);
      int64_t n = std::lower_bound(bag_of, bag_of + n_tokens, begin) - bag_of;
      for (int64_t b = begin; b < end; ++b) {
        std::fill(sum.begin(), sum.end(), acc_t(0));
        for (; n < n_tokens && bag_of[n] == b; ++n) {
          // (see kRowPrefetchDistance; reading ptr ahead is safe: ids are checked above)
          if (n + 2 * kRowPrefetchDistance < n_tokens) __builtin_prefetch(ptr + id[n + 2 * kRowPrefetchDistance]);
          if (n + kRowPrefetchDistance < n_tokens) {
            const int32_t ahead = ptr[id[n + kRowPrefetchDistance]];
            __builtin_prefetch(cols + ahead);
            __builtin_prefetch(vals + ahead);
          }
          add_row(sum.data(), static_cast<acc_t>(w[n]), vals, cols, ptr[id[n]], ptr[id[n] + 1]);
        }
        scalar_t* row_out = out + b * dim;
        for (int64_t c = 0; c < dim; ++c) row_out[c] = static_cast<scalar_t>(sum[c]);
      }
    });
  });
  return output;
}

at::Tensor embedding_bag_values_grad(const at::Tensor& grad, const at::Tensor& rowptr, const at::Tensor& col,
                                     const at::Tensor& ids, const at::Tensor& bag, const at::Tensor& weights) {
  check_operands("embedding_bag_values_grad", rowptr, col, ids);
  TORCH_CHECK(grad.is_cpu() && grad.dim() == 2,
              "snack_cpu.embedding_bag_values_grad: grad must be a (bags, dim) CPU tensor");
  check_bags("embedding_bag_values_grad", ids, bag, weights, grad.size(0));
  TORCH_CHECK(weights.scalar_type() == grad.scalar_type(),
              "snack_cpu.embedding_bag_values_grad: weights must have grad's dtype");
  const int64_t n_tokens = ids.numel(), dim = grad.size(1);
  auto dvalues = at::zeros({col.numel()}, grad.options());
  if (n_tokens == 0 || col.numel() == 0) return dvalues;
  const auto grad_c = grad.contiguous(), rowptr_c = rowptr.contiguous(), col_c = col.contiguous();
  const auto ids_c = ids.contiguous(), bag_c = bag.contiguous(), weights_c = weights.contiguous();
  const RunsOfIds runs = runs_of_ids(ids_c);
  const int64_t* bag_of = bag_c.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "embedding_bag_values_grad", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* g = grad_c.data_ptr<scalar_t>();
    const scalar_t* w = weights_c.data_ptr<scalar_t>();
    sum_per_connection(runs, rowptr_c.data_ptr<int32_t>(), col_c.data_ptr<int32_t>(), dvalues.data_ptr<scalar_t>(),
                       [&](int64_t n, int32_t c) {
                         return static_cast<acc_t>(w[n]) * static_cast<acc_t>(g[bag_of[n] * dim + c]);
                       });
  });
  return dvalues;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def("embedding_lookup(Tensor values, Tensor rowptr, Tensor col, Tensor ids, int dim) -> Tensor");
  m.def("embedding_values_grad(Tensor grad, Tensor rowptr, Tensor col, Tensor ids) -> Tensor");
  m.def(
      "embedding_bag(Tensor values, Tensor rowptr, Tensor col, Tensor ids, Tensor bag, Tensor weights, int bags, "
      "int dim) -> Tensor");
  m.def(
      "embedding_bag_values_grad(Tensor grad, Tensor rowptr, Tensor col, Tensor ids, Tensor bag, Tensor weights) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("embedding_lookup", &embedding_lookup);
  m.impl("embedding_values_grad", &embedding_values_grad);
  m.impl("embedding_bag", &embedding_bag);
  m.impl("embedding_bag_values_grad", &embedding_bag_values_grad);
}
