// moh::WeightStorage: how a layer stores its projection weights, apart from the matrices that hold
// them, so that a config can name it without including the GEMM.
#pragma once

#include "moh/tensor.hpp"

namespace moh {

/// How a layer stores its projection weights. Compute is always in the layer's scalar type.
enum class WeightStorage {
  Native,    // in T, exactly as set
  BFloat16,  // rounded to bfloat16 (8-bit mantissa): half the memory of float
  // In T as Native, plus a copy in the GEMM's panel layout that products of many rows read in
  // place instead of packing the weights on every call: twice the memory, the same bits; for
  // calls of few tokens against large weights (MoH-ViT's last stage). A decode step reads the
  // first copy.
  NativePacked,
};

template <>
struct EnumNames<WeightStorage> {
  static constexpr const char* names[] = {"native", "bfloat16", "native_packed"};
};

/// `s` without the packed copy: for matrices that are only read untransposed ([in, out] experts),
/// which the packed copy does not serve.
inline WeightStorage without_packed_copy(WeightStorage s) {
  return s == WeightStorage::NativePacked ? WeightStorage::Native : s;
}

}  // namespace moh
