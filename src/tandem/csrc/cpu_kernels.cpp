// CPU (fp32) kernels of the native engine, each replacing a chain of small torch ops in a step:
//   decode_attention   one query token per sequence against its paged K/V, read in place
//   rms_norm           out = weight * x / sqrt(mean(x^2) + eps), per row
//   add_rms_norm_      residual += x, then rms_norm(residual)
//   rotary_write_kv    rotary embedding (HF rotate_half convention) on q in place and on k,
//                      k and v written into their KV-cache slots
//   silu_and_mul       silu(gate) * up
// and the weight handoff's byte checksums (weight_sync/slots.py):
//   copy_and_sum       dst's bytes := src's bytes in one pass, returning their word sum
//   sum_words          the same sum without the copy
// Built on first use by tandem/cpu_kernels.py; they parallelise with torch's
// own OpenMP threads (at::parallel_for), so torch.set_num_threads governs them too.
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// exp(x) for x <= 0, in a form the compiler vectorises: x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by its Taylor series to r^7 (truncation < 1e-8 relative), 2^n from exponent bits.
[[gnu::always_inline]] inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  // ln2 split so that n * hi is exact for |n| <= 127
  const float r = (clamped - n * 0.693145751953125f) - n * 1.4286068203094172e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * scale;
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_long(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be contiguous on the CPU");
}

// Softmax attention of `group` query rows q [group, DIM] (already scaled) over the first
// `length` tokens of one kv head's paged keys/values; scores: scratch [group, length];
// out [group, DIM]. Keys are read block by block (each block once for all rows), then values.
template <int64_t DIM>
void attend_rows(const float* q, int64_t group, const float* keys, const float* values,
                 const int64_t* table, int64_t length, int64_t block, float* scores, float* out) {
  for (int64_t t0 = 0; t0 < length; t0 += block) {
    const float* kb = keys + table[t0 / block] * block * DIM;
    const int64_t n = std::min(block, length - t0);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * DIM;
      float* sg = scores + g * length + t0;
      int64_t j = 0;
      // four keys at a time: four independent accumulator chains instead of one
      for (; j + 4 <= n; j += 4) {
        const float *k0 = kb + j * DIM, *k1 = k0 + DIM, *k2 = k1 + DIM, *k3 = k2 + DIM;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < DIM; ++d) {
          s0 += qg[d] * k0[d];
          s1 += qg[d] * k1[d];
          s2 += qg[d] * k2[d];
          s3 += qg[d] * k3[d];
        }
        sg[j] = s0;
        sg[j + 1] = s1;
        sg[j + 2] = s2;
        sg[j + 3] = s3;
      }
      for (; j < n; ++j) {
        const float* k = kb + j * DIM;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < DIM; ++d) s += qg[d] * k[d];
        sg[j] = s;
      }
    }
  }
  float inv[64];
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < length; ++t) top = std::max(top, row[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < length; ++t) {
      const float e = exp_nonpositive(row[t] - top);
      row[t] = e;
      sum += e;
    }
    inv[g] = 1.0f / sum;
  }
  std::fill(out, out + group * DIM, 0.0f);
  for (int64_t t0 = 0; t0 < length; t0 += block) {
    const float* vb = values + table[t0 / block] * block * DIM;
    const int64_t n = std::min(block, length - t0);
    for (int64_t g = 0; g < group; ++g) {
      const float* pg = scores + g * length + t0;
      float acc[DIM];
      std::copy(out + g * DIM, out + (g + 1) * DIM, acc);
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {  // four values per pass over acc
        const float *v0 = vb + j * DIM, *v1 = v0 + DIM, *v2 = v1 + DIM, *v3 = v2 + DIM;
        const float p0 = pg[j], p1 = pg[j + 1], p2 = pg[j + 2], p3 = pg[j + 3];
#pragma omp simd
        for (int64_t d = 0; d < DIM; ++d) {
          acc[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d]);
        }
      }
      for (; j < n; ++j) {
        const float p = pg[j];
        const float* v = vb + j * DIM;
#pragma omp simd
        for (int64_t d = 0; d < DIM; ++d) acc[d] += p * v[d];
      }
      std::copy(acc, acc + DIM, out + g * DIM);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < DIM; ++d) out[g * DIM + d] *= inv[g];
  }
}

// out, query [B, H, D]; key_cache, value_cache [KVH, num_blocks, block_size, D];
// block_tables [B, width] (rows padded with any valid block id); context_lens [B]: sequence b
// attends to its first context_lens[b] cached tokens. Query head h reads kv head h / (H / KVH).
// Work items are (kv head, sequence) pairs, kv-head-major: consecutive sequences of a thread
// that share prefix blocks (the n samples of a prompt) find those blocks in cache.
template <int64_t DIM>
void decode_attention_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, float scale) {
  const int64_t batch = query.size(0), heads = query.size(1);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block = key_cache.size(2), width = block_tables.size(1);
  const int64_t group = heads / kv_heads;
  const float* q_all = query.data_ptr<float>();
  const float* k_all = key_cache.data_ptr<float>();
  const float* v_all = value_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* o_all = out.data_ptr<float>();
  const int64_t head_stride = num_blocks * block * DIM;
  at::parallel_for(0, kv_heads * batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * DIM), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / batch, b = item % batch;
      const float* q_src = q_all + (b * heads + kvh * group) * DIM;
      for (int64_t i = 0; i < group * DIM; ++i) q[i] = q_src[i] * scale;
      scores.resize(group * lens[b]);
      attend_rows<DIM>(q.data(), group, k_all + kvh * head_stride, v_all + kvh * head_stride,
                       tables + b * width, lens[b], block, scores.data(),
                       o_all + (b * heads + kvh * group) * DIM);
    }
  });
}

void decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, double scale) {
  check_float(out, "out");
  check_float(query, "query");
  check_float(key_cache, "key_cache");
  check_float(value_cache, "value_cache");
  check_long(block_tables, "block_tables");
  check_long(context_lens, "context_lens");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D], caches [KVH, N, S, D]");
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have query's shape");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "key and value caches differ in shape");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_blocks = key_cache.size(1);
  const int64_t block = key_cache.size(2), width = block_tables.size(1);
  TORCH_CHECK(kv_heads > 0 && heads > 0, "empty head dimension");
  TORCH_CHECK(key_cache.size(3) == dim && heads % kv_heads == 0 && heads / kv_heads <= 64,
              "head shapes do not match (at most 64 query heads per kv head)");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch,
              "block_tables and context_lens need one row per sequence");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * block, "context_lens[", b, "] = ", lens[b],
                " outside [1, ", width * block, "]");
    for (int64_t i = 0; i < (lens[b] + block - 1) / block; ++i) {
      const int64_t id = tables[b * width + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " outside the cache");
    }
  }
  const float fscale = static_cast<float>(scale);
  switch (dim) {
#define TANDEM_DECODE_DIM(D)                                                                 \
  case D:                                                                                   \
    return decode_attention_dim<D>(out, query, key_cache, value_cache, block_tables,        \
                                   context_lens, fscale);
    TANDEM_DECODE_DIM(16)
    TANDEM_DECODE_DIM(32)
    TANDEM_DECODE_DIM(64)
    TANDEM_DECODE_DIM(80)
    TANDEM_DECODE_DIM(96)
    TANDEM_DECODE_DIM(128)
    TANDEM_DECODE_DIM(256)
#undef TANDEM_DECODE_DIM
    default:
      TORCH_CHECK(false, "decode_attention: head_dim ", dim,
                  " is not compiled (16, 32, 64, 80, 96, 128, 256)");
  }
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_float(x, "x");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "x [T, H] and weight [H] expected");
}

// Row-wise work is split across threads only in pieces of >= 16k elements: below that the
// threads' start-up costs more than the work.
inline int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 16384 / width); }

// rms_norm of each row of x [T, H] into a new tensor; with `add` [T, H], x += add first (x is
// then the residual stream, updated in place).
at::Tensor norm_rows(const at::Tensor& x, const float* add, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t width = x.size(1);
  float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, x.size(0), rows_per_task(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = xs + r * width;
      if (add != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) row[i] += add[r * width + i];
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(width) + epsilon);
      float* o = os + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) o[i] = w[i] * (row[i] * inv);
    }
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_rows(x, nullptr, weight, eps);
}

at::Tensor add_rms_norm_(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight,
                         double eps) {
  check_float(x, "x");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x must have residual's shape");
  return norm_rows(residual, x.data_ptr<float>(), weight, eps);
}

// x [D] -> x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2])
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  float first[512];
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    first[i] = x[i] * c[i] - x[i + half] * s[i];
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
  }
  std::memcpy(out, first, half * sizeof(float));
}

// query [T, H, D] rotated in place; key, value [T, KVH, D]; cos, sin [max_len, D];
// positions, slots [T]; caches [KVH, num_blocks, block_size, D], slot = block * size + offset.
void rotary_write_kv(at::Tensor query, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                     const at::Tensor& slots, at::Tensor key_cache, at::Tensor value_cache) {
  check_float(query, "query");
  check_float(key, "key");
  check_float(value, "value");
  check_float(cos, "cos");
  check_float(sin, "sin");
  check_float(key_cache, "key_cache");
  check_float(value_cache, "value_cache");
  check_long(positions, "positions");
  check_long(slots, "slots");
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key.size(1), max_len = cos.size(0);
  const int64_t cache_slots = key_cache.size(1) * key_cache.size(2);
  TORCH_CHECK(dim <= 1024 && dim % 2 == 0 && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "rotary tables must be [max_len, head_dim] with an even head_dim <= 1024");
  TORCH_CHECK(key.size(0) == tokens && value.sizes() == key.sizes() && key.size(2) == dim &&
                  key_cache.size(0) == kv_heads && key_cache.size(3) == dim &&
                  value_cache.sizes() == key_cache.sizes(),
              "query/key/value/cache shapes do not match");
  TORCH_CHECK(positions.size(0) == tokens && slots.size(0) == tokens, "one position and slot per token");
  float* q = query.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_len, "position ", pos[t], " outside the rotary table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < cache_slots, "slot ", slot[t], " outside the cache");
  }
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * dim;
      const float* s = sn + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = q + (t * heads + h) * dim;
        rotate(x, c, s, x, dim);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t src = (t * kv_heads + h) * dim, dst = (h * cache_slots + slot[t]) * dim;
        rotate(k + src, c, s, kc + dst, dim);
        std::memcpy(vc + dst, v + src, dim * sizeof(float));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float(gate, "gate");
  check_float(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up differ in shape");
  at::Tensor out = at::empty_like(gate);
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 16384, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      // silu(x) = x / (1 + e^-x); with e = exp(-|x|) <= 1 no overflow either way
      const float x = g[i], e = exp_nonpositive(-std::fabs(x));
      const float sigmoid = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
      o[i] = x * sigmoid * u[i];
    }
  });
  return out;
}

// The weight handoff's checksum: the bytes read as little-endian 64-bit words (the last one
// zero-padded), summed with wraparound. Integer addition is associative, so pieces may be summed
// on any thread in any order. A piece is whole words and a multiple of 64 bytes but the last.
constexpr int64_t kPieceBytes = 1 << 20;
constexpr int64_t kStreamBytes = 1 << 18;  // below this a copy stays in cache (plain stores)

// Sums n bytes of s as words and, when COPY, copies them to d on the way. With AVX2 and a
// 32-byte aligned destination (slot entries are 64-byte aligned) a copy's stores bypass the
// cache: the destination is not read for ownership first, which saves a third of the memory
// traffic of a large copy.
template <bool COPY>
uint64_t sum_piece(uint8_t* d, const uint8_t* s, int64_t n, bool stream) {
  uint64_t total = 0;
  int64_t i = 0;
#if defined(__AVX2__)
  if (COPY && stream) {
    __m256i acc = _mm256_setzero_si256();
    for (; i + 128 <= n; i += 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
      acc = _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, e)));
    }
    _mm_sfence();  // the streamed stores are visible before anyone is told of them
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
#else
  (void)stream;
#endif
  const int64_t words_end = n / 8 * 8;
#pragma omp simd reduction(+ : total)
  for (int64_t j = i; j < words_end; j += 8) {
    uint64_t word;
    std::memcpy(&word, s + j, 8);
    if constexpr (COPY) std::memcpy(d + j, &word, 8);
    total += word;
  }
  if (words_end < n) {
    uint64_t word = 0;
    std::memcpy(&word, s + words_end, n - words_end);  // x86-64 and aarch64 Linux are little-endian
    if constexpr (COPY) std::memcpy(d + words_end, s + words_end, n - words_end);
    total += word;
  }
  return total;
}

// Runs piece(offset, bytes) over [0, n) in kPieceBytes pieces on torch's threads; sums the results.
template <typename Piece>
int64_t sum_over_pieces(int64_t n, const Piece& piece) {
  const int64_t pieces = (n + kPieceBytes - 1) / kPieceBytes;
  std::vector<uint64_t> partial(std::max<int64_t>(pieces, 1), 0);
  at::parallel_for(0, pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t offset = p * kPieceBytes;
      partial[p] = piece(offset, std::min(kPieceBytes, n - offset));
    }
  });
  uint64_t total = 0;
  for (const uint64_t value : partial) total += value;
  return static_cast<int64_t>(total);  // two's complement: the same bits as the wrapped sum
}

void check_bytes(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

int64_t copy_and_sum(const at::Tensor& dst, const at::Tensor& src) {
  check_bytes(dst, "dst");
  check_bytes(src, "src");
  TORCH_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(),
              "copy_and_sum copies bytes: dst and src need the same dtype and size");
  const int64_t n = src.numel() * src.element_size();
  uint8_t* d = static_cast<uint8_t*>(dst.data_ptr());
  const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
  const bool stream = n >= kStreamBytes && reinterpret_cast<uintptr_t>(d) % 32 == 0;
  return sum_over_pieces(n, [&](int64_t offset, int64_t bytes) {
    return sum_piece<true>(d + offset, s + offset, bytes, stream);
  });
}

int64_t sum_words(const at::Tensor& src) {
  check_bytes(src, "src");
  const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
  return sum_over_pieces(src.numel() * src.element_size(), [&](int64_t offset, int64_t bytes) {
    return sum_piece<false>(nullptr, s + offset, bytes, false);
  });
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_write_kv(Tensor(a!) query, Tensor key, Tensor value, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor slots, Tensor(b!) key_cache, Tensor(c!) value_cache) -> ()");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("copy_and_sum(Tensor(a!) dst, Tensor src) -> int");
  m.def("sum_words(Tensor src) -> int");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("copy_and_sum", &copy_and_sum);
  m.impl("sum_words", &sum_words);
}
