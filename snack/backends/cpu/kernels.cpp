// Native CPU kernels for snack's three sparse ops, registered as torch.ops.snack_cpu.*.
//
// W is a sparse out × in matrix in CSR form: `rowptr (out+1)`, `col (nnz)`, `values (nnz)`.
//
//   spmm   (x (B,in),   values, rowptr, col, bias?)       -> y (B,out)   y  = x · Wᵀ (+ bias)
//   spmv_u16 (x (1,in), values, rowptr, col16, bias?)      -> y (1,out)   the same, 16-bit columns
//   spmm_t (dy (B,out), values, rowptr, col, in_features) -> dx (B,in)   dx = dy · W
//   sddmm  (dy (B,out), x (B,in), rowptr, col)            -> (nnz,)      Σ_b dy[b,row_k]·x[b,col_k]
//   spmm_backward (dy, x, values, rowptr, col, bias_grad) -> (spmm_t(dy), sddmm(dy, x), Σ_b dy), in one pass
//                 where that makes fewer passes over W than the two kernels (fuses_backward)
//
// Layout: the batch is the inner, contiguous dimension. The dense operands (x for spmm, dy for
// spmm_t, both for sddmm) are packed once per call into tiles
// `(tiles, n, W)`: tile t holds batch columns [t·W, t·W + W) of every gathered row, zero-padded,
// so each non-zero reads one contiguous W-vector, W is a compile-time constant the compiler
// unrolls into registers (vectors of 16 floats on AVX-512 where W allows, else 8), and one tile
// (n · W values) is sized to stay in L2 while all rows stream past it. B = 1 uses W = 1 (a
// sparse matrix-vector product; its forward reads 16-bit columns, spmv_u16).
//
// Parallelism: rows are split into chunks of about equal work (non-zeros + rows) and run with
// at::parallel_for. In spmm and sddmm every output element is written by exactly one chunk; in
// spmm_t each thread scatters into a private accumulator and these are summed (see
// scatter_product). No atomics anywhere. Temporaries live in per-thread scratch buffers (Scratch).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <sys/mman.h>
#include <unistd.h>
#include <cstdlib>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using index_t = int32_t;

// Accumulation type: float for float, bfloat16 and half; double for double.
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Below this many multiply-adds a call runs on one thread: waking the pool costs more.
constexpr int64_t kSerialWork = 1 << 15;
// Below this many elements a pack (or another copy-like pass) runs on one thread: waking the pool
// costs more.
constexpr int64_t kSerialPack = 1 << 16;
// Outputs are (B, n) with the batch outer, so one row's W results go to W addresses n apart: when
// n · 4 bytes is a multiple of 4 KiB they all fall in one L1 set and evict each other. Results of
// kRowBlock consecutive rows are therefore kept together and written as W runs of kRowBlock
// contiguous values (a 64-byte line for float).
constexpr int64_t kRowBlock = 16;
static_assert(kRowBlock == 16, "gather_rows writes its row blocks with unpack_block, whose full blocks are 16 rows");

// Most bytes of spmm_t's per-thread accumulators for all batch tiles at once (scatter_product):
// below it a call runs every tile in one parallel region, above it one region per tile.
constexpr int64_t kRoundBytes = int64_t{8} << 20;
// Largest batch tile; a tile of W accumulators times the unroll factor fills the vector registers.
constexpr int kMaxTile = 64;

// Bytes of one packed tile that may occupy L2: half of it, the rest is for the streamed indices
// and values. Read from the OS; 512 KiB (a common L2 size) if it does not say.
int64_t tile_budget_bytes() {
  static const int64_t budget = [] {
    long l2 = -1;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return (l2 > 0 ? static_cast<int64_t>(l2) : int64_t{512} * 1024) / 2;
  }();
  return budget;
}

// Batch tile width for a batch of B gathered from rows of length n. W = 1 for B <= 1;
// otherwise a multiple of 8 (one AVX2 float vector), at most kMaxTile, small enough that a
// packed tile fits the L2 budget, and spread evenly so the last tile is not mostly padding.
int tile_width(int64_t B, int64_t n, int64_t elem_size) {
  if (B <= 1) return 1;
  const int64_t fits = tile_budget_bytes() / std::max<int64_t>(1, n * elem_size);
  const int64_t cap = std::clamp<int64_t>(fits / 8 * 8, 8, kMaxTile);
  const int64_t tiles = (B + cap - 1) / cap;
  const int64_t even = (B + tiles - 1) / tiles;
  // instantiated widths: 8, 16, 24, 32, 48, 64
  for (int w : {8, 16, 24, 32, 48, 64}) {
    if (w >= even) return w;
  }
  return kMaxTile;
}

// Calls f(std::integral_constant<int, W>{}) for the runtime width w (one of tile_width's values).
template <typename F>
void with_width(int w, F&& f) {
  switch (w) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    case 24: return f(std::integral_constant<int, 24>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 48: return f(std::integral_constant<int, 48>{});
    case 64: return f(std::integral_constant<int, 64>{});
    default: TORCH_CHECK(false, "snack_cpu: internal error, unsupported tile width ", w);
  }
}

// Splits segments [0, n) of a pointer array `ptr (n+1)` into at most `pieces` contiguous ranges of
// about equal cost, cost(segment i) = its length + 1 (the +1 is the per-row output write).
// Returns the range boundaries (first 0, last n).
std::vector<int64_t> balanced_bounds(const index_t* ptr, int64_t n, int64_t pieces) {
  std::vector<int64_t> bounds{0};
  const int64_t total = static_cast<int64_t>(ptr[n]) + n;
  int64_t lo = 0;
  for (int64_t i = 1; i < pieces; ++i) {
    const int64_t target = total * i / pieces;
    // first r in [lo, n] with ptr[r] + r >= target (cost before segment r)
    int64_t a = lo, b = n;
    while (a < b) {
      const int64_t mid = (a + b) / 2;
      if (static_cast<int64_t>(ptr[mid]) + mid < target) a = mid + 1; else b = mid;
    }
    if (a > bounds.back()) bounds.push_back(a);
    lo = a;
  }
  if (bounds.back() != n) bounds.push_back(n);
  return bounds;
}

// Runs body(begin, end) over segments [0, n) of `ptr`, in parallel when the work (multiply-adds)
// is large enough: one range of about equal cost per thread (at::parallel_for hands out equal
// index ranges, so the balancing by non-zeros happens here).
template <typename F>
void parallel_segments(const index_t* ptr, int64_t n, int64_t work, const F& body) {
  if (n == 0) return;
  const int64_t threads = at::get_num_threads();
  if (work < kSerialWork || threads == 1) {
    body(int64_t{0}, n);
    return;
  }
  const auto bounds = balanced_bounds(ptr, n, std::min<int64_t>(n, threads));
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) body(bounds[c], bounds[c + 1]);
  });
}

// parallel_segments for every batch tile in one parallel region: body(t, begin, end) for tiles
// t = 0, 1, ... in turn within each range, in parallel when one tile's multiply-adds
// (`tile_work`) are enough (as when each tile was a region of its own: below that, the cores
// passing a small layer's data between their caches cost more than the second core gains). One
// region per call, not per tile: a layer of few non-zeros and a batch of many tiles (a
// transformer's tokens) paid the pool's wake-up and barrier once per tile (a 128×128 layer at
// 90%, batch 1024: 1.3x faster in one region). Each range still walks the tiles in order, so
// what accumulates across tiles (sddmm's dvalues) adds up as before, in one thread.
template <typename F>
void parallel_tiled_segments(const index_t* ptr, int64_t n, int64_t tiles, int64_t tile_work, const F& body) {
  parallel_segments(ptr, n, tile_work, [&](int64_t r0, int64_t r1) {
    for (int64_t t = 0; t < tiles; ++t) body(t, r0, r1);
  });
}

// Memory for one call's temporaries (packed tiles, accumulators). A fresh large allocation pays
// a page fault per 4 KiB on every call, which costs as much as a small layer's whole kernel, so
// buffers up to kScratchCap are kept per calling thread, one per slot, and reused; larger ones
// (rare, huge layers) are allocated per call and freed, their page faults small beside the work.
class Scratch {
 public:
  enum Slot { kPackA, kPackB, kAccumulator, kValues, kSlots };

  template <typename T>
  T* get(Slot slot, int64_t count) {
    const int64_t bytes = std::max<int64_t>(1, count) * static_cast<int64_t>(sizeof(T));
    if (bytes > kScratchCap) {
      owned_.push_back(at::empty({bytes}, at::TensorOptions().dtype(at::kByte)));
      return reinterpret_cast<T*>(owned_.back().mutable_data_ptr());
    }
    return reinterpret_cast<T*>(pool()[slot].reserve(bytes, slot));
  }

 private:
  static constexpr int64_t kScratchCap = int64_t{64} << 20;
  static constexpr int64_t kHugePage = int64_t{2} << 20;

  // A buffer on page-aligned memory; from 1 MiB on, 2 MiB-aligned and advised for transparent
  // huge pages: the kernels read the packed tiles and accumulators at random rows, and with
  // 4 KiB pages those reads miss the L1 TLB. Slot s starts s · 576 bytes (9 cache lines) into
  // its allocation, so rows of different slots at the same index (the accumulator and packed x
  // in spmm_backward) are not 4 KiB apart, which would make loads of one wait on stores to the
  // other (4K aliasing). Together these took the fused backward at 90%, batch 32 from 5.4 to 3.8 ms.
  struct Buffer {
    char* base = nullptr;
    int64_t capacity = 0;
    ~Buffer() { std::free(base); }
    char* reserve(int64_t bytes, int slot) {
      const int64_t offset = slot * 576;
      if (bytes + offset > capacity) {
        // the old buffer goes first (the two need not fit at once); the pool is left empty, not
        // with a stale capacity, if the new one cannot be had
        std::free(base);
        base = nullptr;
        capacity = 0;
        const int64_t alignment = bytes + offset >= kHugePage / 2 ? kHugePage : 4096;
        const int64_t rounded = (bytes + offset + alignment - 1) / alignment * alignment;
        char* fresh = static_cast<char*>(std::aligned_alloc(alignment, rounded));
        TORCH_CHECK(fresh != nullptr, "snack_cpu: out of memory allocating ", rounded, " bytes of scratch space");
        base = fresh;
        capacity = rounded;
#ifdef MADV_HUGEPAGE
        if (alignment == kHugePage) madvise(base, capacity, MADV_HUGEPAGE);  // advice: works without
#endif
      }
      return base + offset;
    }
  };
  static std::array<Buffer, kSlots>& pool() {
    thread_local std::array<Buffer, kSlots> buffers;
    return buffers;
  }
  std::vector<at::Tensor> owned_;
};

// Packs a (B, n) row-major matrix into tiles (tiles, n, W) of acc_t, zero-padding the batch.
// A transpose: it runs over blocks of kPackCols columns, reading kPackCols contiguous values (one
// cache line of float) of each batch row and writing them into a small contiguous block of the
// tile. Walking the source a column at a time instead reads B lines n values apart, which for n a
// multiple of 1024 all fall into one L1 set and evict each other (measured 0.12 ms for 32 × 4096).
constexpr int64_t kPackCols = 16;

// One block of a pack: out[i · W + j] = src[j · n + i] for the `width` batch rows j and `count`
// columns i, zeros for j >= width. Full blocks have compile-time bounds, which lets the compiler
// keep everything in registers. The loops run along the strided array's contiguous dimension.
#if defined(__AVX512F__)
// Transposes the 16 × 16 floats whose rows start at in[k · in_stride] into out[k · out_stride]
// (out row k = column k of the input) in registers: 16 loads, 64 shuffles and 16 stores, where
// an element at a time takes 256 scalar loads and stores (measured ~3x faster for the fixed cost
// of a batch-32 layer's pack and unpack). Interleaves 32-bit then 64-bit elements within 128-bit
// lanes, then moves whole lanes.
inline void transpose16x16(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
  __m512 r[16], t[16];
  for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(in + k * in_stride);
  // t[2k] lane L: a(2k,4L) a(2k+1,4L) a(2k,4L+1) a(2k+1,4L+1); t[2k+1] the same for 4L+2, 4L+3
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  // r[4g + c] lane L: column 4L + c of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    const __m512d lo = _mm512_castps_pd(t[4 * g]), hi = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d lo2 = _mm512_castps_pd(t[4 * g + 2]), hi2 = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, lo2));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, lo2));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi, hi2));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi, hi2));
  }
  // column 4L + c = lane L of r[c], r[4 + c], r[8 + c], r[12 + c], in that order
  for (int c = 0; c < 4; ++c) {
    const __m512 even01 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 odd01 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 even23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 odd23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    _mm512_storeu_ps(out + (0 + c) * out_stride, _mm512_shuffle_f32x4(even01, even23, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(out + (8 + c) * out_stride, _mm512_shuffle_f32x4(even01, even23, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(out + (4 + c) * out_stride, _mm512_shuffle_f32x4(odd01, odd23, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(out + (12 + c) * out_stride, _mm512_shuffle_f32x4(odd01, odd23, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}
#endif

// Whether a full (W rows × kPackCols) float block is transposed 16 × 16 in registers.
template <int W, typename scalar_t, typename acc_t>
constexpr bool kRegisterTranspose =
#if defined(__AVX512F__)
    std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float> && W % 16 == 0 && kPackCols == 16;
#else
    false;
#endif

template <int W, typename scalar_t, typename acc_t>
void pack_block(const scalar_t* __restrict src, int64_t n, int64_t width, int64_t count, acc_t* __restrict out) {
#if defined(__AVX512F__)
  if constexpr (kRegisterTranspose<W, scalar_t, acc_t>) {
    if (width == W && count == kPackCols) {
      for (int j0 = 0; j0 < W; j0 += 16) transpose16x16(src + j0 * n, n, out + j0, W);
      return;
    }
  }
#endif
  if (width == W && count == kPackCols) {
    for (int j = 0; j < W; ++j)
#pragma GCC unroll 16
      for (int i = 0; i < kPackCols; ++i) out[i * W + j] = static_cast<acc_t>(src[j * n + i]);
    return;
  }
  for (int64_t j = 0; j < W; ++j)
    for (int64_t i = 0; i < count; ++i) out[i * W + j] = j < width ? static_cast<acc_t>(src[j * n + i]) : acc_t(0);
}

// The inverse of pack_block: out[j · stride + i] = block[i · W + j] for the `width` batch rows j
// and `count` rows i of a (count, W) block of results. (Not one generic transpose with
// pack_block: this loop order, contiguous writes to `out`, is what keeps it fast; writing along
// the block's rows instead measured 3x slower for the forward's fixed cost.)
template <int W, typename scalar_t, typename acc_t>
void unpack_block(const acc_t* __restrict block, int64_t count, int64_t width, scalar_t* __restrict out,
                  int64_t stride) {
#if defined(__AVX512F__)
  if constexpr (kRegisterTranspose<W, scalar_t, acc_t>) {
    if (width == W && count == kPackCols) {
      for (int j0 = 0; j0 < W; j0 += 16) transpose16x16(block + j0, W, out + j0 * stride, stride);
      return;
    }
  }
#endif
  if (width == W && count == kPackCols) {
    for (int j = 0; j < W; ++j)
#pragma GCC unroll 16
      for (int i = 0; i < kPackCols; ++i) out[j * stride + i] = static_cast<scalar_t>(block[i * W + j]);
    return;
  }
  for (int64_t j = 0; j < width; ++j)
    for (int64_t i = 0; i < count; ++i) out[j * stride + i] = static_cast<scalar_t>(block[i * W + j]);
}

// With column_sums (n,) not null, also column_sums[i] = Σ_b a[b, i] (the bias gradient when a is
// dy), summed from the packed block while it is in L1.
template <int W, typename scalar_t, typename acc_t>
const acc_t* pack_tiles(const at::Tensor& a, Scratch& scratch, Scratch::Slot slot, scalar_t* column_sums = nullptr) {
  const int64_t B = a.size(0), n = a.size(1);
  const int64_t tiles = (B + W - 1) / W;
  const scalar_t* src = a.const_data_ptr<scalar_t>();
  acc_t* dst = scratch.get<acc_t>(slot, tiles * n * W);
  const int64_t blocks = (n + kPackCols - 1) / kPackCols;
  const int64_t grain = std::max<int64_t>(1, kSerialPack / std::max<int64_t>(1, B * kPackCols));
  at::parallel_for(0, blocks, grain, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t i0 = k * kPackCols, count = std::min(kPackCols, n - i0);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t b0 = t * W;
        pack_block<W>(src + b0 * n + i0, n, std::min<int64_t>(W, B - b0), count, dst + (t * n + i0) * W);
      }
      if (column_sums == nullptr) continue;
      for (int64_t i = 0; i < count; ++i) {
        acc_t sum = 0;  // the padding is zero, so whole tile rows can be summed
        for (int64_t t = 0; t < tiles; ++t) {
          const acc_t* row = dst + (t * n + i0 + i) * W;
          for (int j = 0; j < W; ++j) sum += row[j];
        }
        column_sums[i0 + i] = static_cast<scalar_t>(sum);
      }
    }
  });
  return dst;
}

// Accumulators as GCC/Clang vector types: written with these rather than left to the
// auto-vectoriser, which does not reliably keep 2-D accumulator arrays in registers. Loads may be
// unaligned (aligned(alignof(T))).
template <typename T, int L>
struct VecOf {
  typedef T type __attribute__((vector_size(L * sizeof(T)), aligned(alignof(T))));
};
template <typename T, int L>
using vec = typename VecOf<T, L>::type;
template <typename T>
using vec8 = vec<T, 8>;

// Lanes of the widest float vector this build targets: one AVX-512 register holds 16, AVX2 8.
#if defined(__AVX512F__)
constexpr int kVecLanes = 16;
#else
constexpr int kVecLanes = 8;
#endif

// Lanes per vector for a batch tile of width W: the widest vector that divides W (W is a multiple
// of 8), so a tile row is a whole number of registers.
template <int W>
constexpr int lanes_for() {
  return W % kVecLanes == 0 ? kVecLanes : 8;
}

// The vector type holding a W-wide tile row (W / lanes_for<W>() of them), or the scalar for W = 1.
// A specialisation rather than std::conditional_t, which would drop the typedef's alignment
// attribute and let the compiler emit aligned loads on unaligned tile rows.
template <typename T, int W>
struct TileVec {
  using type = vec<T, lanes_for<W>()>;
};
template <typename T>
struct TileVec<T, 1> {
  using type = T;
};

// Sum of the lanes of an 8- or 16-lane vector: log2(lanes) shuffle+add steps instead of scalar
// extracts and adds.
template <typename V>
inline auto lane_sum(V v) {
  if constexpr (sizeof(V) / sizeof(v[0]) == 16) {
    return lane_sum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  } else {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
  }
}

// How far ahead row_dot prefetches its value and column streams. The batch-1 forward streams
// them from L3; the hardware prefetcher alone left it at ~30 GB/s on two cores. 2 KiB ahead
// measured ~11% faster (0.35 -> 0.31 ms at 4096², 90%; 1 and 4 KiB gained less, 512 B nothing).
constexpr int64_t kStreamPrefetchBytes = 2048;

#if defined(__AVX512F__)
// Sixteen values from p (lanes outside m read as 0) as float32. A bfloat16 is the top half of a
// float32, so widening it is a shift; half converts in hardware (vcvtph2ps).
template <typename scalar_t>
inline __m512 load_as_float(__mmask16 m, const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
      return _mm512_cvtph_ps(raw);
    }
  }
}
#endif

#if defined(__AVX512F__)
// How the batch-1 kernels (row_dot, scatter_row_vector) reach the entries a row's columns pick
// (x, and spmm_t's accumulator): with AVX-512 gather and scatter instructions ("vector") or with
// scalar loads and stores ("scalar"). Both add the same products in the same lanes with the same
// fused multiply-adds, so their results are bit-identical; only the speed differs, by CPU. On the
// Intel Xeon the kernels were tuned on, the instructions won (row_dot ~1.5x, the fused backward
// 1.33x); AMD's Zen 4 runs them in microcode, and there scalar loads and stores measured faster
// (three shapes at 90-99%, 2 threads, interleaved, four runs: the forward in 0.68-0.99x the time,
// the fused backward in 0.34-1.01x; benchmarks/gather_mode.py). So the default is scalar on AMD, vector
// elsewhere; set_gather_mode (SNACK_CPU_GATHER, read by snack.backends.cpu.native) overrides it.
std::atomic<bool> g_scalar_gathers{[] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}()};

inline bool scalar_gathers() { return g_scalar_gathers.load(std::memory_order_relaxed); }

// x[col[i]] for the lanes i in m, 0 elsewhere: the gather instruction (the "vector" mode).
template <typename col_t>
inline __m512 gather16(__mmask16 m, const col_t* col, const float* x) {
  __m512i c;
  if constexpr (sizeof(col_t) == 2) {
    c = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, col));
  } else {
    c = _mm512_maskz_loadu_epi32(m, col);
  }
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, c, x, 4);
}

// row_dot in the "scalar" gather mode: the sums of row_dot's vector loop, lane by lane. Lane i
// adds the products of non-zeros begin + 16t + i by fused multiply-adds, as lane i of the vector
// accumulator does, and the lanes are summed by the same reduction, so the result is
// bit-identical. Each non-zero costs three scalar loads and one multiply-add in registers. The
// scalar mode first built a 16-lane vector of the loaded x entries for the vector loop, 15
// shuffles per 16 non-zeros more: this took 0.78-1.03x its time (median 0.92; spmv_u16 at six
// shapes, 90-99%, 1 and 2 threads, four interleaved runs, AMD Zen 4, 2026-12-02). Also tried:
// the loads stored to an array on the stack and read back as one vector, no faster than shuffles.
template <typename col_t, typename scalar_t>
float row_dot_by_lanes(int64_t begin, int64_t end, const col_t* col, const scalar_t* values, const float* x) {
  float lane[16] = {};
  int64_t k = begin;
  for (; k + 16 <= end; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(values + k) + kStreamPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(col + k) + kStreamPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) lane[i] = __builtin_fmaf(static_cast<float>(values[k + i]), x[col[k + i]], lane[i]);
  }
  // The last < 16: every lane is written, those past the end with + 0 (what the vector loop's
  // masked step adds), at constant indices, so that the lanes stay in registers. Writing only the
  // lanes before the end kept them in memory: 1.1-1.6x slower than the vector-building loop.
  const int64_t left = end - k;
  if (left > 0)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      lane[i] = i < left ? __builtin_fmaf(static_cast<float>(values[k + i]), x[col[k + i]], lane[i]) : lane[i] + 0.f;
  return _mm512_reduce_add_ps(_mm512_loadu_ps(lane));
}

// Rows with fewer non-zeros than this take short_row_dot: one masked 16-lane step would spend
// most of a row's time in the gather's and the 16-lane sum's latencies. A 768 -> 3072 layer at
// 99% (8 non-zeros per row) ran its batch-1 forward 2-2.5x faster so, in either gather mode (59-61
// -> 24-31 µs, AMD Zen 4); the other shapes and sparsities of benchmarks/gather_mode.py ran as
// before, within noise. (Scalar loops up to 48 non-zeros gained 13-20% more at 31-41 per row in
// the scalar gather mode there, when it still built vectors for the 16-lane loop, but were not
// measured against Intel's faster gathers, so 16 it is.)
constexpr int64_t kShortRow = 16;

// row_dot of a short row: two interleaved chains of fused multiply-adds, halving their latency.
template <typename col_t, typename scalar_t>
float short_row_dot(int64_t begin, int64_t end, const col_t* col, const scalar_t* values, const float* x) {
  // (the streams row_dot prefetches: one row's worth is at most a cache line)
  _mm_prefetch(reinterpret_cast<const char*>(values + begin) + kStreamPrefetchBytes, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(col + begin) + kStreamPrefetchBytes, _MM_HINT_T0);
  float even = 0.f, odd = 0.f;
  int64_t k = begin;
  for (; k + 2 <= end; k += 2) {
    even = __builtin_fmaf(static_cast<float>(values[k]), x[col[k]], even);
    odd = __builtin_fmaf(static_cast<float>(values[k + 1]), x[col[k + 1]], odd);
  }
  if (k < end) even = __builtin_fmaf(static_cast<float>(values[k]), x[col[k]], even);
  return even + odd;
}
#endif

// Σ_k values[k] · x[col[k]] over k in [begin, end): one row of a sparse matrix-vector product.
// col_t is int32 or uint16 (the 16-bit copy of the columns that spmv_u16 reads: 6 instead of 8
// bytes per non-zero). Sixteen (AVX-512) or eight (AVX2) non-zeros at a time: values load as one
// vector, the x entries are gathered into another (gather16: on Intel the gather instruction
// measured ~1.5x faster than scalar loads, and its rate, about one element per cycle, is what
// bounds this loop: it ran no faster on a weight that fits in L2 than on one in L3).
template <typename col_t, typename scalar_t, typename acc_t>
acc_t row_dot(int64_t begin, int64_t end, const col_t* col, const scalar_t* values, const acc_t* x) {
  int64_t k = begin;
  acc_t sum = 0;
  // 16-bit values (bfloat16, half) take the AVX-512 loop too: 4 bytes per non-zero with 16-bit
  // columns instead of 6, where the generic loop below converted them one by one (a bfloat16
  // layer ran 1.6x slower than a float32 one at batch 1).
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(__AVX512F__)
    if (end - begin < kShortRow) return short_row_dot(begin, end, col, values, x);
    if (scalar_gathers()) return row_dot_by_lanes(begin, end, col, values, x);
    __m512 a = _mm512_setzero_ps();
    for (; k < end; k += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(values + k) + kStreamPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(col + k) + kStreamPrefetchBytes, _MM_HINT_T0);
      // the row's last < 16 non-zeros through masked loads: one more iteration, not a scalar tail
      const __mmask16 m = end - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (end - k)) - 1);
      a = _mm512_fmadd_ps(load_as_float(m, values + k), gather16(m, col + k, x), a);
    }
    return _mm512_reduce_add_ps(a);
#elif defined(__AVX2__)
    if constexpr (std::is_same_v<scalar_t, float> && sizeof(col_t) == 4) {
      __m256 a = _mm256_setzero_ps();
      for (; k + 8 <= end; k += 8) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + k));
        a = _mm256_fmadd_ps(_mm256_loadu_ps(values + k), _mm256_i32gather_ps(x, c, 4), a);
      }
      sum = lane_sum(reinterpret_cast<vec8<float>&>(a));
    }
#endif
  }
  using V = vec8<acc_t>;
  V acc = {};
  for (; k + 8 <= end; k += 8) {
    V v, g;
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      v[u] = static_cast<acc_t>(values[k + u]);
      g[u] = x[col[k + u]];
    }
    acc += v * g;
  }
  for (; k < end; ++k) sum += static_cast<acc_t>(values[k]) * x[col[k]];
  return sum + lane_sum(acc);
}

// spmm for rows [r0, r1) of one batch tile: accumulates Σ_k values[k] · packed[col[k]] over the
// row's non-zeros into W accumulators, adds bias[r] (when bias is not null) and writes them to
// out[(b0 + j) · n_out + r] for the `width` real batch columns j of this tile.
//
// Tried and dropped (AMD Zen 4, 2 threads, interleaved, 2026-12-02): walking the columns in bands
// whose slice of a 64-wide tile stays in L1 (a cursor per row, each row's accumulators in memory
// between bands, the next rows' segments prefetched), so that a non-zero's gather hits L1 instead
// of L2. At 4096², 90% it took 0.75-0.93x this kernel's time at batch 64-256 and 0.92-1.07x at 95%;
// 1.2-3x longer without the prefetch or with 32-wide tiles. Each row's few non-zeros per band
// (about 13 at 90% in bands of 128 columns) pay a mispredicted loop exit, an accumulator round
// trip and a jump in the value and column streams; too little for a second forward kernel.
template <int W, typename scalar_t, typename acc_t>
void gather_rows(int64_t r0, int64_t r1, const index_t* rowptr, const index_t* col, const scalar_t* values,
                 const acc_t* packed, const scalar_t* bias, scalar_t* out, int64_t n_out, int64_t b0, int64_t width) {
  if constexpr (W == 1) {
    for (int64_t r = r0; r < r1; ++r) {
      const acc_t b = bias ? static_cast<acc_t>(bias[r]) : acc_t(0);
      out[r] = static_cast<scalar_t>(row_dot(rowptr[r], rowptr[r + 1], col, values, packed) + b);
    }
  } else {
    constexpr int L = lanes_for<W>();
    using V = vec<acc_t, L>;
    constexpr int NV = W / L;
    // U independent accumulator sets hide the FMA latency (U·NV >= 8 chains in flight).
    constexpr int U = std::max(1, 8 / NV);
    V block[kRowBlock][NV];  // results of rows [block_start, r], written out together
    int64_t block_start = r0;
    for (int64_t r = r0; r < r1; ++r) {
      V acc[U][NV] = {};
      const int64_t begin = rowptr[r], end = rowptr[r + 1];
      int64_t p = begin;
      for (; p + U <= end; p += U) {
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          const int64_t k = p + u;
          const acc_t v = static_cast<acc_t>(values[k]);
          const V* g = reinterpret_cast<const V*>(packed + static_cast<int64_t>(col[k]) * W);
#pragma GCC unroll 8
          for (int q = 0; q < NV; ++q) acc[u][q] += v * g[q];
        }
      }
      for (int64_t k = p; k < end; ++k) {
        const acc_t v = static_cast<acc_t>(values[k]);
        const V* g = reinterpret_cast<const V*>(packed + static_cast<int64_t>(col[k]) * W);
#pragma GCC unroll 8
        for (int q = 0; q < NV; ++q) acc[0][q] += v * g[q];
      }
#pragma GCC unroll 8
      for (int u = 1; u < U; ++u)
#pragma GCC unroll 8
        for (int q = 0; q < NV; ++q) acc[0][q] += acc[u][q];
      const acc_t b = bias ? static_cast<acc_t>(bias[r]) : acc_t(0);
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) block[r - block_start][q] = acc[0][q] + b;
      if (r + 1 - block_start == kRowBlock || r + 1 == r1) {
        unpack_block<W>(reinterpret_cast<const acc_t*>(block), r + 1 - block_start, width, out + b0 * n_out + block_start,
                        n_out);
        block_start = r + 1;
      }
    }
  }
}

// spmm_t for rows [r0, r1) of one batch tile: scatters values[k] · dyt[r] into buf[col[k]], a
// (in, W) accumulator private to the calling thread. dyt[r] stays in registers for the whole row;
// values and col stream sequentially. With kFused, also the sddmm of the same non-zeros,
// dval[k] (+)= dyt[r] · xt[col[k]], in the same pass (the fused backward of spmm).
//
// Tried and dropped: splitting the columns into blocks whose accumulator slices fit in L1 (rows
// then run in fragments, and the fragmented col/values/dval streams defeat the prefetcher):
// 1.6x slower at 90% sparsity, batch 32.
#if defined(__AVX512F__)
// Sixteen horizontal sums at once: lane i of the result is the sum of the 16 lanes of the vector
// the caller stored at p[transposed16(i)]. Four rounds of shuffles and adds (45 instructions)
// instead of 16 separate reductions (~9 each); sddmm computes one dot product per non-zero and
// spent most of its time reducing them.
constexpr int transposed16(int i) { return 4 * (i % 4) + i / 4; }

inline __m512 lane_sums16(const __m512* p) {
  __m512 a[8], b[4], c[2];
  // pairs of vectors -> both vectors' 8 partial sums in one (128-bit chunks: a.lo, a.hi, b.lo, b.hi)
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
  // -> four vectors' 4 partial sums each, one 128-bit chunk per vector
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  // -> 2 partial sums each, interleaved within chunks; then the last pairwise add
  for (int i = 0; i < 2; ++i) c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  const __m512d c0 = _mm512_castps_pd(c[0]), c1 = _mm512_castps_pd(c[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c0, c1)), _mm512_castpd_ps(_mm512_unpackhi_pd(c0, c1)));
}
#endif

#if defined(__AVX2__)
// Eight horizontal sums at once: lane i of the result is the sum of the 8 lanes of p[i]. Two
// rounds of pairwise adds and one add of the 128-bit halves (9 instructions) instead of 8 separate
// reductions (~7 each), for tile rows held in 8-lane vectors: AVX2 builds, and widths 8 and 24
// on AVX-512 (lanes_for).
inline __m256 lane_sums8(const __m256* p) {
  // [p0 01, p0 23, p1 01, p1 23 | p0 45, p0 67, p1 45, p1 67], and likewise for the other pairs
  const __m256 a0 = _mm256_hadd_ps(p[0], p[1]), a1 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 a2 = _mm256_hadd_ps(p[4], p[5]), a3 = _mm256_hadd_ps(p[6], p[7]);
  // [p0 0-3, p1 0-3, p2 0-3, p3 0-3 | p0 4-7, ..., p3 4-7], and the same for p4..p7
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// How many dot products of W-wide tile rows of acc_t store_dots reduces at once: 16 through
// lane_sums16 (16-lane vectors), 8 through lane_sums8 (8-lane vectors), or 1 (one at a time).
template <int W, typename acc_t>
constexpr int batched_dots() {
  if constexpr (!std::is_same_v<acc_t, float> || W == 1) {
    return 1;
  } else {
#if defined(__AVX512F__)
    if (lanes_for<W>() == 16) return 16;
#endif
#if defined(__AVX2__)
    if (lanes_for<W>() == 8) return 8;
#endif
    return 1;
  }
}

// out[k] (+)= the lane sum of dot(k) (a tile row's products, one vector; a scalar for W = 1) for k
// in [k, end): batched_dots of them at a time where it says more than one.
template <int W, typename acc_t, typename Dot>
inline void store_dots(int64_t k, int64_t end, const Dot& dot, acc_t* out, bool accumulate) {
#if defined(__AVX512F__)
  if constexpr (batched_dots<W, acc_t>() == 16) {
    for (; k + 16 <= end; k += 16) {
      __m512 prods[16];
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) prods[transposed16(u)] = reinterpret_cast<__m512>(dot(k + u));
      const __m512 sums = lane_sums16(prods);
      _mm512_storeu_ps(out + k, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out + k), sums) : sums);
    }
  }
#endif
#if defined(__AVX2__)
  if constexpr (batched_dots<W, acc_t>() == 8) {
    for (; k + 8 <= end; k += 8) {
      __m256 prods[8];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) prods[u] = reinterpret_cast<__m256>(dot(k + u));
      const __m256 sums = lane_sums8(prods);
      _mm256_storeu_ps(out + k, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out + k), sums) : sums);
    }
  }
#endif
  for (; k < end; ++k) {
    acc_t s;
    if constexpr (W == 1) s = dot(k); else s = lane_sum(dot(k));
    out[k] = accumulate ? out[k] + s : s;
  }
}

// Non-zeros ahead that scatter_rows prefetches for (measured: 8 beats 4 and 16). The same in
// gather_rows measured 1.3x slower: its loads are already independent and in flight.
constexpr int64_t kScatterPrefetch = 8;

#if defined(__AVX512F__)
// scatter_rows at batch 1 (float accumulation), sixteen non-zeros of a row at a time: buf[col]
// is gathered, incremented by values · dy[r] and scattered back; with kFused, dval = dy[r] · x[col]
// from a gather of x. A row's columns are distinct (every Topology the layers build is validated;
// the custom ops trust theirs, see the README's Limits), so the lanes of one scatter never
// collide. Against the scalar loop, interleaved at 90% sparsity on 2 threads: the fused backward
// 1.33x faster at 4096² (1.17 -> 0.89 ms), 1.40x at 768 -> 3072 (0.21 -> 0.15 ms).
template <bool kFused, typename scalar_t>
void scatter_row_vector(int64_t r0, int64_t r1, const index_t* rowptr, const index_t* col, const scalar_t* values,
                        const float* dy, float* buf, const float* x, float* dval, bool accumulate) {
  for (int64_t r = r0; r < r1; ++r) {
    const __m512 d = _mm512_set1_ps(dy[r]);
    const int64_t end = rowptr[r + 1];
    for (int64_t k = rowptr[r]; k < end; k += 16) {
      // the row's last < 16 non-zeros through masked loads, as in row_dot
      const __mmask16 m = end - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (end - k)) - 1);
      const __m512i c = _mm512_maskz_loadu_epi32(m, col + k);
      const __m512 old = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, c, buf, 4);
      _mm512_mask_i32scatter_ps(buf, m, c, _mm512_fmadd_ps(load_as_float(m, values + k), d, old), 4);
      if constexpr (kFused) {
        __m512 prod = _mm512_mul_ps(d, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, c, x, 4));
        if (accumulate) prod = _mm512_add_ps(prod, _mm512_maskz_loadu_ps(m, dval + k));
        _mm512_mask_storeu_ps(dval + k, m, prod);
      }
    }
  }
}

// scatter_row_vector with scalar loads and stores (the "scalar" gather mode, see
// g_scalar_gathers), one non-zero at a time with the same arithmetic: one fused multiply-add into
// buf, then dy[r] · x[col] (+ dval). (The generic loop of scatter_rows multiplies and adds apart, which rounds differently.)
template <bool kFused, typename scalar_t>
void scatter_row_scalar(int64_t r0, int64_t r1, const index_t* rowptr, const index_t* col, const scalar_t* values,
                        const float* dy, float* buf, const float* x, float* dval, bool accumulate) {
  for (int64_t r = r0; r < r1; ++r) {
    const float d = dy[r];
    for (int64_t k = rowptr[r]; k < rowptr[r + 1]; ++k) {
      const int64_t c = col[k];
      buf[c] = __builtin_fmaf(static_cast<float>(values[k]), d, buf[c]);
      if constexpr (kFused) {
        const float prod = d * x[c];
        dval[k] = accumulate ? prod + dval[k] : prod;
      }
    }
  }
}
#endif

// spmm_t's rows (the comment above), out of line: inlined into scatter_product's parallel loop, GCC
// kept the prefetch bound, the values pointer and a column offset on the stack, a store and two
// reloads per non-zero on the loop's address chain. Out of line they stay in registers: spmm_t took
// 0.80-0.87x the time at batch 8-128 (4096², 90%; AVX2 AMD EPYC, 2 threads, builds alternating,
// three runs each), and a training step of the layer at batch 32 ran 9.1-9.7x as fast as
// nn.Linear's, against 8.2-8.3x.
template <int W, bool kFused, typename scalar_t, typename acc_t>
__attribute__((noinline)) void scatter_rows(int64_t r0, int64_t r1, const index_t* rowptr, const index_t* col,
                                            const scalar_t* values, const acc_t* dyt, acc_t* buf, const acc_t* xt,
                                            acc_t* dval, bool accumulate) {
#if defined(__AVX512F__)
  if constexpr (W == 1 && std::is_same_v<acc_t, float>) {
    if (scalar_gathers()) {
      scatter_row_scalar<kFused>(r0, r1, rowptr, col, values, dyt, buf, xt, dval, accumulate);
    } else {
      scatter_row_vector<kFused>(r0, r1, rowptr, col, values, dyt, buf, xt, dval, accumulate);
    }
    return;
  }
#endif
  using V = typename TileVec<acc_t, W>::type;
  constexpr int NV = W == 1 ? 1 : W / lanes_for<W>();
  const int64_t last = rowptr[r1];
  for (int64_t r = r0; r < r1; ++r) {
    V d[NV];
#pragma GCC unroll 8
    for (int q = 0; q < NV; ++q) d[q] = reinterpret_cast<const V*>(dyt + r * W)[q];
    // one non-zero: the scatter, and with kFused its dot product (store_dots reduces it)
    auto visit = [&](int64_t k) {
      if constexpr (W > 1) {
        // the random accumulator and x rows of a later non-zero, from L2 (~10% faster fused)
        if (k + kScatterPrefetch < last) {
          const int64_t ahead = static_cast<int64_t>(col[k + kScatterPrefetch]) * W;
          for (int64_t line = 0; line < W; line += 64 / sizeof(acc_t)) {
            __builtin_prefetch(buf + ahead + line, 1);
            if constexpr (kFused) __builtin_prefetch(xt + ahead + line, 0);
          }
        }
      }
      const int64_t c = col[k];
      const acc_t v = static_cast<acc_t>(values[k]);
      V* o = reinterpret_cast<V*>(buf + c * W);
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) o[q] += v * d[q];
      V prod{};
      if constexpr (kFused) {
        const V* g = reinterpret_cast<const V*>(xt + c * W);
        prod = d[0] * g[0];
#pragma GCC unroll 8
        for (int q = 1; q < NV; ++q) prod += d[q] * g[q];
      }
      return prod;
    };
    if constexpr (kFused) {
      store_dots<W>(rowptr[r], rowptr[r + 1], visit, dval, accumulate);
    } else {
      for (int64_t k = rowptr[r]; k < rowptr[r + 1]; ++k) visit(k);
    }
  }
}

void check_common(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& rowptr,
                  const at::Tensor& col) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "snack_cpu.", op, ": tensors must be on the CPU");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous(), "snack_cpu.", op, ": dense input must be a contiguous 2-D tensor, got shape ",
              a.sizes());
  TORCH_CHECK(b.is_contiguous() && b.scalar_type() == a.scalar_type(), "snack_cpu.", op,
              ": second input must be contiguous with dtype ", a.scalar_type(), ", got ", b.scalar_type());
  for (const auto& t : {rowptr, col}) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() && t.scalar_type() == at::kInt, "snack_cpu.", op,
                ": rowptr and col must be contiguous 1-D int32 CPU tensors");
  }
  TORCH_CHECK(rowptr.numel() >= 1, "snack_cpu.", op, ": rowptr must have out_features + 1 >= 1 entries");
}

// The optional bias of spmm and spmv_u16: a contiguous (out,) tensor of x's dtype, or nullptr.
template <typename scalar_t>
const scalar_t* bias_pointer(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
}

void check_bias(const char* op, const std::optional<at::Tensor>& bias, const at::Tensor& x, int64_t n_out) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->numel() == n_out && bias->is_contiguous() &&
                  bias->scalar_type() == x.scalar_type(),
              "snack_cpu.", op, ": bias must be a contiguous (", n_out, ",) CPU tensor of dtype ", x.scalar_type(),
              ", got shape ", bias->sizes(), " and dtype ", bias->scalar_type());
}

// tile_width for spmm. On AVX-512 a 24-wide float tile runs in 8-lane vectors (lanes_for) with
// 96-byte rows that straddle cache lines; padded to 32 (two 512-bit vectors) the forward measured
// 8-15% faster at 4096², 90%, batch 20-48 (forced widths, interleaved in one process), so it pads.
// spmm_t and sddmm gained nothing from the padding and keep 24.
int forward_tile_width(int64_t B, int64_t n, int64_t elem_size) {
  const int W = tile_width(B, n, elem_size);
  return kVecLanes == 16 && elem_size == 4 && W == 24 ? 32 : W;
}

// y (B, out) = x (B, in) · Wᵀ (+ bias), parallel over rows of W.
at::Tensor spmm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& rowptr, const at::Tensor& col,
                const std::optional<at::Tensor>& bias) {
  check_common("spmm", x, values, rowptr, col);
  TORCH_CHECK(values.numel() == col.numel(), "snack_cpu.spmm: values and col must have the same length");
  check_bias("spmm", bias, x, rowptr.numel() - 1);
  const int64_t B = x.size(0), n_in = x.size(1), n_out = rowptr.numel() - 1, nnz = values.numel();
  at::Tensor out = at::empty({B, n_out}, x.options());
  if (B == 0 || n_out == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "snack_cpu_spmm", [&] {
    using acc_t = acc_type<scalar_t>;
    const int W = forward_tile_width(B, n_in, sizeof(acc_t));
    Scratch scratch;
    const index_t* rowptr_p = rowptr.const_data_ptr<index_t>();
    const index_t* col_p = col.const_data_ptr<index_t>();
    const scalar_t* val_p = values.const_data_ptr<scalar_t>();
    const scalar_t* bias_p = bias_pointer<scalar_t>(bias);
    scalar_t* out_p = out.mutable_data_ptr<scalar_t>();
    with_width(W, [&](auto w) {
      constexpr int kW = decltype(w)::value;
      const acc_t* packed = pack_tiles<kW, scalar_t, acc_t>(x, scratch, Scratch::kPackA);
      const int64_t tiles = (B + kW - 1) / kW;
      parallel_tiled_segments(rowptr_p, n_out, tiles, nnz * kW, [&](int64_t t, int64_t r0, int64_t r1) {
        const int64_t b0 = t * kW;
        gather_rows<kW>(r0, r1, rowptr_p, col_p, val_p, packed + t * n_in * kW, bias_p, out_p, n_out, b0,
                        std::min<int64_t>(kW, B - b0));
      });
    });
  });
  return out;
}

// y (1, out) = x (1, in) · Wᵀ (+ bias) with the columns as uint16 (in an int16 tensor,
// in_features <= 65536): the batch-1 forward, reading 6 instead of 8 bytes per non-zero (~13%
// faster). It runs at about one gathered x entry per cycle per core, as fast from L3 as from L2.
at::Tensor spmv_u16(const at::Tensor& x, const at::Tensor& values, const at::Tensor& rowptr, const at::Tensor& col16,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(0) == 1 && x.is_contiguous() && x.size(1) <= 65536,
              "snack_cpu.spmv_u16: x must be a contiguous (1, in) CPU tensor with in <= 65536, got ", x.sizes());
  TORCH_CHECK(values.device().is_cpu() && values.is_contiguous() && values.scalar_type() == x.scalar_type() &&
                  values.numel() == col16.numel(),
              "snack_cpu.spmv_u16: values must be a contiguous CPU tensor with x's dtype and one entry per column index");
  TORCH_CHECK(rowptr.device().is_cpu() && rowptr.dim() == 1 && rowptr.is_contiguous() &&
                  rowptr.scalar_type() == at::kInt && rowptr.numel() >= 1,
              "snack_cpu.spmv_u16: rowptr must be a contiguous 1-D int32 CPU tensor of out_features + 1 entries");
  TORCH_CHECK(col16.device().is_cpu() && col16.dim() == 1 && col16.is_contiguous() && col16.scalar_type() == at::kShort,
              "snack_cpu.spmv_u16: col16 must be a contiguous 1-D int16 CPU tensor");
  const int64_t n_out = rowptr.numel() - 1;
  check_bias("spmv_u16", bias, x, n_out);
  at::Tensor out = at::empty({1, n_out}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "snack_cpu_spmv_u16", [&] {
    using acc_t = acc_type<scalar_t>;
    Scratch scratch;
    const acc_t* packed = pack_tiles<1, scalar_t, acc_t>(x, scratch, Scratch::kPackA);
    const index_t* rowptr_p = rowptr.const_data_ptr<index_t>();
    const auto* col_p = reinterpret_cast<const uint16_t*>(col16.const_data_ptr<int16_t>());
    const scalar_t* val_p = values.const_data_ptr<scalar_t>();
    scalar_t* out_p = out.mutable_data_ptr<scalar_t>();
    const scalar_t* bias_p = bias_pointer<scalar_t>(bias);
    parallel_segments(rowptr_p, n_out, values.numel(), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const acc_t b = bias_p ? static_cast<acc_t>(bias_p[r]) : acc_t(0);
        out_p[r] = static_cast<scalar_t>(row_dot(rowptr_p[r], rowptr_p[r + 1], col_p, val_p, packed) + b);
      }
    });
  });
  return out;
}

// dx (B, in) = dy (B, out) · W, and with kFused also dvalues = sddmm(dy, x) in the same pass.
// Walking W by column (through csc_perm) reads values and row indices in random order, which
// measured ~10x slower than spmm on this machine. With the rows in column order cached (as the
// GPU backend does), reading only the values through csc_perm still took 1.9-2.2x this kernel's
// time at 4096², 90%, batch 8-128 (AMD Zen 4, 2026-12-02); values already in column order would
// make it 0.6-0.8x, but putting them so takes a gather per step (torch's indexing: 5.8 ms, three
// times this kernel at batch 32). Instead each thread walks a balanced range of rows
// sequentially and scatters into its own (in, W) accumulator, and the accumulators are summed at
// the end: no atomics, and the result does not depend on thread timing (only on the
// thread count, through the summation order). Tried and dropped: giving each thread a column
// range of every row and one shared accumulator (no sum) measured 2.4x slower at 99%, batch 32:
// both threads write dvalues of every row, and the lines where their ranges meet ping-pong.
// Also dropped: transposing values and rows to column order per call (a counting sort, each
// thread owning a column range) for a gather walk by column, dX in registers and dvalues back
// to row order. At 90%, batch 32 the transposition alone took 3.2 ms, as long as this whole
// backward: each of its stores goes to one of `in` column streams and misses L1.
// With bias_grad, also dbias (out,) = Σ_b dy[b, :], computed while packing dy (else an empty tensor).
template <bool kFused>
std::tuple<at::Tensor, at::Tensor, at::Tensor> scatter_product(const at::Tensor& dy, const at::Tensor& values,
                                                               const at::Tensor& rowptr, const at::Tensor& col,
                                                               int64_t in_features, const at::Tensor& x, bool bias_grad) {
  const int64_t B = dy.size(0), n_out = rowptr.numel() - 1, nnz = values.numel();
  at::Tensor dx = at::empty({B, in_features}, dy.options());
  at::Tensor dvalues = kFused ? at::empty({nnz}, dy.options()) : at::Tensor();
  at::Tensor dbias = at::empty({bias_grad ? n_out : 0}, dy.options());
  if (B == 0 || in_features == 0 || n_out == 0) {  // nothing to scatter (and no row to split)
    dx.zero_();
    if (kFused) dvalues.zero_();
    if (bias_grad) dbias = dy.sum(0);
    return {dx, dvalues, dbias};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dy.scalar_type(), "snack_cpu_spmm_t", [&] {
    using acc_t = acc_type<scalar_t>;
    // the (in, W) accumulator, and with kFused the (in, W) tile of x, should stay in L2
    const int W = tile_width(B, (kFused ? 2 : 1) * in_features, sizeof(acc_t));
    Scratch scratch;
    const index_t* rowptr_p = rowptr.const_data_ptr<index_t>();
    const index_t* col_p = col.const_data_ptr<index_t>();
    const scalar_t* val_p = values.const_data_ptr<scalar_t>();
    scalar_t* out_p = dx.mutable_data_ptr<scalar_t>();
    // dvalues accumulates across tiles in acc_t: straight into the output when it is acc_t
    acc_t* dval_p = nullptr;
    if constexpr (kFused) {
      dval_p = std::is_same_v<scalar_t, acc_t> ? reinterpret_cast<acc_t*>(dvalues.mutable_data_ptr<scalar_t>())
                                               : scratch.get<acc_t>(Scratch::kValues, nnz);
    }
    const int64_t tiles = (B + W - 1) / W;
    const bool serial = nnz * W < kSerialWork || at::get_num_threads() == 1 || n_out < 2;  // per tile: see above
    const auto bounds = balanced_bounds(rowptr_p, n_out, serial ? 1 : std::min<int64_t>(n_out, at::get_num_threads()));
    const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
    // Tiles per parallel region: all of them where their accumulators (parts · in · W each) fit
    // kRoundBytes, else one. A region per tile paid the pool's wake-up and barrier per tile (see
    // parallel_tiled_segments); all in one keeps every tile's accumulators, memory that only
    // small layers can spare.
    const int64_t tile_bytes = parts * in_features * W * static_cast<int64_t>(sizeof(acc_t));
    const int64_t per_round = tiles > 1 && tiles * tile_bytes <= kRoundBytes ? tiles : 1;
    acc_t* buf_p = scratch.get<acc_t>(Scratch::kAccumulator, per_round * parts * in_features * W);
    with_width(W, [&](auto w) {
      constexpr int kW = decltype(w)::value;
      scalar_t* dbias_p = bias_grad ? dbias.mutable_data_ptr<scalar_t>() : nullptr;
      const acc_t* packed = pack_tiles<kW, scalar_t, acc_t>(dy, scratch, Scratch::kPackA, dbias_p);
      const acc_t* xt = kFused ? pack_tiles<kW, scalar_t, acc_t>(x, scratch, Scratch::kPackB) : nullptr;
      // part p's accumulator for the i-th tile of a round
      const auto buffer = [&](int64_t p, int64_t i) { return buf_p + (p * per_round + i) * in_features * kW; };
      for (int64_t first = 0; first < tiles; first += per_round) {
        const int64_t round = std::min(per_round, tiles - first);
        // each part walks the round's tiles in order: dvalues of its rows accumulate in one thread
        at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
          for (int64_t p = p0; p < p1; ++p) {
            for (int64_t i = 0; i < round; ++i) {
              const int64_t t = first + i;
              acc_t* buf = buffer(p, i);
              std::fill(buf, buf + in_features * kW, acc_t(0));
              scatter_rows<kW, kFused>(bounds[p], bounds[p + 1], rowptr_p, col_p, val_p, packed + t * n_out * kW, buf,
                                       kFused ? xt + t * in_features * kW : nullptr, dval_p, t > 0);
            }
          }
        });
        // dx[b0 + j, c] = Σ_p buffers[p, c, j], always in the same order, a block of kPackCols
        // columns at a time (each batch row j gets one contiguous run, see kRowBlock); a
        // memory-bound pass, so on one thread unless large, like a pack
        const int64_t col_blocks = (in_features + kPackCols - 1) / kPackCols;
        const int64_t grain = std::max<int64_t>(1, kSerialPack / (parts * kW * kPackCols));
        at::parallel_for(0, round * col_blocks, grain, [&](int64_t q0, int64_t q1) {
          alignas(64) acc_t sum[kPackCols * kW];
          for (int64_t q = q0; q < q1; ++q) {
            const int64_t i = q / col_blocks, c0 = q % col_blocks * kPackCols;
            const int64_t count = std::min(kPackCols, in_features - c0), b0 = (first + i) * kW;
            std::copy(buffer(0, i) + c0 * kW, buffer(0, i) + (c0 + count) * kW, sum);
            for (int64_t p = 1; p < parts; ++p) {
              const acc_t* part = buffer(p, i) + c0 * kW;
              for (int64_t e = 0; e < count * kW; ++e) sum[e] += part[e];
            }
            unpack_block<kW>(sum, count, std::min<int64_t>(kW, B - b0), out_p + b0 * in_features + c0, in_features);
          }
        });
      }
    });
    if constexpr (kFused && !std::is_same_v<scalar_t, acc_t>) {
      scalar_t* dvalues_p = dvalues.mutable_data_ptr<scalar_t>();
      for (int64_t k = 0; k < nnz; ++k) dvalues_p[k] = static_cast<scalar_t>(dval_p[k]);
    }
  });
  return {dx, dvalues, dbias};
}

at::Tensor spmm_t(const at::Tensor& dy, const at::Tensor& values, const at::Tensor& rowptr, const at::Tensor& col,
                  int64_t in_features) {
  check_common("spmm_t", dy, values, rowptr, col);
  TORCH_CHECK(values.numel() == col.numel(), "snack_cpu.spmm_t: values and col must have the same length");
  TORCH_CHECK(in_features >= 0, "snack_cpu.spmm_t: in_features must be >= 0, got ", in_features);
  TORCH_CHECK(dy.size(1) == rowptr.numel() - 1, "snack_cpu.spmm_t: dy must have shape (B, ", rowptr.numel() - 1,
              "), got ", dy.sizes());
  return std::get<0>(scatter_product<false>(dy, values, rowptr, col, in_features, at::Tensor(), false));
}

// out[k] (+)= Σ_j dyt[row_k][j] · xt[col_k][j] over one tile, for rows [r0, r1).
template <int W, typename acc_t>
void sddmm_rows(int64_t r0, int64_t r1, const index_t* rowptr, const index_t* col, const acc_t* dyt, const acc_t* xt,
                acc_t* out, bool accumulate) {
  if constexpr (W == 1) {
    for (int64_t r = r0; r < r1; ++r) {
      const acc_t d = dyt[r];
      for (int64_t k = rowptr[r]; k < rowptr[r + 1]; ++k) {
        const acc_t s = d * xt[col[k]];
        out[k] = accumulate ? out[k] + s : s;
      }
    }
  } else {
    constexpr int L = lanes_for<W>();
    using V = vec<acc_t, L>;
    constexpr int NV = W / L;
    for (int64_t r = r0; r < r1; ++r) {
      V d[NV];
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) d[q] = reinterpret_cast<const V*>(dyt + r * W)[q];
      auto dot = [&](int64_t k) {
        const V* g = reinterpret_cast<const V*>(xt + static_cast<int64_t>(col[k]) * W);
        V prod = d[0] * g[0];
#pragma GCC unroll 8
        for (int q = 1; q < NV; ++q) prod += d[q] * g[q];
        return prod;
      };
      store_dots<W>(rowptr[r], rowptr[r + 1], dot, out, accumulate);
    }
  }
}

// dvalues (nnz,) = Σ_b dy[b, row_k] · x[b, col_k], parallel over rows.
at::Tensor sddmm(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rowptr, const at::Tensor& col) {
  check_common("sddmm", dy, x, rowptr, col);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "snack_cpu.sddmm: x must be a contiguous 2-D tensor");
  TORCH_CHECK(dy.size(0) == x.size(0), "snack_cpu.sddmm: dy and x must have the same batch size");
  TORCH_CHECK(dy.size(1) == rowptr.numel() - 1, "snack_cpu.sddmm: dy must have shape (B, ", rowptr.numel() - 1,
              "), got ", dy.sizes());
  const int64_t B = dy.size(0), n_out = rowptr.numel() - 1, nnz = col.numel();
  at::Tensor out = at::empty({nnz}, dy.options());
  if (nnz == 0) return out;
  if (B == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dy.scalar_type(), "snack_cpu_sddmm", [&] {
    using acc_t = acc_type<scalar_t>;
    const int W = tile_width(B, x.size(1), sizeof(acc_t));
    Scratch scratch;
    // accumulate across tiles in acc_t; write straight into `out` when it already is acc_t
    acc_t* acc_p = std::is_same_v<scalar_t, acc_t> ? reinterpret_cast<acc_t*>(out.mutable_data_ptr<scalar_t>())
                                                   : scratch.get<acc_t>(Scratch::kValues, nnz);
    const index_t* rowptr_p = rowptr.const_data_ptr<index_t>();
    const index_t* col_p = col.const_data_ptr<index_t>();
    with_width(W, [&](auto w) {
      constexpr int kW = decltype(w)::value;
      const acc_t* xt = pack_tiles<kW, scalar_t, acc_t>(x, scratch, Scratch::kPackA);
      const acc_t* dyt = pack_tiles<kW, scalar_t, acc_t>(dy, scratch, Scratch::kPackB);
      const int64_t tiles = (B + kW - 1) / kW;
      parallel_tiled_segments(rowptr_p, n_out, tiles, nnz * kW, [&](int64_t t, int64_t r0, int64_t r1) {
        sddmm_rows<kW>(r0, r1, rowptr_p, col_p, dyt + t * n_out * kW, xt + t * x.size(1) * kW, acc_p, t > 0);
      });
    });
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      scalar_t* out_p = out.mutable_data_ptr<scalar_t>();
      for (int64_t k = 0; k < nnz; ++k) out_p[k] = static_cast<scalar_t>(acc_p[k]);
    }
  });
  return out;
}

// Whether spmm_backward runs fused for a batch of B rows of in_features of dtype. Fused, dX and
// dvalues take one pass over W's indices and values per batch tile, against two (spmm_t's and
// sddmm's) apart; but fused keeps two (in, W) tiles in L2 (the dX accumulator and x) where each
// kernel alone keeps one, so where L2 is small it may need narrower tiles, hence more of them. It
// fuses when that still makes fewer passes; on a tie the two kernels' wider tiles won. Measured
// (benchmarks/backward_fusion.txt: 1 MiB of L2 per core, 2 threads, interleaved) at 4096² and
// 768×3072: batch 8 and 16, the same tiles either way, fused 1.1-1.3x faster; 24, 32, 64 and 128
// (fused: twice the tiles) mostly 0.6-0.9x the speed; 48 (16-wide tiles fused against 24-wide
// apart: 3 passes against 4) 1.2-1.5x, except at 4096², 90%: 0.74-0.78x. A layer with in = 768
// fuses at every batch up to 128 (1.0-1.5x).
bool fuses_backward(int64_t B, int64_t in_features, at::ScalarType dtype) {
  TORCH_CHECK(B >= 0 && in_features >= 0, "snack_cpu.fuses_backward: batch and in_features must be >= 0, got ", B,
              " and ", in_features);
  const int64_t elem_size = dtype == at::kDouble ? 8 : 4;  // sizeof(acc_type)
  const auto tiles = [B](int W) { return (B + W - 1) / W; };
  return tiles(tile_width(B, 2 * in_features, elem_size)) < 2 * tiles(tile_width(B, in_features, elem_size));
}

// The backward of y = x · Wᵀ (+ bias): (dx = dy · W, dvalues = sddmm(dy, x), dbias = Σ_b dy[b, :]
// if bias_grad, else an empty tensor), in one pass over W if `fuse`, by default where
// fuses_backward says so.
std::tuple<at::Tensor, at::Tensor, at::Tensor> spmm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                             const at::Tensor& values, const at::Tensor& rowptr,
                                                             const at::Tensor& col, bool bias_grad,
                                                             std::optional<bool> fuse) {
  check_common("spmm_backward", dy, values, rowptr, col);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dy.scalar_type() && x.device().is_cpu(),
              "snack_cpu.spmm_backward: x must be a contiguous 2-D CPU tensor with dy's dtype");
  TORCH_CHECK(values.numel() == col.numel(), "snack_cpu.spmm_backward: values and col must have the same length");
  TORCH_CHECK(dy.size(1) == rowptr.numel() - 1 && x.size(0) == dy.size(0), "snack_cpu.spmm_backward: dy must be (B, ",
              rowptr.numel() - 1, ") and x (B, in), got ", dy.sizes(), " and ", x.sizes());
  if (fuse.value_or(fuses_backward(dy.size(0), x.size(1), dy.scalar_type()))) {
    return scatter_product<true>(dy, values, rowptr, col, x.size(1), x, bias_grad);
  }
  auto [dx, unused, dbias] = scatter_product<false>(dy, values, rowptr, col, x.size(1), at::Tensor(), bias_grad);
  return {dx, sddmm(dy, x, rowptr, col), dbias};
}

// The batch-1 kernels' gather mode (see g_scalar_gathers): "vector" or "scalar", or "none" in
// builds without AVX-512, whose batch-1 kernels have one way.
std::string gather_mode() {
#if defined(__AVX512F__)
  return scalar_gathers() ? "scalar" : "vector";
#else
  return "none";
#endif
}

void set_gather_mode(const std::string& mode) {
#if defined(__AVX512F__)
  TORCH_CHECK(mode == "vector" || mode == "scalar", "snack_cpu.set_gather_mode: mode must be 'vector' or 'scalar', got '",
              mode, "'");
  g_scalar_gathers.store(mode == "scalar", std::memory_order_relaxed);
#else
  TORCH_CHECK(false, "snack_cpu.set_gather_mode: this build has no AVX-512 gathers to choose between (got '", mode, "')");
#endif
}

}  // namespace

TORCH_LIBRARY(snack_cpu, m) {
  m.def("spmm(Tensor x, Tensor values, Tensor rowptr, Tensor col, Tensor? bias=None) -> Tensor");
  m.def("spmv_u16(Tensor x, Tensor values, Tensor rowptr, Tensor col16, Tensor? bias=None) -> Tensor");
  m.def("spmm_t(Tensor dy, Tensor values, Tensor rowptr, Tensor col, int in_features) -> Tensor");
  m.def("sddmm(Tensor dy, Tensor x, Tensor rowptr, Tensor col) -> Tensor");
  m.def("spmm_backward(Tensor dy, Tensor x, Tensor values, Tensor rowptr, Tensor col, bool bias_grad=False, bool? fuse=None) -> (Tensor, Tensor, Tensor)");
  m.def("fuses_backward(int batch, int in_features, ScalarType dtype) -> bool", &fuses_backward);
  m.def("gather_mode() -> str", &gather_mode);
  m.def("set_gather_mode(str mode) -> ()", &set_gather_mode);
}

TORCH_LIBRARY_IMPL(snack_cpu, CPU, m) {
  m.impl("spmm", &spmm);
  m.impl("spmv_u16", &spmv_u16);
  m.impl("spmm_t", &spmm_t);
  m.impl("sddmm", &sddmm);
  m.impl("spmm_backward", &spmm_backward);
}
