// A warm forward call allocates nothing: this binary replaces the global operator new (every
// form) with one that counts, and checks that a second call of the same shape, with the same
// Workspace, makes no allocation on any thread, the pool's workers included. In its own binary,
// so that the replacement cannot hide allocations from, or slow down, the other tests.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "moh/moh.hpp"
#include "test_helpers.hpp"

// GCC cannot see that the replaced operators below pair malloc with free themselves.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {

std::atomic<bool> counting{false};
std::atomic<long> allocations{0};

void* allocate(std::size_t size, std::size_t align) {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1, std::memory_order_relaxed);
  if (size == 0) size = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(size);
  } else if (posix_memalign(&p, align, size) != 0) {
    p = nullptr;
  }
  return p;
}

}  // namespace

void* operator new(std::size_t size) {
  if (void* p = allocate(size, 0)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept { return allocate(size, 0); }
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept { return allocate(size, 0); }
void* operator new(std::size_t size, std::align_val_t align) {
  if (void* p = allocate(size, static_cast<std::size_t>(align))) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t align) { return operator new(size, align); }
void* operator new(std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  return allocate(size, static_cast<std::size_t>(align));
}
void* operator new[](std::size_t size, std::align_val_t align, const std::nothrow_t&) noexcept {
  return allocate(size, static_cast<std::size_t>(align));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

using moh::Index;
using moh_test::random_tensor;

/// Allocations made (on any thread) while `f` runs.
template <class F>
long allocations_of(F&& f) {
  allocations.store(0);
  counting.store(true);
  f();
  counting.store(false);
  return allocations.load();
}

/// Runs `call` twice with the same workspace and options: the first may allocate (it sizes the
/// workspace), the second must not.
template <class Call>
void expect_warm_call_allocates_nothing(Call&& call) {
  call();
  EXPECT_EQ(allocations_of(call), 0) << "a warm call allocated";
}

// The counter sees allocations: a control that would make the checks below vacuous otherwise.
TEST(Allocations, TheCounterCountsAllocations) {
  EXPECT_GT(allocations_of([] { ::operator delete(::operator new(16)); }), 0);
  EXPECT_GT(allocations_of([] { moh::Workspace w; moh::detail::WorkspaceAccess::call(w).allocate<float>(10); }), 0);
  // And a forward without a workspace allocates (a temporary one): the README says so.
  const moh::MultiHeadAttention<float> layer(moh_test::mha_config(32, 4), 1);
  moh::Tensor3<float> x = random_tensor<float>(1, 9, 32, 2), y(1, 9, 32);
  EXPECT_GT(allocations_of([&] { layer.forward(x, y); }), 0);
}

class WarmForward : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (GetParam() > 1) pool_ = std::make_unique<moh::ThreadPool>(GetParam());
    opts_.pool = pool_.get();
    opts_.workspace = &ws_;
  }
  std::unique_ptr<moh::ThreadPool> pool_;
  moh::Workspace ws_;
  moh::ForwardOptions opts_;
};

TEST_P(WarmForward, MultiHeadAttention) {
  const moh::MultiHeadAttention<float> layer(moh_test::mha_config(64, 4, 2), 1);
  const moh::Tensor3<float> x = random_tensor<float>(2, 300, 64, 2), memory = random_tensor<float>(2, 17, 64, 3);
  moh::Tensor3<float> y(2, 300, 64);
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, opts_); });
  expect_warm_call_allocates_nothing([&] { layer.forward_cross(x, memory, y, opts_); });
}

TEST_P(WarmForward, MoHLearnedRouter) {
  const moh::MoHAttention<float> layer(moh_test::moh_config(64, 8, 2, 2), 1);
  const moh::Tensor3<float> x = random_tensor<float>(2, 300, 64, 2), memory = random_tensor<float>(2, 17, 64, 3);
  moh::Tensor3<float> y(2, 300, 64);
  moh::MoHRouting<float> routing;
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, opts_); });
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, opts_, &routing); });
  expect_warm_call_allocates_nothing([&] { layer.forward_cross(x, memory, y, opts_, &routing); });
  moh::ForwardOptions dense = opts_;
  dense.mode = moh::ComputeMode::Dense;
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, dense, &routing); });
}

TEST_P(WarmForward, MoHQueryNormRouterWithRope) {
  const moh::MoHAttention<float> layer(
      moh_test::moh_config(64, 8, 2, 4, moh::MoHRouterKind::QueryNorm, 2, 0, false, true), 1);
  const moh::Tensor3<float> x = random_tensor<float>(1, 200, 64, 2);
  moh::Tensor3<float> y(1, 200, 64);
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, opts_); });
}

TEST_P(WarmForward, MoA) {
  const moh::MoAAttention<float> layer(moh_test::moa_config(64, 16, 8, 2), 1);
  const moh::Tensor3<float> x = random_tensor<float>(2, 300, 64, 2);
  moh::Tensor3<float> y(2, 300, 64);
  moh::MoARouting<float> routing;
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, opts_); });
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, opts_, &routing); });
  moh::ForwardOptions dense = opts_;
  dense.mode = moh::ComputeMode::Dense;
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, dense); });
}

TEST_P(WarmForward, MoHVitWithBiasAndProbabilities) {
  // Cosine attention keeps its position bias per grid: computed by the first call, then read.
  const moh::MoHAttention<float> layer(moh::MoHConfig::vit(64, 8, 2, 2, 7, 7), 1);
  const moh::Tensor3<float> x = random_tensor<float>(2, 49, 64, 2);
  moh::Tensor3<float> y(2, 49, 64);
  moh::Tensor4<float> bias(1, 8, 49, 49), probabilities(2, 8, 49, 49);
  bias.setZero();
  moh::ForwardOptions o = opts_;
  o.attn_bias = bias;
  o.attention_weights = probabilities;
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, opts_); });
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, o); });
  o.mode = moh::ComputeMode::Dense;
  expect_warm_call_allocates_nothing([&] { layer.forward(x, y, o); });
}

TEST_P(WarmForward, JetMoEWithQueryPaddingAndAMemoryCache) {
  moh::MoAConfig c = moh::MoAConfig::jetmoe(64, 4, 8, 2, 16);
  c.kdim = 24;
  const moh::MoAAttention<float> layer(c, 1);
  const moh::Tensor3<float> x = random_tensor<float>(2, 30, 64, 2), memory = random_tensor<float>(2, 17, 24, 3);
  moh::Tensor3<float> y(2, 30, 64);
  moh::Mask padding(2, 30);
  padding.setConstant(false);
  padding(1, 29) = true;
  moh::ForwardOptions o = opts_;
  o.query_padding_mask = moh::map_mask(padding);
  const moh::KvCache<float> cache = layer.make_memory_cache(memory, opts_);
  expect_warm_call_allocates_nothing([&] { layer.forward_cross(x, memory, y, o); });
  expect_warm_call_allocates_nothing([&] { layer.forward_cross(x, cache, y, o); });
}

TEST_P(WarmForward, DecodeSteps) {
  // A decode step of each layer, from a cache filled by a prompt: after the first step, the
  // next ones (one more cached token each) allocate nothing.
  const moh::MultiHeadAttention<float> mha(moh_test::mha_config(64, 4, 2, 0, false, true), 1);
  const moh::MoHAttention<float> moh_layer(
      moh_test::moh_config(64, 8, 2, 4, moh::MoHRouterKind::QueryNorm, 2, 0, false, true), 2);
  const moh::MoAAttention<float> moa(moh_test::moa_config(64, 16, 8, 2), 3);
  const moh::Tensor3<float> prompt = random_tensor<float>(2, 40, 64, 4), step = random_tensor<float>(2, 1, 64, 5);
  moh::Tensor3<float> y_prompt(2, 40, 64), y(2, 1, 64);
  auto decode = [&](const auto& layer) {
    auto cache = layer.make_cache(2, 64);
    layer.forward_cached(prompt, y_prompt, cache, opts_);
    layer.forward_cached(step, y, cache, opts_);
    EXPECT_EQ(allocations_of([&] { layer.forward_cached(step, y, cache, opts_); }), 0);
  };
  decode(mha);
  decode(moh_layer);
  decode(moa);
  decode(moh::MoAAttention<float>(moh::MoAConfig::jetmoe(64, 4, 8, 2, 16), 4));
}

TEST_P(WarmForward, Linear) {
  const moh::Matrix<float> X = moh_test::random_matrix<float>(200, 96, 1), W = moh_test::random_matrix<float>(130, 96, 2);
  const moh::Vector<float> b = moh_test::random_vector<float>(130, 3);
  moh::Matrix<float> Y(200, 130);
  expect_warm_call_allocates_nothing([&] { moh::linear<float>(X, W, b, Y, pool_.get(), &ws_); });
}

INSTANTIATE_TEST_SUITE_P(Threads, WarmForward, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "threads"; });

}  // namespace
