// The fused update's kernels for Adam, partial rowwise Adam, LAMB and partial rowwise LAMB: a unit of
// its own, so that the build runs the two families in parallel (tbe_fused_update.cuh).
#include "cuda/tbe_fused_update_kernels.cuh"

namespace jaxrec {
namespace fused_update {

JAXREC_INSTANTIATE_FUSED_UPDATE(OptimizerKind::kAdam)
JAXREC_INSTANTIATE_FUSED_UPDATE(OptimizerKind::kPartialRowWiseAdam)
JAXREC_INSTANTIATE_FUSED_UPDATE(OptimizerKind::kLamb)
JAXREC_INSTANTIATE_FUSED_UPDATE(OptimizerKind::kPartialRowWiseLamb)

}  // namespace fused_update
}  // namespace jaxrec
