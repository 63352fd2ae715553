// Native CPU kernel of RigL's gradient growth, registered as torch.ops.snack_cpu.* next to
// kernels.cpp and index_ops.cpp (one library):
//
//   gradient_scores_above (dyt (out, B), x (B, in) float32|float64, rowptr (out + 1,) int32,
//                          col (nnz,) int32, first_row, last_row, bar, strict)
//                                             -> keys (n,) int32|int64, positions (n,) int64
//       the free positions p = r · in + c of rows [first_row, last_row) (held by no connection:
//       col[rowptr[r] .. rowptr[r + 1]) are row r's, sorted) whose score |Σ_b dyt[r, b] · x[b, c]|
//       has an ordering key >= bar (> bar if strict), in increasing position, and those keys.
//       A key is the score's bit pattern read as an integer of its width, every NaN one key above
//       inf (snack.ranking.ordering_keys), so integer order is the scores' order.
//
// Why: gradient_grow formed each block of scores with a matrix product, then took |.|, the keys,
// masked the connections and compacted the survivors: six passes over the 16.7M scores of a
// 4096² layer, the first writing them all out. With a batch of 32, MKL ran that product (K = 32)
// at ~45 GFMA/s here (its large-GEMM rate: ~48), and picking the 500K scores above a bar took
// 60-75 ms. Here a few rows of scores are formed in registers from a packed copy of x, left in an
// L2-sized buffer and compared there; only the survivors are written: 30 ms for the same pick.
// The product alone runs at about 75% of MKL's large-GEMM rate; at a batch of 128 MKL's product
// was as fast, from 192 faster, and the Python caller keeps it there.
//
// Summation order: each score is Σ_b in order b = 0, 1, ..., one multiply-add per term (fused
// where the ISA has FMA), whatever the thread count: it may differ from a BLAS product in the
// last bit.
//
// Parallelism: the rows are cut into one contiguous piece per thread; each piece collects its
// survivors, and the pieces are joined in row order, so the result does not depend on the
// thread count.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// A vector register: 64 bytes on AVX-512, 32 on AVX2, 16 otherwise (SSE2, every x86-64). The
// batch loop keeps kRows × kColVecs accumulators in registers (16 of AVX-512's 32, 8 of AVX2's 16)
// and loads each x vector once for kRows rows.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kRows = 8;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
constexpr int kRows = 4;
#else
constexpr int kVecBytes = 16;
constexpr int kRows = 4;
#endif
constexpr int kColVecs = 2;

// Bytes of x's packed panels that one sweep keeps in L2, and of the score buffer: together they
// fill a 512 KiB L2 (server cores have 1-2 MiB).
constexpr int64_t kCacheBudget = 256 * 1024;

// Below this many multiply-adds a call runs on one thread: waking the pool costs more.
constexpr int64_t kSerialWork = 1 << 18;

// The vector types of a score type T: values V and keys VK (the integer of T's width), L lanes.
template <typename T>
struct Lanes {
  static constexpr int L = kVecBytes / sizeof(T);
  static constexpr int kPanel = L * kColVecs;  // columns of x per packed panel
  using Key = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  // unaligned loads and stores: aligned(alignof(T))
  typedef T V __attribute__((vector_size(kVecBytes), aligned(alignof(T))));
  typedef Key VK __attribute__((vector_size(kVecBytes), aligned(alignof(T))));
  // NaN's bit patterns lie above inf's; all become inf's + 1
  static constexpr Key kNanKey = sizeof(T) == 4 ? Key(0x7f800001) : Key(0x7ff0000000000001LL);
};

// x (B, in) as panels of kPanel columns: panel p holds x[b, p·kPanel + j] at (p·B + b)·kPanel + j,
// zero-padded past the last column, so a panel's batch loop reads one contiguous block.
template <typename T>
std::vector<T> pack_panels(const T* x, int64_t B, int64_t n_in) {
  constexpr int kPanel = Lanes<T>::kPanel;
  const int64_t panels = (n_in + kPanel - 1) / kPanel;
  std::vector<T> packed(panels * B * kPanel, T(0));
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t c0 = p * kPanel, width = std::min<int64_t>(kPanel, n_in - c0);
    for (int64_t b = 0; b < B; ++b) std::memcpy(&packed[(p * B + b) * kPanel], x + b * n_in + c0, width * sizeof(T));
  }
  return packed;
}

// Signed scores Σ_b d[i·B + b] · x[b, c] of kRows rows (d: their kRows × B slice of dyt) for the
// columns of panels [p0, p1), into out[i · stride + c].
template <typename T>
void score_rows(const T* d, const T* panels, int64_t B, int64_t p0, int64_t p1, T* out, int64_t stride) {
  using V = typename Lanes<T>::V;
  constexpr int L = Lanes<T>::L, kPanel = Lanes<T>::kPanel;
  for (int64_t p = p0; p < p1; ++p) {
    const T* panel = panels + p * B * kPanel;
    V acc[kRows][kColVecs] = {};
    for (int64_t b = 0; b < B; ++b) {
      V xv[kColVecs];
      for (int j = 0; j < kColVecs; ++j) xv[j] = *reinterpret_cast<const V*>(panel + b * kPanel + j * L);
      for (int i = 0; i < kRows; ++i) {
        const T di = d[i * B + b];
        for (int j = 0; j < kColVecs; ++j) acc[i][j] += di * xv[j];
      }
    }
    for (int i = 0; i < kRows; ++i) {
      for (int j = 0; j < kColVecs; ++j) *reinterpret_cast<V*>(out + i * stride + p * kPanel + j * L) = acc[i][j];
    }
  }
}

// One piece's survivors, in increasing position: grown a row at a time (make_room), so the
// writes of a row need no checks (collect_row's whole-vector stores may write past `size`, never
// past `capacity`). Not std::vector: resizing it would zero what is then written
// (new T[n] leaves it uninitialised).
template <typename Key>
struct Survivors {
  std::unique_ptr<Key[]> keys;
  std::unique_ptr<int64_t[]> positions;
  int64_t size = 0, capacity = 0;

  void make_room(int64_t more) {
    if (capacity - size >= more) return;
    capacity = std::max(2 * capacity, size + more);
    std::unique_ptr<Key[]> grown_keys(new Key[capacity]);
    std::unique_ptr<int64_t[]> grown_positions(new int64_t[capacity]);
    std::copy_n(keys.get(), size, grown_keys.get());
    std::copy_n(positions.get(), size, grown_positions.get());
    keys = std::move(grown_keys);
    positions = std::move(grown_positions);
  }
};

// Appends to out the survivors of one row: `scores` (n_in, signed, padded to whole vectors),
// the row's connections `col[begin .. end)`, its first position `base`. `held` (a bit per
// column, L per word, all 0) marks the connections while the row is read and is cleared after.
//
// AVX-512 packs the passing lanes with register compresses and writes them with whole-vector
// stores (the lanes past the survivors are scratch, overwritten by the next store or left past
// `size`), not with compress-stores to memory: AMD's Zen 4 runs those in microcode, and there a
// RigL pick over a 4096² layer took 39-46 ms against 22-29 ms for torch's matrix-product path
// (benchmarks/gradient_grow.py, 2026-12-01).
template <typename T>
void collect_row(const T* scores, int64_t n_in, const int32_t* col, int64_t begin, int64_t end,
                 typename Lanes<T>::Key bar, int64_t base, uint32_t* held, Survivors<typename Lanes<T>::Key>& out) {
  using Key = typename Lanes<T>::Key;
  using VK = typename Lanes<T>::VK;
  constexpr int L = Lanes<T>::L;
  for (int64_t k = begin; k < end; ++k) held[col[k] / L] |= 1u << (col[k] % L);
  out.make_room((n_in + L - 1) / L * L);  // whole vectors: see above
  Key* keys = out.keys.get();
  int64_t* positions = out.positions.get();
  int64_t n = out.size;
  for (int64_t c0 = 0; c0 < n_in; c0 += L) {
    VK key = *reinterpret_cast<const VK*>(scores + c0) & std::numeric_limits<Key>::max();  // |score|
    key = key < Lanes<T>::kNanKey ? key : Lanes<T>::kNanKey;
    uint32_t pass = ~held[c0 / L];
    if (n_in - c0 < L) pass &= (1u << (n_in - c0)) - 1;  // the padding past the last column
#if defined(__AVX512F__)
    // branch-free: the lanes' mask, then compress-stores of the passing keys and positions
    const __m512i first8 = _mm512_add_epi64(_mm512_set1_epi64(base + c0), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
    if constexpr (sizeof(T) == 4) {  // 16 lanes: their positions in two 8-lane halves
      pass &= _mm512_cmpge_epi32_mask((__m512i)key, _mm512_set1_epi32(bar));
      _mm512_storeu_si512(keys + n, _mm512_maskz_compress_epi32(pass, (__m512i)key));
      _mm512_storeu_si512(positions + n, _mm512_maskz_compress_epi64(pass & 0xff, first8));
      _mm512_storeu_si512(positions + n + __builtin_popcount(pass & 0xff),
                          _mm512_maskz_compress_epi64(pass >> 8, _mm512_add_epi64(first8, _mm512_set1_epi64(8))));
    } else {
      pass &= _mm512_cmpge_epi64_mask((__m512i)key, _mm512_set1_epi64(bar));
      _mm512_storeu_si512(keys + n, _mm512_maskz_compress_epi64(pass, (__m512i)key));
      _mm512_storeu_si512(positions + n, _mm512_maskz_compress_epi64(pass, first8));
    }
    n += __builtin_popcount(pass);
#else
    // the lanes' mask (a loop the compiler vectorizes), then only its set bits are visited
    uint32_t reach = 0;
    for (int j = 0; j < L; ++j) reach |= static_cast<uint32_t>(key[j] >= bar) << j;
    for (pass &= reach; pass != 0; pass &= pass - 1) {
      const int j = __builtin_ctz(pass);
      keys[n] = key[j];
      positions[n++] = base + c0 + j;
    }
#endif
  }
  out.size = n;
  for (int64_t k = begin; k < end; ++k) held[col[k] / L] = 0;
}

void check_matrix(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble),
              "snack_cpu.gradient_scores_above: ", name, " must be a contiguous 2-D float32 or float64 CPU tensor, got ",
              t.dim(), "-D ", t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
}

void check_index(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() && t.scalar_type() == at::kInt,
              "snack_cpu.gradient_scores_above: ", name, " must be a contiguous 1-D int32 CPU tensor, got ", t.dim(),
              "-D ", t.scalar_type(), " on ", t.device());
}

std::tuple<at::Tensor, at::Tensor> gradient_scores_above(const at::Tensor& dyt, const at::Tensor& x,
                                                         const at::Tensor& rowptr, const at::Tensor& col,
                                                         int64_t first_row, int64_t last_row, int64_t bar, bool strict) {
  check_matrix("dyt", dyt);
  check_matrix("x", x);
  check_index("rowptr", rowptr);
  check_index("col", col);
  const int64_t n_out = dyt.size(0), B = dyt.size(1), n_in = x.size(1);
  TORCH_CHECK(x.scalar_type() == dyt.scalar_type() && x.size(0) == B,
              "snack_cpu.gradient_scores_above: x must be (B, in) with dyt's dtype, for dyt ", dyt.sizes(), " ",
              dyt.scalar_type(), ", got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(rowptr.numel() == n_out + 1, "snack_cpu.gradient_scores_above: rowptr must have out + 1 = ", n_out + 1,
              " entries, got ", rowptr.numel());
  TORCH_CHECK(0 <= first_row && first_row <= last_row && last_row <= n_out,
              "snack_cpu.gradient_scores_above: rows must satisfy 0 <= first_row <= last_row <= ", n_out, ", got ",
              first_row, " and ", last_row);
  // the rows' connections index the held-column bits: checked here, once (O(their count))
  const int32_t* rowptr_p = rowptr.const_data_ptr<int32_t>();
  const int32_t* col_p = col.const_data_ptr<int32_t>();
  const int64_t begin = rowptr_p[first_row], end = rowptr_p[last_row];
  TORCH_CHECK(0 <= begin && begin <= end && end <= col.numel(), "snack_cpu.gradient_scores_above: rowptr[", first_row,
              "] = ", begin, " and rowptr[", last_row, "] = ", end, " must lie in [0, ", col.numel(), "], in order");
  for (int64_t k = begin; k < end; ++k) {
    TORCH_CHECK(0 <= col_p[k] && col_p[k] < n_in, "snack_cpu.gradient_scores_above: col[", k, "] = ", col_p[k],
                " is outside [0, ", n_in, ")");
  }
  std::tuple<at::Tensor, at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gradient_scores_above", [&] {
    using T = scalar_t;
    using Key = typename Lanes<T>::Key;
    constexpr int kPanel = Lanes<T>::kPanel;
    // a score key lies in [0, kNanKey]: a bar beyond that range passes all or nothing
    const int64_t lowest = strict ? bar + (bar < std::numeric_limits<int64_t>::max()) : bar;
    const Key key_bar = static_cast<Key>(std::clamp<int64_t>(lowest, 0, int64_t{Lanes<T>::kNanKey} + 1));
    const int64_t panels = (n_in + kPanel - 1) / kPanel, stride = panels * kPanel;
    const std::vector<T> packed = pack_panels(x.const_data_ptr<T>(), B, n_in);
    const T* dyt_p = dyt.const_data_ptr<T>();
    // rows scored per pass (their buffer in L2), and panels per sweep over them (in L2 too)
    const int64_t row_bytes = std::max<int64_t>(1, stride * sizeof(T));
    const int64_t block_rows = std::max<int64_t>(1, kCacheBudget / row_bytes / kRows) * kRows;
    const int64_t sweep_panels = std::max<int64_t>(1, kCacheBudget / std::max<int64_t>(1, B * kPanel * sizeof(T)));
    const int64_t rows = last_row - first_row;
    const bool serial = rows * n_in * B < kSerialWork;
    const int64_t groups = std::max<int64_t>(1, rows / kRows);
    const int64_t pieces = std::clamp<int64_t>(serial ? 1 : at::get_num_threads(), 1, groups);
    std::vector<Survivors<Key>> found(pieces);
    at::parallel_for(0, pieces, 1, [&](int64_t q0, int64_t q1) {
      std::vector<T> scores(block_rows * stride);
      std::vector<T> padded_dyt(kRows * B);  // the last rows' slice, zero-padded to kRows rows
      std::vector<uint32_t> held(panels * kColVecs, 0);
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t r0 = first_row + rows * q / pieces, r1 = first_row + rows * (q + 1) / pieces;
        for (int64_t block = r0; block < r1; block += block_rows) {
          const int64_t block_end = std::min(r1, block + block_rows);
          for (int64_t p = 0; p < panels; p += sweep_panels) {
            for (int64_t r = block; r < block_end; r += kRows) {
              const T* d = dyt_p + r * B;
              if (r + kRows > block_end) {
                std::fill(padded_dyt.begin(), padded_dyt.end(), T(0));
                std::copy(d, d + (block_end - r) * B, padded_dyt.begin());
                d = padded_dyt.data();
              }
              const int64_t p_end = std::min(panels, p + sweep_panels);
              score_rows(d, packed.data(), B, p, p_end, &scores[(r - block) * stride], stride);
            }
          }
          for (int64_t r = block; r < block_end; ++r) {
            collect_row<T>(&scores[(r - block) * stride], n_in, col_p, rowptr_p[r], rowptr_p[r + 1], key_bar, r * n_in,
                           held.data(), found[q]);
          }
        }
      }
    });
    int64_t total = 0;
    for (const auto& piece : found) total += piece.size;
    at::Tensor keys = at::empty({total}, x.options().dtype(sizeof(T) == 4 ? at::kInt : at::kLong));
    at::Tensor positions = at::empty({total}, x.options().dtype(at::kLong));
    Key* keys_p = keys.mutable_data_ptr<Key>();
    int64_t* positions_p = positions.mutable_data_ptr<int64_t>();
    for (const auto& piece : found) {
      keys_p = std::copy_n(piece.keys.get(), piece.size, keys_p);
      positions_p = std::copy_n(piece.positions.get(), piece.size, positions_p);
    }
    result = {keys, positions};
  });
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def(
      "gradient_scores_above(Tensor dyt, Tensor x, Tensor rowptr, Tensor col, int first_row, int last_row, int bar, "
      "bool strict) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) { m.impl("gradient_scores_above", &gradient_scores_above); }
