// Issue rates of the instructions in the chunk-pairs softmax's P window (exp2, the e4m3 and f16 packs, the f16 to
// f32 widening, FFMA), alone and mixed in the window's proportions: whether two kinds share a pipe shows as a mix
// taking the sum of their times rather than the larger one.
//
// Build and run on the GPU machine (research; no test runs it):
//   nvcc -O3 -arch=sm_90a -o /tmp/sm90_pipes benchmarks/sm90_pipes.cu && /tmp/sm90_pipes
// Each line: the mix, cycles per loop iteration of a warp (the SM's clock, one CTA of 32 warps per SM, 8 a
// scheduler), and each kind's warp instructions per scheduler per cycle. Look at the SASS with
//   cuobjdump -sass /tmp/sm90_pipes | grep -E 'MUFU|F2FP|HADD2|FFMA'
#include <cstdint>
#include <cstdio>

constexpr int kChains = 8;     // independent dependency chains per kind and thread: the loop is not latency-bound
constexpr int kIters = 2048;   // loop iterations
constexpr int kThreads = 1024; // 32 warps: 8 per scheduler

__device__ __forceinline__ uint32_t ex2_f32(uint32_t x) {
  uint32_t y;  // exp2(-x): bounded to (0, 1] along the chain
  asm volatile("{.reg .f32 t; neg.f32 t, %1; ex2.approx.ftz.f32 %0, t;}" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t ex2_f16x2(uint32_t x) {
  uint32_t y;
  asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t e4m3x2_f32(uint32_t x) {
  uint16_t y;  // two fp32 (the same bits twice) to a packed pair of e4m3
  asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t x) {
  uint16_t y;
  asm volatile("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t f16x2_f32(uint32_t x) {
  uint32_t y;
  asm volatile("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t f32_f16(uint32_t x) {
  uint32_t y;  // the low half as f16, widened
  asm volatile("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo;}" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t ffma(uint32_t x) {
  uint32_t y;
  asm volatile("fma.rn.f32 %0, %1, 0f3F000000, 0f3E800000;" : "=r"(y) : "r"(x));
  return y;
}

enum Kind { kEx2, kEx2H2, kE4m3F32, kE4m3H2, kF16x2F32, kF32F16, kFfma, kKinds };
const char* kKindNames[kKinds] = {"ex2.f32", "ex2.f16x2", "e4m3x2<-f32", "e4m3x2<-f16x2", "f16x2<-f32",
                                  "f32<-f16", "ffma"};

template <int Kind>
__device__ __forceinline__ uint32_t op(uint32_t x) {
  if constexpr (Kind == kEx2) return ex2_f32(x);
  if constexpr (Kind == kEx2H2) return ex2_f16x2(x);
  if constexpr (Kind == kE4m3F32) return e4m3x2_f32(x);
  if constexpr (Kind == kE4m3H2) return e4m3x2_f16x2(x);
  if constexpr (Kind == kF16x2F32) return f16x2_f32(x);
  if constexpr (Kind == kF32F16) return f32_f16(x);
  return ffma(x);
}

// N ops of kind K an iteration, on chains c % kChains
template <int K, int N>
__device__ __forceinline__ void run(uint32_t (&v)[kChains]) {
#pragma unroll
  for (int i = 0; i < N; ++i) v[i % kChains] = op<K>(v[i % kChains]);
}

// A mix: NA ops of kind KA and NB of kind KB an iteration (NB may be 0), interleaved as the compiler schedules them
template <int KA, int NA, int KB, int NB>
__global__ void __launch_bounds__(kThreads, 1) mix(uint32_t* sink, long long* cycles, uint32_t seed) {
  uint32_t a[kChains], b[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
    a[c] = (seed + threadIdx.x * 7 + c) & 0x3c003c00u;
    b[c] = (seed + threadIdx.x * 5 + c) & 0x3c003c00u;
  }
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < kIters; ++it) {
    run<KA, NA>(a);
    if constexpr (NB > 0) run<KB, NB>(b);
  }
  __syncthreads();
  long long t1 = clock64();
  uint32_t acc = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc ^= a[c] ^ b[c];
  sink[blockIdx.x * kThreads + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int KA, int NA, int KB, int NB>
void measure(uint32_t* sink, long long* cycles, long long* host, int sms) {
  auto kernel = mix<KA, NA, KB, NB>;
  kernel<<<sms, kThreads>>>(sink, cycles, 1u);  // warm-up
  kernel<<<sms, kThreads>>>(sink, cycles, 3u);
  cudaMemcpy(host, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  long long worst = 0;
  for (int i = 0; i < sms; ++i) worst = host[i] > worst ? host[i] : worst;
  double per_iter = double(worst) / kIters;  // cycles a loop iteration (every warp of the SM runs one)
  double warps_per_sched = kThreads / 32 / 4;
  printf("%-14s x%-2d", kKindNames[KA], NA);
  if (NB > 0) printf(" + %-14s x%-2d", kKindNames[KB], NB); else printf(" %20s", "");
  printf("  %8.2f cycles/iter  %6.3f", per_iter, warps_per_sched * NA / per_iter);
  if (NB > 0) printf("  %6.3f", warps_per_sched * NB / per_iter);
  printf("  warp-instr/scheduler/cycle\n");
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint32_t* sink;
  long long* cycles;
  cudaMalloc(&sink, sms * kThreads * sizeof(uint32_t));
  cudaMalloc(&cycles, sms * sizeof(long long));
  long long* host = new long long[sms];
  // alone
  measure<kEx2, 16, kEx2, 0>(sink, cycles, host, sms);
  measure<kEx2H2, 16, kEx2, 0>(sink, cycles, host, sms);
  measure<kE4m3F32, 16, kEx2, 0>(sink, cycles, host, sms);
  measure<kE4m3H2, 16, kEx2, 0>(sink, cycles, host, sms);
  measure<kF16x2F32, 16, kEx2, 0>(sink, cycles, host, sms);
  measure<kF32F16, 16, kEx2, 0>(sink, cycles, host, sms);
  measure<kFfma, 16, kEx2, 0>(sink, cycles, host, sms);
  // P's window today: two exp2 a packed pair of e4m3
  measure<kEx2, 16, kE4m3F32, 8>(sink, cycles, host, sms);
  // exp2 in f16 pairs: the f32 pack before, the e4m3 pack after
  measure<kEx2H2, 8, kF16x2F32, 8>(sink, cycles, host, sms);
  measure<kEx2H2, 8, kE4m3H2, 8>(sink, cycles, host, sms);
  measure<kF16x2F32, 8, kE4m3H2, 8>(sink, cycles, host, sms);
  // the sums in f32 from f16 halves, beside the exp2
  measure<kEx2H2, 8, kF32F16, 16>(sink, cycles, host, sms);
  // FFMA beside exp2 (dual issue does not exist: one instruction a scheduler a cycle)
  measure<kEx2, 16, kFfma, 16>(sink, cycles, host, sms);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
