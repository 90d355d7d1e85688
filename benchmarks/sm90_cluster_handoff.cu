// Latency of one exchange between two MMA warpgroups, the chunk-pairs loop's two handoffs a pair (the rows' chunk
// maxima, then P): inside one CTA (each warpgroup stores its words into shared memory, a 256-thread named barrier,
// each reads the other's words), against across the two CTAs of a cluster, which a pair loop with O^T's 512 dims
// split over a 2-CTA cluster would pay instead: each warpgroup stores its words into the other CTA's shared memory
// and signals the other CTA's mbarrier (`Form`: st.shared::cluster and an arrival with release at cluster scope, or
// st.async, whose bytes complete on that mbarrier), then waits on its own and reads. Each exchange's words feed the
// next one's, so an iteration is one exchange's latency.
//
// Build and run on the GPU machine (research; no test runs it):
//   nvcc -O3 -arch=sm_90a -o /tmp/sm90_cluster_handoff benchmarks/sm90_cluster_handoff.cu && /tmp/sm90_cluster_handoff
// Each line: the form, 32-bit words a thread per exchange (1: the maxima, 8: one chunk's P at 64 rows), and cycles
// per exchange (the SM's clock; the mean over CTAs and the slowest CTA), one CTA per SM on every SM. It also prints
// how many 2-CTA clusters of one CTA per SM the device runs at once.
#include <cstdint>
#include <cstdio>

constexpr int kIters = 4096;
constexpr int kWarpgroup = 128;
constexpr int kSmemBytes = 160 * 1024;  // one CTA per SM, as the decode kernels run

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t peer_addr(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ uint32_t ld_shared(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// Inside one CTA: warpgroups 0 and 1, buffers [iteration parity][warpgroup][word][thread]
template <int Words>
__global__ void __launch_bounds__(2 * kWarpgroup, 1) cta_exchange(uint32_t* sink, long long* cycles) {
  extern __shared__ __align__(16) uint32_t smem[];
  const int wg = threadIdx.x / kWarpgroup, t = threadIdx.x % kWarpgroup;
  uint32_t v = threadIdx.x;
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < kIters; ++it) {
    uint32_t* mine = smem + ((it & 1) * 2 + wg) * Words * kWarpgroup;
    uint32_t other = smem_addr(smem + ((it & 1) * 2 + 1 - wg) * Words * kWarpgroup);
#pragma unroll
    for (int w = 0; w < Words; ++w) mine[w * kWarpgroup + t] = v + w;
    asm volatile("bar.sync 1, 256;" ::: "memory");
    uint32_t s = 0;
#pragma unroll
    for (int w = 0; w < Words; ++w) s += ld_shared(other + (w * kWarpgroup + t) * 4);
    v = s * 3u + 1u;
  }
  long long t1 = clock64();
  sink[blockIdx.x * blockDim.x + threadIdx.x] = v;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// The forms of the cross-CTA handoff
enum Form {
  kRelease,       // st.shared::cluster, every thread arrives on the peer's mbarrier (release, cluster scope);
                  // the wait acquires at cluster scope
  kReleaseWarp,   // the same with one arrival a warp (lane 0, after a __syncwarp)
  kReleaseFence,  // kRelease with the proxy fence a wgmma operand (P) would need before the arrival
  kReleaseCta,    // kRelease, the wait acquiring at CTA scope (the ordering then rests on the arrival alone)
  kTestWait,      // kRelease, the wait spinning on mbarrier.test_wait instead of try_wait
  kStAsync,       // st.async: each store completes its bytes on the peer's mbarrier, which its own thread 0 armed
  kForms
};
const char* kFormNames[kForms] = {"release/acquire, an arrival a thread", "release/acquire, an arrival a warp",
                                  "release/acquire + proxy fence", "release, CTA-scope acquire",
                                  "release/acquire, test_wait spin", "st.async + complete_tx"};

// Across a 2-CTA cluster: one warpgroup a CTA; each writes the peer's buffer [iteration parity][word][thread] and
// signals the peer's mbarrier of that parity (Form), then waits on its own.
template <int Words, int F>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kWarpgroup, 1)
    cluster_exchange(uint32_t* sink, long long* cycles) {
  extern __shared__ __align__(16) uint32_t smem[];
  __shared__ __align__(8) uint64_t bars[2];
  const int t = threadIdx.x;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const uint32_t arrivals = F == kReleaseWarp ? kWarpgroup / 32 : F == kStAsync ? 1 : kWarpgroup;
  if (t == 0) {
    for (int p = 0; p < 2; ++p)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&bars[p])), "r"(arrivals) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // both CTAs' mbarriers initialised before any remote arrival
  const uint32_t data_local = smem_addr(smem), data_peer = peer_addr(data_local, rank ^ 1);
  const uint32_t bar_local = smem_addr(bars), bar_peer = peer_addr(bar_local, rank ^ 1);
  uint32_t v = t + rank;
  long long t0 = clock64();
  for (int it = 0; it < kIters; ++it) {
    const int p = it & 1;
    const uint32_t slot = (p * Words * kWarpgroup + t) * 4;
    if constexpr (F == kStAsync) {
      if (t == 0)  // this iteration's bytes from the peer, armed before or after they land (tx-count may dip)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_local + p * 8),
                     "r"(Words * kWarpgroup * 4)
                     : "memory");
#pragma unroll
      for (int w = 0; w < Words; ++w)
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];" ::"r"(
                         data_peer + slot + w * kWarpgroup * 4),
                     "r"(v + w), "r"(bar_peer + p * 8)
                     : "memory");
    } else {
#pragma unroll
      for (int w = 0; w < Words; ++w)
        asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(data_peer + slot + w * kWarpgroup * 4), "r"(v + w)
                     : "memory");
      if constexpr (F == kReleaseFence) asm volatile("fence.proxy.async.shared::cluster;" ::: "memory");
      if constexpr (F == kReleaseWarp) {
        __syncwarp();
        if (t % 32 == 0)
          asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar_peer + p * 8)
                       : "memory");
      } else {
        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar_peer + p * 8)
                     : "memory");
      }
    }
    const uint32_t parity = (it >> 1) & 1;  // the mbarrier of parity p completes every other iteration
    if constexpr (F == kTestWait) {
      asm volatile(
          "{\n.reg .pred done;\nwait_%=:\n"
          "mbarrier.test_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
          "@!done bra wait_%=;\n}" ::"r"(bar_local + p * 8),
          "r"(parity)
          : "memory");
    } else if constexpr (F == kReleaseCta || F == kStAsync) {
      asm volatile(
          "{\n.reg .pred done;\nwait_%=:\n"
          "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
          "@!done bra wait_%=;\n}" ::"r"(bar_local + p * 8),
          "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{\n.reg .pred done;\nwait_%=:\n"
          "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
          "@!done bra wait_%=;\n}" ::"r"(bar_local + p * 8),
          "r"(parity)
          : "memory");
    }
    uint32_t s = 0;
#pragma unroll
    for (int w = 0; w < Words; ++w) s += ld_shared(data_local + slot + w * kWarpgroup * 4);
    v = s * 3u + 1u;
  }
  long long t1 = clock64();
  cluster_sync();  // no remote arrival may target a CTA that has exited
  sink[blockIdx.x * blockDim.x + threadIdx.x] = v;
  if (t == 0) cycles[blockIdx.x] = t1 - t0;
}

void report(const char* form, int words, long long* cycles, long long* host, int ctas) {
  cudaMemcpy(host, cycles, ctas * sizeof(long long), cudaMemcpyDeviceToHost);
  long long worst = 0;
  double mean = 0;
  for (int i = 0; i < ctas; ++i) {
    worst = host[i] > worst ? host[i] : worst;
    mean += double(host[i]) / ctas;
  }
  printf("%-54s words %d  %8.1f cycles/exchange (slowest CTA %8.1f)\n", form, words, mean / kIters,
         double(worst) / kIters);
}

template <int Words>
void measure_cta(uint32_t* sink, long long* cycles, long long* host, int ctas) {
  auto kernel = cta_exchange<Words>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  kernel<<<ctas, 2 * kWarpgroup, kSmemBytes>>>(sink, cycles);  // warm-up
  kernel<<<ctas, 2 * kWarpgroup, kSmemBytes>>>(sink, cycles);
  report("one CTA: bar.sync of 256 threads", Words, cycles, host, ctas);
}

template <int Words, int F>
void measure_cluster(uint32_t* sink, long long* cycles, long long* host, int ctas) {
  auto kernel = cluster_exchange<Words, F>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  kernel<<<ctas, kWarpgroup, kSmemBytes>>>(sink, cycles);  // warm-up
  kernel<<<ctas, kWarpgroup, kSmemBytes>>>(sink, cycles);
  char form[96];
  snprintf(form, sizeof form, "2-CTA cluster: %s", kFormNames[F]);
  report(form, Words, cycles, host, ctas);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int ctas = sms - sms % 2;
  uint32_t* sink;
  long long* cycles;
  cudaMalloc(&sink, ctas * 2 * kWarpgroup * sizeof(uint32_t));
  cudaMalloc(&cycles, ctas * sizeof(long long));
  long long* host = new long long[ctas];

  auto probe = cluster_exchange<1, kRelease>;
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kWarpgroup);
  config.dynamicSmemBytes = kSmemBytes;
  int clusters = 0;
  cudaOccupancyMaxActiveClusters(&clusters, probe, &config);
  printf("%d SMs; 2-CTA clusters of one CTA per SM at once: %d (%d CTAs)\n", sms, clusters, 2 * clusters);

  measure_cta<1>(sink, cycles, host, ctas);
  measure_cta<8>(sink, cycles, host, ctas);
  measure_cluster<1, kRelease>(sink, cycles, host, ctas);
  measure_cluster<1, kReleaseWarp>(sink, cycles, host, ctas);
  measure_cluster<1, kReleaseCta>(sink, cycles, host, ctas);
  measure_cluster<1, kTestWait>(sink, cycles, host, ctas);
  measure_cluster<1, kStAsync>(sink, cycles, host, ctas);
  measure_cluster<8, kRelease>(sink, cycles, host, ctas);
  measure_cluster<8, kReleaseWarp>(sink, cycles, host, ctas);
  measure_cluster<8, kReleaseFence>(sink, cycles, host, ctas);
  measure_cluster<8, kReleaseCta>(sink, cycles, host, ctas);
  measure_cluster<8, kStAsync>(sink, cycles, host, ctas);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
