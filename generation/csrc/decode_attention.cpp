// Decode attention on a CPU: one query token a row, each group of query heads over its key/value head, each key and
// value row read once for the whole group (generation/native_attention.py builds this file at first use and calls
// it; docs/evaluation.md, "A decode-attention kernel of our own on a CPU"). Softmax is online (a running max and sum
// a head, in float32) over blocks of BLOCK columns: a block's scores, then its weights, then the weighted values, so
// the block's keys and values are read from memory once and from L1 by every head of the group.
//
// Two paths compute a block: AVX512-BF16 (_mm512_dpbf16_ps for bfloat16 scores, AVX-512 FMAs elsewhere), compiled
// with a target attribute so that the file builds with any x86-64 compiler and chosen at run time where the CPU has
// it; and a generic one in plain C++ that any machine runs: slower than torch's SDPA, it serves the tests alone, so
// that every CI machine tests the kernel's logic (the Python side runs SDPA on a CPU without AVX512-BF16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DPO_X86 1
#define DPO_AVX512 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#endif

namespace {

constexpr int64_t BLOCK = 64;      // columns a block: its scores stay in L1 beside its keys and values
constexpr int64_t MAX_GROUP = 16;  // query heads a key/value head (the Python side checks these two)
constexpr int64_t MAX_DIM = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// One call's tensors: element pointers and element strides (the last dimension of each is contiguous). The keys
// and values are the cache's views [R, G, L, D], whose row stride spans the whole reserved cache, not L.
struct Problem {
  const void *query, *key, *value;  // [R, H, D], [R, G, L, D], [R, G, L, D]
  const bool* mask;                 // [R, L]
  void* out;                        // [R, H, D] contiguous
  int64_t groups, per_group, length, dim;
  int64_t q_row, q_head, k_row, k_group, k_col, v_row, v_group, v_col, m_row;
  float scale;
};

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16's bits are a float32's high half
  uint32_t bits = uint32_t(x) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}
inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) { *out = c10::BFloat16(x).x; }  // rounded to nearest even

// The plain C++ block: the AVX-512 one's logic, which any CPU runs (the tests).
template <typename T>
struct Generic {
  float query[MAX_GROUP * MAX_DIM];  // [per_group, dim]
  int64_t heads, dim;

  void load_query(const T* q, int64_t head_stride) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d) query[h * dim + d] = to_float(q[h * head_stride + d]);
  }
  // scores[h * BLOCK + i] = query h . key row i
  void scores(const T* key, int64_t col, int64_t n, float* scores) const {
    for (int64_t i = 0; i < n; ++i) {
      const T* k = key + i * col;
      for (int64_t h = 0; h < heads; ++h) {
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += query[h * dim + d] * to_float(k[d]);
        scores[h * BLOCK + i] = dot;
      }
    }
  }
  // weights[i] = exp(weights[i] - max) in place; their sum
  static float exp_sum(float* weights, int64_t n, float max) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (weights[i] = std::exp(weights[i] - max));
    return sum;
  }
  // acc[h * dim + d] += sum_i weights[h * BLOCK + i] * value row i [d]
  void accumulate(const T* value, int64_t col, int64_t n, const float* weights, float* acc) const {
    for (int64_t i = 0; i < n; ++i) {
      const T* v = value + i * col;
      for (int64_t h = 0; h < heads; ++h) {
        const float w = weights[h * BLOCK + i];
        for (int64_t d = 0; d < dim; ++d) acc[h * dim + d] += w * to_float(v[d]);
      }
    }
  }
};

#ifdef DPO_X86
DPO_AVX512 inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
DPO_AVX512 inline __m512 load16(const uint16_t* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp(x) for x <= 0 (a score minus its running max; -inf for a masked column): 2^n * e^r, r in [-ln2/2, ln2/2],
// e^r by its Taylor series to r^7 (relative error under 1e-8 there); zero below -87
// (about float32's smallest normal).
DPO_AVX512 inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  // ln 2 in two parts (Cephes'): the first has 9 bits, so n times it is exact and r is exact to float32
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})  // Horner's rule
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// The AVX-512 block (dim a multiple of 16): bfloat16 scores by _mm512_dpbf16_ps (exact products, float32 sums),
// float32 ones by FMAs; values weighted in float32.
template <typename T>
struct Avx512 {
  alignas(64) float query[MAX_GROUP * MAX_DIM];          // float32's
  alignas(64) uint16_t query_bf16[MAX_GROUP * MAX_DIM];  // bfloat16's, as _mm512_dpbf16_ps reads it
  int64_t heads, dim;

  DPO_AVX512 void load_query(const T* q, int64_t head_stride) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d) {
        if constexpr (std::is_same_v<T, uint16_t>)
          query_bf16[h * dim + d] = q[h * head_stride + d];
        else
          query[h * dim + d] = q[h * head_stride + d];
      }
  }
  DPO_AVX512 void scores(const T* key, int64_t col, int64_t n, float* scores) const {
    for (int64_t i = 0; i < n; ++i) {
      const T* k = key + i * col;
      for (int64_t h = 0; h < heads; ++h) {
        __m512 dot = _mm512_setzero_ps();
        if constexpr (std::is_same_v<T, uint16_t>) {
          const uint16_t* q = query_bf16 + h * dim;
          int64_t d = 0;
          for (; d + 32 <= dim; d += 32)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
          if (d < dim)  // the last 16 (dim a multiple of 16): zeros in the other pairs
            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, q + d),
                                   (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, k + d));
        } else {
          for (int64_t d = 0; d < dim; d += 16) dot = _mm512_fmadd_ps(load16(query + h * dim + d), load16(k + d), dot);
        }
        scores[h * BLOCK + i] = _mm512_reduce_add_ps(dot);
      }
    }
  }
  DPO_AVX512 static float exp_sum(float* weights, int64_t n, float max) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 in = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m512 w = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, weights + i), _mm512_set1_ps(max)));
      _mm512_mask_storeu_ps(weights + i, in, w);
      sum = _mm512_mask_add_ps(sum, in, sum, w);
    }
    return _mm512_reduce_add_ps(sum);
  }
  // Per 16 dims, up to 4 heads at a time: each value row's 16 converted once and weighted into each head's register
  // (the rows come from L1).
  template <int TILE>
  DPO_AVX512 void accumulate_tile(const T* value, int64_t col, int64_t n, const float* weights, float* acc) const {
    for (int64_t d = 0; d < dim; d += 16) {
      __m512 sums[TILE];
      for (int t = 0; t < TILE; ++t) sums[t] = _mm512_loadu_ps(acc + t * dim + d);
      for (int64_t i = 0; i < n; ++i) {
        const __m512 v = load16(value + i * col + d);
        for (int t = 0; t < TILE; ++t) sums[t] = _mm512_fmadd_ps(_mm512_set1_ps(weights[t * BLOCK + i]), v, sums[t]);
      }
      for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(acc + t * dim + d, sums[t]);
    }
  }
  DPO_AVX512 void accumulate(const T* value, int64_t col, int64_t n, const float* weights, float* acc) const {
    for (int64_t h = 0; h < heads; h += 4) {
      const float* w = weights + h * BLOCK;
      float* a = acc + h * dim;
      switch (std::min<int64_t>(4, heads - h)) {
        case 4: accumulate_tile<4>(value, col, n, w, a); break;
        case 3: accumulate_tile<3>(value, col, n, w, a); break;
        case 2: accumulate_tile<2>(value, col, n, w, a); break;
        default: accumulate_tile<1>(value, col, n, w, a);
      }
    }
  }
};
#endif

// One row's group: its heads' online softmax over the row's attended columns, block by block. A row with no
// attended column writes zeros.
template <typename T, typename Block>
void attend(const Problem& p, int64_t row, int64_t group) {
  Block block;
  block.heads = p.per_group;
  block.dim = p.dim;
  const int64_t heads = p.per_group, dim = p.dim;
  const bool* mask = p.mask + row * p.m_row;
  int64_t begin = 0, end = p.length;  // the first and past the last attended column: left padding skipped
  while (begin < end && !mask[begin]) ++begin;
  while (end > begin && !mask[end - 1]) --end;
  const T* key = static_cast<const T*>(p.key) + row * p.k_row + group * p.k_group;
  const T* value = static_cast<const T*>(p.value) + row * p.v_row + group * p.v_group;
  block.load_query(static_cast<const T*>(p.query) + row * p.q_row + group * heads * p.q_head, p.q_head);
  alignas(64) float scores[MAX_GROUP * BLOCK];
  alignas(64) float acc[MAX_GROUP * MAX_DIM];
  float max[MAX_GROUP], sum[MAX_GROUP];
  std::fill_n(acc, heads * dim, 0.f);
  std::fill_n(max, heads, NEG_INF);
  std::fill_n(sum, heads, 0.f);
  for (int64_t start = begin; start < end; start += BLOCK) {
    const int64_t n = std::min(BLOCK, end - start);
    block.scores(key + start * p.k_col, p.k_col, n, scores);
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + h * BLOCK;
      float block_max = NEG_INF;
      for (int64_t i = 0; i < n; ++i) {
        s[i] = mask[start + i] ? s[i] * p.scale : NEG_INF;
        block_max = std::max(block_max, s[i]);
      }
      // the first block holds the first attended column: max is finite from it on
      const float new_max = std::max(max[h], block_max);
      const float rescale = std::exp(max[h] - new_max);  // exp(-inf) = 0 before the first block
      for (int64_t d = 0; d < dim; ++d) acc[h * dim + d] *= rescale;
      sum[h] = sum[h] * rescale + Block::exp_sum(s, n, new_max);
      max[h] = new_max;
    }
    block.accumulate(value + start * p.v_col, p.v_col, n, scores, acc);
  }
  T* out = static_cast<T*>(p.out) + (row * p.groups + group) * heads * dim;  // [R, H, D]: the group's heads
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = sum[h] > 0.f ? 1.f / sum[h] : 0.f;
    for (int64_t d = 0; d < dim; ++d) store(acc[h * dim + d] * inverse, out + h * dim + d);
  }
}

bool avx512_bf16() {
#ifdef DPO_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

template <typename T, typename Block>
void attend_all(const Problem& p, int64_t rows) {
  at::parallel_for(0, rows * p.groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) attend<T, Block>(p, i / p.groups, i % p.groups);
  });
}

template <typename T>
void dispatch(const Problem& p, int64_t rows, bool generic) {
#ifdef DPO_X86
  if (!generic && p.dim % 16 == 0 && avx512_bf16()) return attend_all<T, Avx512<T>>(p, rows);
#endif
  attend_all<T, Generic<T>>(p, rows);
}

// [R, H, D] in query's dtype: query [R, H, D] over key and value [R, G, L, D] (H / G query heads a key/value head,
// in order), read where mask [R, L] (bool) is true, scores times `scale`. float32 or bfloat16, the last dimension of
// each contiguous; `generic` runs the plain C++ path where the CPU has the AVX512-BF16 one (the tests).
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                     double scale, bool generic) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.sizes() == key.sizes() && mask.dim() == 2,
              "decode attention: query [R, H, D], key and value [R, G, L, D], mask [R, L]");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t groups = key.size(1), length = key.size(2);
  TORCH_CHECK(key.size(0) == rows && key.size(3) == dim && mask.size(0) == rows && mask.size(1) == length,
              "decode attention: query, key, value and mask disagree on R, L or D");
  TORCH_CHECK(heads % groups == 0 && heads / groups <= MAX_GROUP && dim <= MAX_DIM,
              "decode attention: at most 16 query heads a key/value head and head_dim 256");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                  mask.scalar_type() == at::kBool,
              "decode attention: float32 or bfloat16 query, key and value of one dtype, a bool mask");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() && mask.device().is_cpu(),
              "decode attention: CPU tensors");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(3) == 1 && value.stride(3) == 1 && mask.stride(1) == 1,
              "decode attention: the last dimension of each input contiguous");
  at::Tensor out = at::empty({rows, heads, dim}, query.options());
  const Problem p{query.data_ptr(), key.data_ptr(), value.data_ptr(), mask.data_ptr<bool>(), out.data_ptr(),
                  groups, heads / groups, length, dim, query.stride(0), query.stride(1), key.stride(0),
                  key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2), mask.stride(0),
                  static_cast<float>(scale)};
  if (query.scalar_type() == at::kFloat)
    dispatch<float>(p, rows, generic);
  else
    dispatch<uint16_t>(p, rows, generic);
  return out;
}

}  // namespace

TORCH_LIBRARY(dpo_decode, m) {
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale, bool generic=False) -> Tensor",
        attention);
  m.def("avx512_bf16() -> bool", avx512_bf16);
}
