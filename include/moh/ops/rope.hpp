// Rotary position embedding (RoPE), rotate-half convention as in LLaMA.
//
// For position m and pair j < d/2: theta_j = base^(-2j/d), c = cos(m theta_j), s = sin(m theta_j),
//   out[j]       = in[j] c - in[j + d/2] s
//   out[j + d/2] = in[j + d/2] c + in[j] s
// Angles are computed in double, then rounded to T.
#pragma once

#include <cmath>

#include "moh/tensor.hpp"

namespace moh {

/// Fills cos_out[0, d/2) and sin_out[0, d/2) for position `position`. d must be even.
template <class T>
void rope_angles(Index position, Index d, double base, T* cos_out, T* sin_out) {
  const Index half = d / 2;
  for (Index j = 0; j < half; ++j) {
    const double theta = std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(d));
    const double angle = static_cast<double>(position) * theta;
    cos_out[j] = static_cast<T>(std::cos(angle));
    sin_out[j] = static_cast<T>(std::sin(angle));
  }
}

/// Rotates one head vector x[0, d) in place with angles from rope_angles().
template <class T>
void rope_rotate(T* x, Index d, const T* cos, const T* sin) {
  const Index half = d / 2;
  for (Index j = 0; j < half; ++j) {
    const T a = x[j], b = x[j + half];
    x[j] = a * cos[j] - b * sin[j];
    x[j + half] = b * cos[j] + a * sin[j];
  }
}

}  // namespace moh

namespace moh {

/// cos/sin of a run of consecutive positions [first, first + count), computed once per call and
/// shared by every head and thread. The table lives in storage the caller provides
/// (storage_size(count, d) values; a layer takes it from its workspace).
template <class T>
class RopeTable {
 public:
  RopeTable() = default;
  RopeTable(Index first, Index count, Index d, double base, T* storage)
      : d_(d), table_(storage) {
    fill(count, base, [first](Index i) { return first + i; });
  }
  /// Rows at any positions: row i is position positions[i] (a ragged KV cache's new tokens).
  static RopeTable at_positions(const Index* positions, Index count, Index d, double base,
                                T* storage) {
    RopeTable table;
    table.d_ = d;
    table.table_ = storage;
    table.fill(count, base, [positions](Index i) { return positions[i]; });
    return table;
  }
  static Index storage_size(Index count, Index d) { return count * d; }
  /// Rotates head vector x[0, d) as at position first + i.
  void rotate(T* x, Index i) const {
    const T* row = table_ + i * d_;
    rope_rotate(x, d_, row, row + d_ / 2);
  }
  /// Sequences whose rows start at different rows of the table (a ragged KV cache): token t of
  /// sequence b is row starts[b] + t. `starts` ([batch], not owned) outlives the table's use.
  void set_sequence_starts(const Index* starts) { starts_ = starts; }
  /// Rotates head vector x[0, d) of token t of sequence b.
  void rotate(T* x, Index b, Index t) const { rotate(x, (starts_ ? starts_[b] : 0) + t); }
  /// False for a default-constructed table (a layer without RoPE).
  explicit operator bool() const { return table_ != nullptr; }

 private:
  // rope_angles() for row i at position position(i), each frequency's pow computed once: the
  // same bits.
  template <class Position>
  void fill(Index count, double base, Position position) {
    const Index half = d_ / 2;
    for (Index j = 0; j < half; ++j) {
      const double theta =
          std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(d_));
      for (Index i = 0; i < count; ++i) {
        const double angle = static_cast<double>(position(i)) * theta;
        table_[i * d_ + j] = static_cast<T>(std::cos(angle));
        table_[i * d_ + half + j] = static_cast<T>(std::sin(angle));
      }
    }
  }

  Index d_ = 0;
  T* table_ = nullptr;  // [count, d]: cos for j < d/2, then sin
  const Index* starts_ = nullptr;
};

}  // namespace moh
