// The coded score (oasiskv_runtime/ops/key_codes.py, variant "cuda") for the product's shape: keys coded in 2 bits,
// blocks of 16 keys, head dim 64 or 128, bf16 / fp16 queries and min/max summaries, up to 8 query columns a KV head
// (a decode step's query heads of the GQA group, and its draft's).
//
// For each request b, KV head h and candidate block j: the largest q . k^ over the block's 16 coded keys and the
// query columns of each query set s, where k^ = round_to_T(lo + level * step) with lo / hi the block's min/max row,
// step = (hi - lo) * (1/3), in fp32 and unfused, as coded_scores_ref(..., key_dtype=T) computes it.
//
// One warp a candidate, its 16 keys the rows of m16n8k16 tensor-core products (fp32 accumulate), the query columns
// their 8 columns. The dimensions of a 16-wide slice of D are assigned to the fragment's K index in the order that
// lets each thread decode its fragment from the code words it loads itself: thread (g = lane / 4, t = lane % 4)
// holds keys g and g + 8 and the D / 4 dimensions [t * D / 4, (t + 1) * D / 4), slice c's K indices 2t, 2t + 1,
// 2t + 8, 2t + 9 being its dimensions 4c .. 4c + 3. The queries' fragment follows the same order (loaded once).
//
// A level is decoded in one LOP3 and one FFMA, without a shift or an int -> float conversion: with the 2 bits at
// position p of a 16-bit half-word (p < 8), (word & (3 << 2p)) | 0x4B000000 is the fp32 f = 2^23 + level * 4^p, and
// fma(f, step * 4^-p, -2^23 * step * 4^-p) is the exact level * step rounded once, the reference's product (both
// constants exact: powers of two times step, computed once a candidate; a step below ~1e-34 would lose bits to
// subnormals). The block's min row and the two constants go through shared memory once a candidate.
//
// Built by oasiskv_runtime/ops/common.build_csrc with plain nvcc into a shared library, called through ctypes.
// Strides are in elements. Returns a cudaError_t (0: launched).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {

constexpr int kWarps = 4;         // warps a thread block
constexpr int kPerWarp = 4;       // candidates a warp, in a row
constexpr int kBlockSize = 16;    // keys a block: the product's 16 rows

// One m16n8k16 product, fp32 accumulate, on 16-bit operands of PTX type TY ("bf16" / "f16").
#define OASIS_MMA_16816(TY, c, a, b0, b1)                                                                     \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
               "{%0,%1,%2,%3};\n"                                                                             \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// The 16-bit type's conversions and product: T is __nv_bfloat16 or __half.
template <typename T>
struct Mma {
  static constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  __device__ static uint32_t pack(float lo, float hi) {  // lo in the low half, as the fragments order them
    uint32_t r;
    if constexpr (kBf16) {
      __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      r = *reinterpret_cast<uint32_t*>(&v);
    } else {
      __half2 v = __floats2half2_rn(lo, hi);
      r = *reinterpret_cast<uint32_t*>(&v);
    }
    return r;
  }
  __device__ static float to_float(T v) {
    if constexpr (kBf16) return __bfloat162float(v); else return __half2float(v);
  }
  __device__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kBf16) OASIS_MMA_16816("bf16", c, a, b0, b1); else OASIS_MMA_16816("f16", c, a, b0, b1);
  }
};

__device__ __forceinline__ int64_t table_at(const void* tab, bool wide, int64_t i) {
  return wide ? static_cast<const int64_t*>(tab)[i] : static_cast<const int32_t*>(tab)[i];
}

struct Args {
  const void* q; const uint8_t* codes; const void* smin; const void* smax;
  const void* ctab; const void* stab; const int32_t* ncand; float* out;
  int64_t s_qb, s_qs, s_qh;            // queries [B, S, Hq, D]
  int64_t s_cr, s_ct, s_ch;            // codes [rows, 16, Hkv, D / 4] (bytes)
  int64_t s_mb, s_mt, s_mh;            // min summaries [pages, rows, Hkv, D]
  int64_t s_xb, s_xt, s_xh;            // max summaries
  int64_t s_cb, s_sb;                  // code / summary block tables' request stride
  int64_t s_ns, s_os, s_ob, s_oh;      // candidates [S, B]; scores [S, B, Hkv, J]
  int hkv, g, gp, sets, n_cols, n_pages, n_code_cols, ctab_wide, stab_wide;
};

// D: head dim (64 or 128). Each thread holds D / 4 dimensions of two keys: D / 16 bytes of each, D / 64 words.
template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32) coded_scores_kernel(Args a) {
  constexpr int kDims = D / 4;        // a thread's dimensions
  constexpr int kWords = D / 64;      // its 32-bit code words a key
  constexpr int kSlices = D / 16;     // products over D
  constexpr int kPad = D + D / kDims * 4;  // shared row: 4 floats of padding after each thread's run (no conflicts)
  __shared__ float4 smem[kWarps][3][kPad / 4];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int64_t b = blockIdx.x / a.hkv;
  const int h = blockIdx.x % a.hkv;

  // the queries' fragment, column gid: set gid / gp, query head h * g + gid % gp (zero where no such column)
  uint32_t qf[kSlices][2];
  {
    const int s = gid / a.gp, gi = gid % a.gp;
    const bool real = s < a.sets && gi < a.g;
    const T* qrow = static_cast<const T*>(a.q) + b * a.s_qb + s * a.s_qs + (int64_t)(h * a.g + gi) * a.s_qh
                    + tig * kDims;
#pragma unroll
    for (int c = 0; c < kSlices; ++c) {
      if (real) {
        const uint2 v = *reinterpret_cast<const uint2*>(qrow + 4 * c);
        qf[c][0] = v.x;
        qf[c][1] = v.y;
      } else {
        qf[c][0] = qf[c][1] = 0u;
      }
    }
  }
  int ncmax = 0;
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (s < a.sets) ncmax = max(ncmax, a.ncand[s * a.s_ns + b]);

  const int j0 = (blockIdx.y * kWarps + warp) * kPerWarp;
  float* lo_s = reinterpret_cast<float*>(smem[warp][0]);
  float* st_s = reinterpret_cast<float*>(smem[warp][1]);
  float* of_s = reinterpret_cast<float*>(smem[warp][2]);
  // the level's bit pattern's exponent, in a register (an immediate would take a second LOP3 a level)
  uint32_t magic;
  asm volatile("mov.b32 %0, 0x4B000000;" : "=r"(magic));
  // every candidate's loads first (its table entries, then its min/max and codes), so they are in flight together
  constexpr int kLane = D / 32;  // lane L converts dimensions kLane * L .. kLane * (L + 1) - 1 of the min/max rows
  using Lane = typename std::conditional<kLane == 4, uint2, uint32_t>::type;
  using Words = typename std::conditional<kWords == 2, uint2, uint32_t>::type;
  bool ok[kPerWarp];
  Lane lraw[kPerWarp], hraw[kPerWarp];
  Words wraw[kPerWarp][2];
#pragma unroll
  for (int k = 0; k < kPerWarp; ++k) {
    const int j = j0 + k;
    ok[k] = j < a.n_cols && j < ncmax && j < a.n_code_cols;
    const int pg = j / kBlockSize;
    const int64_t page = ok[k] && pg < a.n_pages ? table_at(a.stab, a.stab_wide, b * a.s_sb + pg) : 0;
    const int64_t crow = ok[k] ? table_at(a.ctab, a.ctab_wide, b * a.s_cb + j) : 0;
    ok[k] = ok[k] && page >= 0 && crow >= 0;  // warp-uniform
    if (ok[k]) {
      const int row = j % kBlockSize;
      lraw[k] = *reinterpret_cast<const Lane*>(static_cast<const T*>(a.smin) + page * a.s_mb + row * a.s_mt
                                                + (int64_t)h * a.s_mh + lane * kLane);
      hraw[k] = *reinterpret_cast<const Lane*>(static_cast<const T*>(a.smax) + page * a.s_xb + row * a.s_xt
                                                + (int64_t)h * a.s_xh + lane * kLane);
#pragma unroll
      for (int r = 0; r < 2; ++r)  // keys gid and gid + 8: this thread's D / 16 bytes of each
        wraw[k][r] = *reinterpret_cast<const Words*>(a.codes + crow * a.s_cr + (int64_t)(gid + 8 * r) * a.s_ct
                                                     + (int64_t)h * a.s_ch + tig * (D / 16));
    }
  }
#pragma unroll
  for (int k = 0; k < kPerWarp; ++k) {
    const int j = j0 + k;
    if (j >= a.n_cols) break;  // warp-uniform
    float best[2] = {-INFINITY, -INFINITY};  // per query set (at most 2 sets of 4 columns, or 1 of up to 8)
    if (ok[k]) {  // warp-uniform
      // the block's min row and scaled steps through shared memory
      const T* lv = reinterpret_cast<const T*>(&lraw[k]);
      const T* hv = reinterpret_cast<const T*>(&hraw[k]);
      float los[kLane], sts[kLane], ofs[kLane];
#pragma unroll
      for (int i = 0; i < kLane; ++i) {
        const int p = (lane * kLane + i) % kDims % 8;  // the level's position in its 16-bit half-word
        los[i] = Mma<T>::to_float(lv[i]);
        const float step = __fmul_rn(__fsub_rn(Mma<T>::to_float(hv[i]), los[i]), 1.0f / 3.0f);  // as level_step
        sts[i] = step * __int_as_float((127 - 2 * p) << 23);  // * 4^-p, exact
        ofs[i] = -8388608.0f * sts[i];                         // - 2^23 * 4^-p * step, exact
      }
      const int at = lane * kLane + (lane * kLane / kDims) * 4;
      __syncwarp();  // the previous candidate's reads of the shared rows are done
      if constexpr (kLane == 4) {
        *reinterpret_cast<float4*>(lo_s + at) = make_float4(los[0], los[1], los[2], los[3]);
        *reinterpret_cast<float4*>(st_s + at) = make_float4(sts[0], sts[1], sts[2], sts[3]);
        *reinterpret_cast<float4*>(of_s + at) = make_float4(ofs[0], ofs[1], ofs[2], ofs[3]);
      } else {
        *reinterpret_cast<float2*>(lo_s + at) = make_float2(los[0], los[1]);
        *reinterpret_cast<float2*>(st_s + at) = make_float2(sts[0], sts[1]);
        *reinterpret_cast<float2*>(of_s + at) = make_float2(ofs[0], ofs[1]);
      }
      __syncwarp();
      uint32_t w[2][kWords];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (kWords == 2) {
          w[r][0] = reinterpret_cast<const uint2&>(wraw[k][r]).x;
          w[r][1] = reinterpret_cast<const uint2&>(wraw[k][r]).y;
        } else {
          w[r][0] = reinterpret_cast<const uint32_t&>(wraw[k][r]);
        }
      }
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      const int base = tig * (kDims + 4);
#pragma unroll
      for (int c = 0; c < kSlices; ++c) {
        const float4 lo4 = *reinterpret_cast<const float4*>(lo_s + base + 4 * c);
        const float4 st4 = *reinterpret_cast<const float4*>(st_s + base + 4 * c);
        const float4 of4 = *reinterpret_cast<const float4*>(of_s + base + 4 * c);
        const float lo_c[4] = {lo4.x, lo4.y, lo4.z, lo4.w};
        const float st_c[4] = {st4.x, st4.y, st4.z, st4.w};
        const float of_c[4] = {of4.x, of4.y, of4.z, of4.w};
        uint32_t frag[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t word = w[r][(4 * c) / 16];
          const int pos = (4 * c) % 16;          // dims 4c .. 4c + 3 at positions pos .. pos + 3 of the word
          const uint32_t half = pos >= 8 ? word >> 16 : word;
          float key[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int p = (pos + i) % 8;
            uint32_t bits;  // (half & (3 << 2p)) | magic: the fp32 2^23 + level * 4^p
            asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(bits) : "r"(half), "r"(3u << (2 * p)), "r"(magic));
            // (2^23 + level * 4^p) * step_p - 2^23 * step_p = level * step, rounded once as the reference's product
            key[i] = __fadd_rn(lo_c[i], __fmaf_rn(__uint_as_float(bits), st_c[i], of_c[i]));
          }
          frag[r] = Mma<T>::pack(key[0], key[1]);       // a0 / a1: K indices 2t, 2t + 1 of keys gid / gid + 8
          frag[2 + r] = Mma<T>::pack(key[2], key[3]);   // a2 / a3: K indices 2t + 8, 2t + 9
        }
        Mma<T>::run(acc, frag, qf[c][0], qf[c][1]);
      }
      // acc: keys gid (0, 1) and gid + 8 (2, 3) at columns 2 tig, 2 tig + 1
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 2 * tig + e;
        const int s = col / a.gp;
        if (s < a.sets && col % a.gp < a.g) {
          const float v = fmaxf(acc[e], acc[2 + e]);
          if (s == 0) best[0] = fmaxf(best[0], v); else best[1] = fmaxf(best[1], v);
        }
      }
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) best[s] = fmaxf(best[s], __shfl_xor_sync(0xffffffffu, best[s], o));
    }
    if (lane < a.sets) {
      const float v = lane == 0 ? best[0] : best[1];
      const bool mine = ok[k] && j < a.ncand[lane * a.s_ns + b];
      a.out[lane * a.s_os + b * a.s_ob + (int64_t)h * a.s_oh + j] = mine ? v : -INFINITY;
    }
  }
}

template <typename T, int D>
cudaError_t launch(const Args& a, int batch, cudaStream_t stream) {
  const int per_block = kWarps * kPerWarp;
  dim3 grid(batch * a.hkv, (a.n_cols + per_block - 1) / per_block);
  coded_scores_kernel<T, D><<<grid, kWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// dtype: 0 bf16, 1 fp16 (queries and summaries). Pointers as integers, strides in elements (the codes' in bytes).
int oasis_coded_scores(int dtype, int head_dim, uint64_t q, uint64_t codes, uint64_t smin, uint64_t smax,
                       uint64_t ctab, uint64_t stab, uint64_t ncand, uint64_t out, const int64_t* strides,
                       const int* shape, uint64_t stream) {
  Args a;
  a.q = reinterpret_cast<const void*>(q);
  a.codes = reinterpret_cast<const uint8_t*>(codes);
  a.smin = reinterpret_cast<const void*>(smin);
  a.smax = reinterpret_cast<const void*>(smax);
  a.ctab = reinterpret_cast<const void*>(ctab);
  a.stab = reinterpret_cast<const void*>(stab);
  a.ncand = reinterpret_cast<const int32_t*>(ncand);
  a.out = reinterpret_cast<float*>(out);
  int64_t* dst[] = {&a.s_qb, &a.s_qs, &a.s_qh, &a.s_cr, &a.s_ct, &a.s_ch, &a.s_mb, &a.s_mt, &a.s_mh,
                    &a.s_xb, &a.s_xt, &a.s_xh, &a.s_cb, &a.s_sb, &a.s_ns, &a.s_os, &a.s_ob, &a.s_oh};
  for (int i = 0; i < 18; ++i) *dst[i] = strides[i];
  const int batch = shape[0];
  a.hkv = shape[1]; a.g = shape[2]; a.gp = shape[3]; a.sets = shape[4]; a.n_cols = shape[5];
  a.n_pages = shape[6]; a.n_code_cols = shape[7]; a.ctab_wide = shape[8]; a.stab_wide = shape[9];
  if (a.sets < 1 || a.sets > 2 || a.sets * a.gp > 8 || a.g > a.gp) return cudaErrorInvalidValue;
  if (batch == 0 || a.n_cols == 0) return cudaSuccess;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (dtype == 0 && head_dim == 128) return launch<__nv_bfloat16, 128>(a, batch, s);
  if (dtype == 0 && head_dim == 64) return launch<__nv_bfloat16, 64>(a, batch, s);
  if (dtype == 1 && head_dim == 128) return launch<__half, 128>(a, batch, s);
  if (dtype == 1 && head_dim == 64) return launch<__half, 64>(a, batch, s);
  return cudaErrorInvalidValue;
}

}  // extern "C"
