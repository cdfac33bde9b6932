// Positive controls for benchmarks/sanitizer/sanitize_gpu.sh: two kernels with known
// bugs, named like jaxrec's (namespace jaxrec), so the script can show that the
// sanitizer's kernel filter matches jaxrec's kernels and that each tool reports a bug
// when there is one. A clean result over the tests then means something.
//   control oob   - a write past the end of a global buffer (memcheck must report it)
//   control race  - unsynchronised shared-memory writes and reads (racecheck must report it)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace jaxrec {

__global__ void SanitizerControlOutOfBounds(int* buffer, int size) {
  buffer[size + threadIdx.x] = 1;  // every thread writes past the end
}

__global__ void SanitizerControlRace(int* out) {
  __shared__ int shared[32];
  shared[threadIdx.x % 32] = threadIdx.x;             // threads t and t + 32 write one slot
  out[threadIdx.x] = shared[(threadIdx.x + 1) % 32];  // read with no barrier
}

}  // namespace jaxrec

int main(int argc, char** argv) {
  if (argc != 2 || (std::strcmp(argv[1], "oob") && std::strcmp(argv[1], "race"))) {
    std::fprintf(stderr, "usage: control oob|race\n");
    return 2;
  }
  int* buffer = nullptr;
  cudaMalloc(&buffer, 256 * sizeof(int));
  if (!std::strcmp(argv[1], "oob")) {
    jaxrec::SanitizerControlOutOfBounds<<<1, 32>>>(buffer, 256);
  } else {
    jaxrec::SanitizerControlRace<<<1, 64>>>(buffer);
  }
  cudaDeviceSynchronize();
  cudaFree(buffer);
  return 0;
}
