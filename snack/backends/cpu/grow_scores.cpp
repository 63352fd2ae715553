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
//   gradient_scores_top_rows (dyt, x, rowptr, col, quotas (out,) int64, first_row, last_row)
//                                             -> positions (Σ quotas of the rows,) int64
//       for each row r of [first_row, last_row), the quotas[r] free positions of the row with the
//       largest scores (equal scores: the lower position first, NaN above every number), in
//       increasing position: SRigL's regrowth, a quota per row (snack.dst.gradient_grow_rows).
//       The scores are formed as above, and each row's pick runs among the free columns reaching a
//       bar read off a sample of the row (top_of_row). torch's product, topk along the rows of a
//       block and the comparisons for ties took 136 ms against 32 for a 4096² layer at 90%, batch
//       32, quotas of 30% of each row (99%: 90 against 14; RigL's pick of as many: 19 and 13).
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

// A vector register: 64 bytes on AVX-512, 32 on AVX2, 16 otherwise (SSE2, every x86-64). The
// batch loop keeps kRows × kColVecs accumulators in registers (16 of AVX-512's 32, 12 of AVX2's 16)
// and loads each x vector once for kRows rows. (AVX2: 6 rows formed the scores of a 4096² layer,
// batch 32, in 0.81-0.86x the time of 4 in an interleaved probe, one and two threads, AMD EPYC.)
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kRows = 8;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
constexpr int kRows = 6;
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

// Bit j set where lane j of a comparison's result (all ones or zeros per lane) is set: one
// movemask instruction with AVX2 or SSE2 (AVX-512 builds compare into mask registers instead).
// GCC compiled the plain loop over the lanes into an extract and a scalar compare per lane, and
// collect_row then cost more than forming the scores: in an interleaved probe of a 4096² layer at
// 90%, batch 32, scoring and collecting took 31-33 ms with that loop against 20-21 ms with this
// on one thread (forming the scores alone 13-15), 18-23 against 10-17 ms on two (AVX2, AMD EPYC).
template <typename T>
inline uint32_t lane_mask(typename Lanes<T>::VK hits) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) return _mm256_movemask_ps(reinterpret_cast<__m256>(hits));
  else return _mm256_movemask_pd(reinterpret_cast<__m256d>(hits));
#elif defined(__SSE2__) && !defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) return _mm_movemask_ps(reinterpret_cast<__m128>(hits));
  else return _mm_movemask_pd(reinterpret_cast<__m128d>(hits));
#else
  uint32_t mask = 0;
  for (int j = 0; j < Lanes<T>::L; ++j) mask |= static_cast<uint32_t>(hits[j] != 0) << j;
  return mask;
#endif
}

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
    // the lanes' mask (a vector compare), then only its set bits are visited
    for (pass &= lane_mask<T>(key >= bar); pass != 0; pass &= pass - 1) {
      const int j = __builtin_ctz(pass);
      keys[n] = key[j];
      positions[n++] = base + c0 + j;
    }
#endif
  }
  out.size = n;
  for (int64_t k = begin; k < end; ++k) held[col[k] / L] = 0;
}

void check_matrix(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble),
              "snack_cpu.", op, ": ", name, " must be a contiguous 2-D float32 or float64 CPU tensor, got ", t.dim(),
              "-D ", t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
}

void check_index(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype = at::kInt) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() && t.scalar_type() == dtype, "snack_cpu.", op,
              ": ", name, " must be a contiguous 1-D ", dtype == at::kInt ? "int32" : "int64", " CPU tensor, got ",
              t.dim(), "-D ", t.scalar_type(), " on ", t.device());
}

// The checks both ops make of (dyt, x, rowptr, col) and the rows [first_row, last_row).
void check_inputs(const char* op, const at::Tensor& dyt, const at::Tensor& x, const at::Tensor& rowptr,
                  const at::Tensor& col, int64_t first_row, int64_t last_row) {
  check_matrix(op, "dyt", dyt);
  check_matrix(op, "x", x);
  check_index(op, "rowptr", rowptr);
  check_index(op, "col", col);
  const int64_t n_out = dyt.size(0), B = dyt.size(1), n_in = x.size(1);
  TORCH_CHECK(x.scalar_type() == dyt.scalar_type() && x.size(0) == B, "snack_cpu.", op,
              ": x must be (B, in) with dyt's dtype, for dyt ", dyt.sizes(), " ", dyt.scalar_type(), ", got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(rowptr.numel() == n_out + 1, "snack_cpu.", op, ": rowptr must have out + 1 = ", n_out + 1,
              " entries, got ", rowptr.numel());
  TORCH_CHECK(0 <= first_row && first_row <= last_row && last_row <= n_out, "snack_cpu.", op,
              ": rows must satisfy 0 <= first_row <= last_row <= ", n_out, ", got ", first_row, " and ", last_row);
  // the rows' connections index the held-column bits: checked here, once (O(their count))
  const int32_t* rowptr_p = rowptr.const_data_ptr<int32_t>();
  const int32_t* col_p = col.const_data_ptr<int32_t>();
  const int64_t begin = rowptr_p[first_row], end = rowptr_p[last_row];
  TORCH_CHECK(0 <= begin && begin <= end && end <= col.numel(), "snack_cpu.", op, ": rowptr[", first_row, "] = ", begin,
              " and rowptr[", last_row, "] = ", end, " must lie in [0, ", col.numel(), "], in order");
  for (int64_t k = begin; k < end; ++k) {
    TORCH_CHECK(0 <= col_p[k] && col_p[k] < n_in, "snack_cpu.", op, ": col[", k, "] = ", col_p[k], " is outside [0, ",
                n_in, ")");
  }
}

// Scores of rows of dyt (out, B) against x (B, in), a block of rows at a time into an L2-sized
// buffer: for_each_row calls visit(piece, r, scores of row r (in, signed, padded to whole vectors))
// for every row of [first_row, last_row), the rows cut into `pieces` contiguous ranges run in
// parallel (piece q visits its rows in order).
template <typename T>
struct Scorer {
  static constexpr int kPanel = Lanes<T>::kPanel;
  const T* dyt;
  int64_t B, n_in, panels, stride, block_rows, sweep_panels;
  std::vector<T> packed;

  Scorer(const at::Tensor& dyt_tensor, const at::Tensor& x)
      : dyt(dyt_tensor.const_data_ptr<T>()), B(dyt_tensor.size(1)), n_in(x.size(1)),
        panels((n_in + kPanel - 1) / kPanel), stride(panels * kPanel),
        // rows scored per pass (their buffer in L2), and panels per sweep over them (in L2 too)
        block_rows(std::max<int64_t>(1, kCacheBudget / std::max<int64_t>(1, stride * int64_t(sizeof(T))) / kRows) *
                   kRows),
        sweep_panels(std::max<int64_t>(1, kCacheBudget / std::max<int64_t>(1, B * kPanel * int64_t(sizeof(T))))),
        packed(pack_panels(x.const_data_ptr<T>(), B, n_in)) {}

  // how many pieces to cut rows [first_row, last_row) into: one per thread, unless the work is small
  int64_t pieces(int64_t first_row, int64_t last_row) const {
    const int64_t rows = last_row - first_row;
    const bool serial = rows * n_in * B < kSerialWork;
    return std::clamp<int64_t>(serial ? 1 : at::get_num_threads(), 1, std::max<int64_t>(1, rows / kRows));
  }

  template <typename Visit>
  void for_each_row(int64_t first_row, int64_t last_row, int64_t pieces, const Visit& visit) const {
    const int64_t rows = last_row - first_row;
    at::parallel_for(0, pieces, 1, [&](int64_t q0, int64_t q1) {
      std::vector<T> scores(block_rows * stride);
      std::vector<T> padded_dyt(kRows * B);  // the last rows' slice, zero-padded to kRows rows
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t r0 = first_row + rows * q / pieces, r1 = first_row + rows * (q + 1) / pieces;
        for (int64_t block = r0; block < r1; block += block_rows) {
          const int64_t block_end = std::min(r1, block + block_rows);
          for (int64_t p = 0; p < panels; p += sweep_panels) {
            for (int64_t r = block; r < block_end; r += kRows) {
              const T* d = dyt + r * B;
              if (r + kRows > block_end) {
                std::fill(padded_dyt.begin(), padded_dyt.end(), T(0));
                std::copy(d, d + (block_end - r) * B, padded_dyt.begin());
                d = padded_dyt.data();
              }
              score_rows(d, packed.data(), B, p, std::min(panels, p + sweep_panels), &scores[(r - block) * stride],
                         stride);
            }
          }
          for (int64_t r = block; r < block_end; ++r) visit(q, r, &scores[(r - block) * stride]);
        }
      }
    });
  }
};

std::tuple<at::Tensor, at::Tensor> gradient_scores_above(const at::Tensor& dyt, const at::Tensor& x,
                                                         const at::Tensor& rowptr, const at::Tensor& col,
                                                         int64_t first_row, int64_t last_row, int64_t bar, bool strict) {
  check_inputs("gradient_scores_above", dyt, x, rowptr, col, first_row, last_row);
  const int32_t* rowptr_p = rowptr.const_data_ptr<int32_t>();
  const int32_t* col_p = col.const_data_ptr<int32_t>();
  std::tuple<at::Tensor, at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gradient_scores_above", [&] {
    using T = scalar_t;
    using Key = typename Lanes<T>::Key;
    // a score key lies in [0, kNanKey]: a bar beyond that range passes all or nothing
    const int64_t lowest = strict ? bar + (bar < std::numeric_limits<int64_t>::max()) : bar;
    const Key key_bar = static_cast<Key>(std::clamp<int64_t>(lowest, 0, int64_t{Lanes<T>::kNanKey} + 1));
    const Scorer<T> scorer(dyt, x);
    const int64_t n_in = scorer.n_in, pieces = scorer.pieces(first_row, last_row);
    std::vector<Survivors<Key>> found(pieces);
    std::vector<std::vector<uint32_t>> held(pieces, std::vector<uint32_t>(scorer.panels * kColVecs, 0));
    scorer.for_each_row(first_row, last_row, pieces, [&](int64_t q, int64_t r, const T* scores) {
      collect_row<T>(scores, n_in, col_p, rowptr_p[r], rowptr_p[r + 1], key_bar, r * n_in, held[q].data(), found[q]);
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

// The ordering key of one score: |score|'s bit pattern, NaN one above inf (collect_row's, a lane at a time).
template <typename T>
inline typename Lanes<T>::Key key_of(T score) {
  typename Lanes<T>::Key key;
  std::memcpy(&key, &score, sizeof(key));
  return std::min<typename Lanes<T>::Key>(key & std::numeric_limits<decltype(key)>::max(), Lanes<T>::kNanKey);
}

// Scratch of one piece of gradient_scores_top_rows.
template <typename Key>
struct TopScratch {
  Survivors<Key> survivors;                  // the free columns reaching a row's bar
  std::vector<Key> sample;                   // keys of every kSampleStride-th column, then the survivors'
};

// Columns between the keys a row's bar is read off.
constexpr int64_t kSampleStride = 16;

// Appends to out the positions base + c of the `quota` free columns c of one row with the largest
// |scores| (n_in, signed): ordering keys as collect_row's, equal keys to the lower column, in
// increasing position. `held` is collect_row's.
//
// A quota is a few percent of a row (SRigL replaces a fraction of each row's fan-in): selecting it
// among every free column made the kernel take 70 ms (std::nth_element) or 78 (a heap of the
// best so far) for a 4096² layer at 90%, batch 32, quotas of 30% of each row: 32 ms this way
// (AVX-512 AMD EPYC). A bar is read off every kSampleStride-th column's key first, low enough that
// the quota's free columns nearly always reach it, collect_row gathers the free columns reaching it
// (vector compares), and the selection runs among those; where fewer than the quota reach it (a
// bar too high), among every free column. Exact either way.
template <typename T>
void top_of_row(const T* scores, int64_t n_in, const int32_t* col, int64_t begin, int64_t end, int64_t quota,
                int64_t base, uint32_t* held, TopScratch<typename Lanes<T>::Key>& scratch, std::vector<int64_t>& out) {
  using Key = typename Lanes<T>::Key;
  Key bar = 0;
  scratch.sample.clear();
  for (int64_t c = 0; c < n_in; c += kSampleStride) scratch.sample.push_back(key_of(scores[c]));
  // how many sampled keys reach the bar: each stands for about kSampleStride columns, a share
  // free / n_in of them free; the expected count for the quota, three (Poisson) standard
  // deviations and two more. Keys for a third more than the quota, or 3 more than its share (before
  // 2026-12-07, blind to the connections' share), left too few free columns at the bar in 29% of
  // the rows of a 4096² layer at 90%, random x and dy, quotas of 30% of each row (every row at
  // 50%): each then collected and ranked all its free columns. This rule: none of 4096 rows at
  // 90% and 99%, 1 at 50%. The whole call at 90%: 36-40 ms against 52-56 (2 threads, builds
  // alternating, AVX2 AMD EPYC).
  const double expected = static_cast<double>(quota) * n_in / (kSampleStride * (n_in - (end - begin)));
  const int64_t reaching = static_cast<int64_t>(std::ceil(expected + 3 * std::sqrt(expected))) + 2;
  if (reaching <= static_cast<int64_t>(scratch.sample.size())) {
    std::nth_element(scratch.sample.begin(), scratch.sample.begin() + (reaching - 1), scratch.sample.end(),
                     std::greater<Key>());
    bar = scratch.sample[reaching - 1];
  }
  Survivors<Key>& found = scratch.survivors;
  found.size = 0;
  collect_row<T>(scores, n_in, col, begin, end, bar, base, held, found);
  if (found.size < quota) {  // the bar was too high: every free column
    found.size = 0;
    collect_row<T>(scores, n_in, col, begin, end, Key(0), base, held, found);
  }
  // the quota-th largest key, then in increasing position those above it and the first equal ones
  auto& keys = scratch.sample;
  keys.assign(found.keys.get(), found.keys.get() + found.size);
  std::nth_element(keys.begin(), keys.begin() + (quota - 1), keys.end(), std::greater<Key>());
  const Key kth = keys[quota - 1];
  int64_t ties = quota;
  for (int64_t i = 0; i < found.size; ++i) ties -= found.keys[i] > kth;
  for (int64_t i = 0; i < found.size; ++i) {
    const Key key = found.keys[i];
    if (key > kth || (key == kth && ties-- > 0)) out.push_back(found.positions[i]);
  }
}

at::Tensor gradient_scores_top_rows(const at::Tensor& dyt, const at::Tensor& x, const at::Tensor& rowptr,
                                    const at::Tensor& col, const at::Tensor& quotas, int64_t first_row,
                                    int64_t last_row) {
  const char* op = "gradient_scores_top_rows";
  check_inputs(op, dyt, x, rowptr, col, first_row, last_row);
  check_index(op, "quotas", quotas, at::kLong);
  TORCH_CHECK(quotas.numel() == dyt.size(0), "snack_cpu.", op, ": quotas must have one entry per row (", dyt.size(0),
              "), got ", quotas.numel());
  const int32_t* rowptr_p = rowptr.const_data_ptr<int32_t>();
  const int32_t* col_p = col.const_data_ptr<int32_t>();
  const int64_t* quota_p = quotas.const_data_ptr<int64_t>();
  const int64_t n_in = x.size(1);
  for (int64_t r = first_row; r < last_row; ++r) {
    const int64_t free = n_in - (rowptr_p[r + 1] - rowptr_p[r]);
    TORCH_CHECK(0 <= quota_p[r] && quota_p[r] <= free, "snack_cpu.", op, ": quotas[", r, "] = ", quota_p[r],
                " must lie in [0, ", free, "], the free positions of row ", r);
  }
  at::Tensor result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gradient_scores_top_rows", [&] {
    using T = scalar_t;
    using Key = typename Lanes<T>::Key;
    const Scorer<T> scorer(dyt, x);
    const int64_t pieces = scorer.pieces(first_row, last_row);
    std::vector<std::vector<int64_t>> found(pieces);
    std::vector<std::vector<uint32_t>> held(pieces, std::vector<uint32_t>(scorer.panels * kColVecs, 0));
    std::vector<TopScratch<Key>> scratch(pieces);
    scorer.for_each_row(first_row, last_row, pieces, [&](int64_t q, int64_t r, const T* scores) {
      if (quota_p[r] > 0) {
        top_of_row<T>(scores, n_in, col_p, rowptr_p[r], rowptr_p[r + 1], quota_p[r], r * n_in, held[q].data(),
                      scratch[q], found[q]);
      }
    });
    int64_t total = 0;
    for (const auto& piece : found) total += static_cast<int64_t>(piece.size());
    result = at::empty({total}, x.options().dtype(at::kLong));
    int64_t* out = result.mutable_data_ptr<int64_t>();
    for (const auto& piece : found) out = std::copy(piece.begin(), piece.end(), out);
  });
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(snack_cpu, m) {
  m.def(
      "gradient_scores_above(Tensor dyt, Tensor x, Tensor rowptr, Tensor col, int first_row, int last_row, int bar, "
      "bool strict) -> (Tensor, Tensor)");
  m.def(
      "gradient_scores_top_rows(Tensor dyt, Tensor x, Tensor rowptr, Tensor col, Tensor quotas, int first_row, "
      "int last_row) -> Tensor");
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("gradient_scores_above", &gradient_scores_above);
  m.impl("gradient_scores_top_rows", &gradient_scores_top_rows);
}
