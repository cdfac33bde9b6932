// The fused update's kernels for SGD, Adagrad (which runs LARS-SGD too) and rowwise Adagrad: a unit of its
// own, so that the build runs the two families in parallel (tbe_fused_update.cuh).
#include "cuda/tbe_fused_update_kernels.cuh"

namespace jaxrec {
namespace fused_update {

JAXREC_INSTANTIATE_FUSED_UPDATE(OptimizerKind::kSgd)
JAXREC_INSTANTIATE_FUSED_UPDATE(OptimizerKind::kAdagrad)
JAXREC_INSTANTIATE_FUSED_UPDATE(OptimizerKind::kRowWiseAdagrad)

// The window heads, for every optimizer: in this unit alone, the one of the two that builds faster.
template void LaunchWindowHeads<int32_t>(const Launch&, int, const FusedArgs&);
template void LaunchWindowHeads<int64_t>(const Launch&, int, const FusedArgs&);

}  // namespace fused_update
}  // namespace jaxrec
