// The helpers every test shares: error capture and message matching, bit equality, seeded
// random tensors, comparison measures and tolerances, the config builders (layer_configs.hpp, shared with
// bench/), and the golden cases.
// One home for them, so that no test file keeps its own copy.
#pragma once

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "layer_configs.hpp"
#include "moh/moh.hpp"

namespace moh_test {

using moh::Index;

// ---- errors -------------------------------------------------------------------------------------

/// Runs `f`, which must throw an `E` (moh::Error, or what a binary's MOH_THROW throws); returns
/// its message ("" and a test failure otherwise).
template <class E = moh::Error>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected " << ::testing::internal::GetTypeName<E>()
                  << ", got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected " << ::testing::internal::GetTypeName<E>() << ", got no exception";
  return "";
}

/// Success when `message` contains every one of `parts`.
inline ::testing::AssertionResult Mentions(const std::string& message,
                                           const std::vector<std::string>& parts) {
  for (const std::string& part : parts) {
    if (message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "message \"" << message << "\" lacks \"" << part
                                           << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- bit equality -------------------------------------------------------------------------------

/// Success when a and b have the same sizes and the same bits (NaNs included).
template <class A, class B>
::testing::AssertionResult BitEqual(const A& a, const B& b) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (Index i = 0; i < static_cast<Index>(a.size()); ++i)
    if (std::memcmp(&a.data()[i], &b.data()[i], sizeof(a.data()[i])) != 0)
      return ::testing::AssertionFailure() << "element " << i << " differs: " << a.data()[i]
                                           << " vs " << b.data()[i];
  return ::testing::AssertionSuccess();
}

// ---- random inputs ------------------------------------------------------------------------------

/// Seeded uniform(-scale, scale) values into n elements at p.
template <class T>
void fill_random(T* p, Index n, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  for (Index i = 0; i < n; ++i) p[i] = static_cast<T>(dist(rng));
}
/// [B, T, F] of seeded uniform(-scale, scale) values.
template <class T>
moh::Tensor3<T> random_tensor(Index B, Index Tn, Index F, std::uint64_t seed, double scale = 1.0) {
  moh::Tensor3<T> t(B, Tn, F);
  fill_random(t.data(), t.size(), seed, scale);
  return t;
}
/// Row-major [rows, cols] of seeded uniform(-scale, scale) values.
template <class T>
moh::Matrix<T> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  moh::Matrix<T> m(rows, cols);
  fill_random(m.data(), m.size(), seed, scale);
  return m;
}
template <class T>
moh::Vector<T> random_vector(Index size, std::uint64_t seed, double scale = 1.0) {
  moh::Vector<T> v(size);
  fill_random(v.data(), v.size(), seed, scale);
  return v;
}
/// A [B, S] padding mask, all false.
inline moh::Mask no_padding(Index B, Index S) {
  moh::Mask m(B, S);
  m.setConstant(false);
  return m;
}

// ---- comparisons --------------------------------------------------------------------------------

/// max |a - b| over two equally sized matrix-likes (infinity if any difference is NaN).
template <class MA, class MB>
double max_abs_diff(const MA& a, const MB& b) {
  double m = 0;
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c) {
      const double d = std::abs(static_cast<double>(a(r, c)) - static_cast<double>(b(r, c)));
      m = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(m, d);
    }
  return m;
}
/// max(1, max |a|).
template <class MA>
double scale_of(const MA& a) {
  double m = 1.0;
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c) m = std::max(m, std::abs(static_cast<double>(a(r, c))));
  return m;
}
/// A [B, T, F] tensor as [B*T, F] double rows.
template <class T>
Eigen::MatrixXd rows_of(const moh::Tensor3<T>& t) {
  return moh::ConstMatrixMap<T>(t.data(), t.dimension(0) * t.dimension(1), t.dimension(2))
      .template cast<double>();
}
/// max |got - ref| / max |ref| (the denominator floored at 1e-30): a relative error for the whole
/// output, so that tiny entries are not held to a per-element relative bound.
inline double relative_error(const Eigen::MatrixXd& got, const Eigen::MatrixXd& ref) {
  if (got.rows() != ref.rows() || got.cols() != ref.cols())
    return std::numeric_limits<double>::infinity();
  const double diff = max_abs_diff(got, ref);
  double scale = 0.0;
  for (Index r = 0; r < ref.rows(); ++r)
    for (Index c = 0; c < ref.cols(); ++c) scale = std::max(scale, std::abs(ref(r, c)));
  return diff / std::max(scale, 1e-30);
}
template <class T>
double relative_error(const moh::Tensor3<T>& got, const Eigen::MatrixXd& ref) {
  return relative_error(rows_of(got), ref);
}

/// Tolerances of a comparison against a double reference.
template <class T>
struct Tol;
template <>
struct Tol<float> {
  static constexpr double rel = 1e-4;    // vs the double reference
  static constexpr double exact = 1e-5;  // two float computations that must agree (MoH == MHA)
};
template <>
struct Tol<double> {
  static constexpr double rel = 1e-10;
  static constexpr double exact = 1e-12;
};

// ---- golden cases -------------------------------------------------------------------------------

/// The folder of the golden cases (tests/data unless the build says otherwise).
inline std::string fixtures_dir() {
#ifdef MOH_FIXTURES_DIR
  return MOH_FIXTURES_DIR;
#else
  return "";
#endif
}
/// The path of golden case `name` (e.g. "moh_llama_decode.safetensors"); a missing file is a test
/// failure, never a skip: the cases ship with the repository.
inline std::string fixture(const std::string& name) {
  const std::string path = fixtures_dir() + "/" + name;
  if (!std::filesystem::is_regular_file(path)) ADD_FAILURE() << "golden case missing: " << path;
  return path;
}
/// Sorted *.safetensors paths in the fixtures folder (a test failure if there are none).
inline std::vector<std::string> fixture_files() {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(fixtures_dir(), ec))
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  std::sort(files.begin(), files.end());
  if (files.empty()) ADD_FAILURE() << "no golden cases (*.safetensors) in '" << fixtures_dir() << "'";
  return files;
}

}  // namespace moh_test
