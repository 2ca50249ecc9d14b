// Tensor and matrix aliases used across moh.
//
// Activations are row-major [batch, tokens, features] so that a PyTorch buffer maps without a
// copy; weights are row-major matrices in PyTorch layout [out, in].
#pragma once

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <string>
#include <vector>

#include "moh/error.hpp"

namespace moh {

using Index = Eigen::Index;

template <class T>
using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor, Index>;  // [batch, tokens, features]
template <class T>
using TensorMap3 = Eigen::TensorMap<Tensor3<T>>;
template <class T>
using ConstTensorMap3 = Eigen::TensorMap<const Tensor3<T>>;

template <class T>
using Tensor4 = Eigen::Tensor<T, 4, Eigen::RowMajor, Index>;  // e.g. [batch, heads, tokens, keys]

using Mask = Eigen::Tensor<bool, 2, Eigen::RowMajor, Index>;  // [batch, keys], true = padding
using MaskMap = Eigen::TensorMap<const Mask>;

template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
template <class T>
using MatrixMap = Eigen::Map<Matrix<T>>;
template <class T>
using ConstMatrixMap = Eigen::Map<const Matrix<T>>;
template <class T>
using StridedMap = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstStridedMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Maps a [B, T, F] tensor view as a row-major [B*T, F] matrix without copying.
template <class T>
ConstMatrixMap<T> as_rows(const ConstTensorMap3<T>& t) {
  return ConstMatrixMap<T>(t.data(), t.dimension(0) * t.dimension(1), t.dimension(2));
}
template <class T>
MatrixMap<T> as_rows(TensorMap3<T>& t) {
  return MatrixMap<T>(t.data(), t.dimension(0) * t.dimension(1), t.dimension(2));
}

/// The names of an enum's values, in order, for configs saved as text: specialised next to each
/// enum (`static constexpr const char* names[]`).
template <class Enum>
struct EnumNames;

/// The name of `value` ("?" when out of range).
template <class Enum>
const char* enum_name(Enum value) {
  const auto& names = EnumNames<Enum>::names;
  const auto i = static_cast<std::size_t>(value);
  return i < sizeof(names) / sizeof(names[0]) ? names[i] : "?";
}

/// Throws moh::Error naming `layer: what` unless `t` is [batch, tokens, features] (-1 = any).
/// Nothing is allocated unless it throws.
template <class TensorLike>
void require_shape3(const char* layer, const char* what, const TensorLike& t, Index batch,
                    Index tokens, Index features) {
  const Index want[3] = {batch, tokens, features};
  bool ok = true;
  for (int i = 0; i < 3; ++i) ok = ok && (want[i] < 0 || t.dimension(i) == want[i]);
  if (ok) return;
  std::vector<std::string> w;
  for (Index v : want) w.push_back(v < 0 ? std::string("*") : std::to_string(v));
  detail::fail(layer, *layer ? ": " : "", what, ": expected shape ", detail::shape_string(w),
               ", got ",
               detail::shape_string(std::vector<Index>{t.dimension(0), t.dimension(1),
                                                       t.dimension(2)}));
}

/// Throws moh::Error naming `what` unless `t` is [batch, tokens, features] (-1 = any).
template <class TensorLike>
void require_shape3(const std::string& what, const TensorLike& t, Index batch, Index tokens,
                    Index features) {
  require_shape3("", what.c_str(), t, batch, tokens, features);
}

}  // namespace moh
