// MOH_THROW works on every path: with the macro defined before any moh header, every moh::Error
// the library raises (layers, ops, runtime, io, errors inside pool tasks) arrives as what the
// macro throws instead. In its own binary: defining the macro differently in one translation
// unit of a binary would break the one-definition rule.
#include <stdexcept>
#include <string>

/// What this binary's MOH_THROW throws: the moh::Error's message behind a marker.
struct RoutedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
#define MOH_THROW(error) throw RoutedError(std::string("routed: ") + (error).what())

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "moh/io.hpp"
#include "moh/io/golden_case.hpp"
#include "test_helpers.hpp"

namespace {

/// The message of the RoutedError `f` throws ("" and a failure if it throws something else).
template <class F>
std::string routed(F&& f) {
  return moh_test::error_of<RoutedError>(std::forward<F>(f));
}

bool starts_routed(const std::string& m) { return m.rfind("routed: moh: ", 0) == 0; }

TEST(ThrowMacro, LayerShapeErrors) {
  moh::MHAConfig c;
  c.embed_dim = 16;
  c.num_heads = 4;
  const moh::MultiHeadAttention<float> layer(c, 1);
  EXPECT_TRUE(starts_routed(routed([&] { layer(moh::Tensor3<float>(1, 3, 8)); })));
  c.num_heads = 3;  // 16 is not a multiple of 3
  EXPECT_TRUE(starts_routed(routed([&] { moh::MultiHeadAttention<float> bad(c); })));
}

TEST(ThrowMacro, OpsAndRuntimeErrors) {
  const moh::Matrix<float> X(4, 3), W(5, 2);
  moh::Matrix<float> Y(4, 5);
  EXPECT_TRUE(starts_routed(routed([&] { moh::linear<float>(X, W, Y); })));
  EXPECT_TRUE(starts_routed(routed([] { moh::KvCache<float> cache(0, 1, 1, 1); })));
  EXPECT_TRUE(starts_routed(routed([] { moh::ThreadPool pool(0); })));
}

TEST(ThrowMacro, ErrorsInsidePoolTasks) {
  // A shape error raised inside a task of a pool of 2 threads reaches the caller as it was thrown.
  moh::ThreadPool pool(2);
  EXPECT_TRUE(starts_routed(routed([&] {
    moh::parallel_for(&pool, 8, [](std::int64_t task, int) {
      if (task == 5) moh::detail::fail("task ", task, " failed");
    });
  })));
}

TEST(ThrowMacro, IoErrors) {
  EXPECT_TRUE(starts_routed(routed([] { moh::SafeTensors::from_bytes({1, 2, 3}); })));
  EXPECT_TRUE(starts_routed(routed([] { moh::SafeTensors::open("/nonexistent/x.safetensors"); })));
  moh::SafeTensorsWriter w;
  EXPECT_TRUE(starts_routed(routed([&] { w.add("", std::vector<float>{1.0f}, {1}); })));
  const std::vector<std::uint8_t> empty_case = moh::SafeTensorsWriter().to_bytes();
  EXPECT_TRUE(starts_routed(routed([&] { moh::run_case(moh::SafeTensors::from_bytes(empty_case)); })));
}

}  // namespace
