#include "common/bounds_check.h"

#include <string>
#include <string_view>

namespace jaxrec {
namespace {

std::string FeatureLabel(std::string_view labels, int64_t feature) {
  int64_t line = 0;
  size_t begin = 0;
  while (begin <= labels.size() && !labels.empty()) {
    size_t end = labels.find('\n', begin);
    if (end == std::string_view::npos) end = labels.size();
    if (line == feature) return std::string(labels.substr(begin, end - begin));
    ++line;
    begin = end + 1;
  }
  return "feature " + std::to_string(feature);
}

std::string Where(std::string_view labels, int64_t batch_size, int64_t bag) {
  const int64_t feature = batch_size > 0 ? bag / batch_size : 0;
  const int64_t sample = batch_size > 0 ? bag % batch_size : 0;
  return "bounds_check_indices (FATAL): " + FeatureLabel(labels, feature) + ", bag " +
         std::to_string(sample) + ": ";
}

}  // namespace

ffi::Error ValidateBoundsCheck(int32_t mode, const ffi::AnyBuffer& rows_per_table,
                               const ffi::AnyBuffer& indices, const ffi::AnyBuffer& offsets) {
  if (mode < 0 || mode > 2) {
    return ffi::Error::InvalidArgument(
        "bounds_check_indices: mode must be 0 (FATAL), 1 (WARNING) "
        "or 2 (IGNORE), got " +
        std::to_string(mode));
  }
  if (indices.element_type() != offsets.element_type() ||
      indices.element_type() != rows_per_table.element_type()) {
    return ffi::Error::InvalidArgument(
        "bounds_check_indices: rows_per_table, indices and offsets must share one dtype");
  }
  const int64_t num_bags = static_cast<int64_t>(offsets.element_count()) - 1;
  const int64_t num_features = rows_per_table.element_count();
  if (num_bags < 0 || (num_features > 0 && num_bags % num_features != 0) ||
      (num_features == 0 && num_bags != 0)) {
    return ffi::Error::InvalidArgument(
        "bounds_check_indices: offsets must have T*B+1 entries for T = len(rows_per_table)");
  }
  if (indices.element_count() >= (size_t{1} << 31)) {
    return ffi::Error::InvalidArgument("bounds_check_indices: indices must have < 2^31 entries");
  }
  return ffi::Error::Success();
}

std::string BadOffsetsMessage(std::string_view labels, int64_t batch_size, int64_t bag, int64_t start,
                              int64_t end, int64_t num_indices) {
  return Where(labels, batch_size, bag) + "offsets[" + std::to_string(bag) + "]=" + std::to_string(start) +
         ", offsets[" + std::to_string(bag + 1) + "]=" + std::to_string(end) +
         " is not a range inside indices of size " + std::to_string(num_indices) +
         ". Fix the offsets, or pass bounds_check_mode=WARNING or IGNORE to clamp them.";
}

std::string BadIndexMessage(std::string_view labels, int64_t batch_size, int64_t bag, int64_t position,
                            int64_t index, int64_t num_rows) {
  return Where(labels, batch_size, bag) + "indices[" + std::to_string(position) +
         "]=" + std::to_string(index) + " is out of range for a table of " + std::to_string(num_rows) +
         " rows. Fix the ids, or pass bounds_check_mode=WARNING or IGNORE to map bad ids to row 0.";
}

}  // namespace jaxrec
