// The memory system's own ceiling for an embedding lookup of rows of S bytes: the least
// work that reads what a lookup reads and writes what it writes, with nothing of a lookup
// kernel's arithmetic or layout choices. jaxrec's lookups are judged against it
// (docs/serving.md: how close the int8 and int4 lookups come, and why "int8 >= 3x the
// float32 lookup" is out of reach at 64-byte DRAM bursts).
//
//   nvcc -O3 -arch=sm_90 -o random_row_reads benchmarks/random_row_reads.cu
//   ./random_row_reads > benchmarks/results/random_row_reads_<device>_<date>.json
//
// Shape of benchmarks/serving_lookup_gpu.py: T*E = 32M rows stored back to back, S bytes
// each (int8 at D=128 with its 4 bytes of scale and bias is S=132; int4: 68; fp16: 256;
// float32: 512); B*T = 131,072 bags of L=20 uniform random rows. A warp per bag reads
// each row as 4-byte words (every byte of it once), adds them up and writes 512 bytes
// per bag (a float32 D=128 pooled row). Bytes are counted three ways: the row bytes,
// the 32-byte sectors and the 64-byte DRAM bursts each row touches at its offset, plus
// the output; each is divided by the time and by the copy ceiling (4 GiB copied, read +
// write, by a float4 kernel or cudaMemcpy, whichever is faster, in this process). Median of 20 timed calls
// after 3 warm-up.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

constexpr int kL = 20;
constexpr int64_t kRows = 32LL * 1000 * 1000;
constexpr int kBags = 32 * 4096;
constexpr int kOutWords = 128;  // 512 bytes a bag

template <int kChunks>
__global__ void ReadRows(const uint8_t* __restrict__ table, int row_bytes, const int32_t* __restrict__ ids,
                         uint32_t* __restrict__ out) {
  const int bag = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (bag >= kBags) return;
  const int words = row_bytes / 4;
  const int my_id = lane < kL ? ids[int64_t{bag} * kL + lane] : 0;
  uint32_t acc[kChunks] = {};
#pragma unroll
  for (int l = 0; l < kL; ++l) {
    const int64_t row = __shfl_sync(0xffffffff, my_id, l);
    const uint32_t* words_of_row = reinterpret_cast<const uint32_t*>(table + row * row_bytes);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int w = c * 32 + lane;
      if (w < words) acc[c] += __ldg(words_of_row + w);
    }
  }
  uint32_t sum = 0;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) sum += acc[c];
  uint4 v = make_uint4(sum, sum + 1, sum + 2, sum + 3);
  reinterpret_cast<uint4*>(out + int64_t{bag} * kOutWords)[lane] = v;  // 32 lanes x 16 bytes
}

// Four float4 a thread in flight.
__global__ void Copy(const float4* __restrict__ in, float4* __restrict__ out, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += 4 * stride) {
    float4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i + k * stride < n) v[k] = in[i + k * stride];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i + k * stride < n) out[i + k * stride] = v[k];
    }
  }
}

template <typename F>
float MedianMs(F launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int64_t Lines(int64_t offset, int bytes, int line) { return (offset + bytes - 1) / line - offset / line + 1; }

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  CHECK(cudaDriverGetVersion(&driver));
  CHECK(cudaRuntimeGetVersion(&runtime));

  const int sizes[] = {512, 256, 144, 136, 132, 128, 96, 68, 64};
  const int max_bytes = 512;
  uint8_t* table;
  CHECK(cudaMalloc(&table, kRows * max_bytes));
  CHECK(cudaMemset(table, 1, kRows * max_bytes));  // not zeros: a value that the sums carry
  uint32_t* out;
  CHECK(cudaMalloc(&out, int64_t{kBags} * kOutWords * 4));
  int32_t* ids;
  std::vector<int32_t> host_ids(int64_t{kBags} * kL);
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (auto& id : host_ids) {  // xorshift64*, uniform over the rows (duplicates included)
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    id = static_cast<int32_t>(((s * 0x2545F4914F6CDD1Dull) >> 32) % kRows);
  }
  CHECK(cudaMalloc(&ids, host_ids.size() * 4));
  CHECK(cudaMemcpy(ids, host_ids.data(), host_ids.size() * 4, cudaMemcpyHostToDevice));

  const int64_t copy_bytes = 4LL << 30;  // half the table in, the other half out
  const float kernel_ms = MedianMs([&] {
    Copy<<<prop.multiProcessorCount * 4, 512>>>(reinterpret_cast<const float4*>(table),
                                                reinterpret_cast<float4*>(table + copy_bytes),
                                                copy_bytes / 16);
  });
  const float memcpy_ms = MedianMs(
      [&] { CHECK(cudaMemcpyAsync(table + copy_bytes, table, copy_bytes, cudaMemcpyDeviceToDevice)); });
  const double ceiling = 2.0 * copy_bytes / (std::min(kernel_ms, memcpy_ms) * 1e-3) / 1e9;

  std::printf(
      "{\n  \"benchmark\": \"random_row_reads\",\n  \"device\": \"%s\",\n  \"driver\": %d,\n"
      "  \"cuda_runtime\": %d,\n  \"rows\": %lld,\n  \"bags\": %d,\n  \"ids_per_bag\": %d,\n"
      "  \"output_bytes_per_bag\": %d,\n  \"copy_ceiling_GB_per_s\": %.1f,\n"
      "  \"copy_GB_per_s\": {\"kernel\": %.1f, \"cudaMemcpy\": %.1f},\n  \"results\": [\n",
      prop.name, driver, runtime, static_cast<long long>(kRows), kBags, kL, kOutWords * 4, ceiling,
      2.0 * copy_bytes / (kernel_ms * 1e-3) / 1e9, 2.0 * copy_bytes / (memcpy_ms * 1e-3) / 1e9);
  for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); ++k) {
    const int bytes = sizes[k];
    const int chunks = (bytes / 4 + 31) / 32;
    const unsigned blocks = (kBags + 7) / 8;
    const auto launch = [&] {
      switch (chunks) {
        case 1:
          ReadRows<1><<<blocks, 256>>>(table, bytes, ids, out);
          break;
        case 2:
          ReadRows<2><<<blocks, 256>>>(table, bytes, ids, out);
          break;
        case 3:
          ReadRows<3><<<blocks, 256>>>(table, bytes, ids, out);
          break;
        default:
          ReadRows<4><<<blocks, 256>>>(table, bytes, ids, out);
      }
    };
    const float ms = MedianMs(launch);
    int64_t sectors = 0, bursts = 0;
    for (int32_t id : host_ids) {
      sectors += Lines(int64_t{id} * bytes, bytes, 32);
      bursts += Lines(int64_t{id} * bytes, bytes, 64);
    }
    const double out_bytes = double{kBags} * kOutWords * 4, sec = ms * 1e-3;
    const double rows = double(host_ids.size()) * bytes + out_bytes;
    const double sec_b = sectors * 32.0 + out_bytes, burst_b = bursts * 64.0 + out_bytes;
    std::printf(
        "    {\"row_bytes\": %d, \"ms\": %.4f, \"sector_bytes_per_row\": %.1f, \"burst_bytes_per_row\": "
        "%.1f, "
        "\"of_ceiling_rows\": %.3f, \"of_ceiling_sectors\": %.3f, \"of_ceiling_bursts\": %.3f}%s\n",
        bytes, ms, 32.0 * sectors / host_ids.size(), 64.0 * bursts / host_ids.size(),
        rows / sec / 1e9 / ceiling, sec_b / sec / 1e9 / ceiling, burst_b / sec / 1e9 / ceiling,
        k + 1 < sizeof(sizes) / sizeof(sizes[0]) ? "," : "");
  }
  std::printf("  ]\n}\n");
  return 0;
}
