// runtime/tuning.hpp: the kernel tuning validates, round-trips, and changes no bit of a decode
// step (weights read 1 to 6 rows side by side; float caches prefetched or not).
#include "moh/runtime/tuning.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "moh/moh.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::KernelTuning;

/// Restores the process's tuning when a test ends.
struct TuningGuard {
  KernelTuning saved = moh::kernel_tuning();
  ~TuningGuard() { moh::set_kernel_tuning(saved); }
};

TEST(KernelTuning, RejectsStreamCountsOutOfRangeNamingTheValue) {
  for (int streams : {0, -1, KernelTuning::kMaxWeightStreams + 1}) {
    KernelTuning t;
    t.weight_streams = streams;
    try {
      t.validate();
      FAIL() << "accepted weight_streams " << streams;
    } catch (const moh::Error& e) {
      const std::string what = e.what();
      const std::string range =
          "weight_streams in [1, " + std::to_string(KernelTuning::kMaxWeightStreams) + "]";
      EXPECT_NE(what.find(range), std::string::npos) << what;
      EXPECT_NE(what.find("got " + std::to_string(streams)), std::string::npos) << what;
    }
  }
}

// CPUID words: leaf 0's ebx, edx, ecx spell the vendor; leaf 1's eax holds the family (base
// family 0xF plus the extended family for AMD's recent parts).
constexpr unsigned kAmd[3] = {0x68747541u, 0x69746e65u, 0x444d4163u};    // "AuthenticAMD"
constexpr unsigned kIntel[3] = {0x756e6547u, 0x49656e69u, 0x6c65746eu};  // "GenuineIntel"

TEST(KernelTuning, FloatCachesPrefetchedOnZen5AndLaterOnly) {
  const auto on = [](const unsigned* vendor, unsigned eax1) {
    return KernelTuning::for_cpu(moh::detail::cpu_id_from_words(vendor[0], vendor[1], vendor[2], eax1));
  };
  const KernelTuning defaults;
  ASSERT_FALSE(defaults.prefetch_float_cache);
  ASSERT_EQ(defaults.weight_streams, KernelTuning::kMaxWeightStreams);
  // Zen 5 (family 0x1A, an EPYC 9005 signature) and a later family: float caches prefetched,
  // the weights read in as many streams as elsewhere.
  for (unsigned eax1 : {0x00B00F21u, 0x00C00F00u}) {
    EXPECT_EQ(on(kAmd, eax1).weight_streams, defaults.weight_streams) << std::hex << eax1;
    EXPECT_TRUE(on(kAmd, eax1).prefetch_float_cache) << std::hex << eax1;
  }
  // Zen 4 (family 0x19), an Intel part with the same words, and an AMD part whose base family
  // is not 0xF (the extended family must then be ignored): the defaults.
  for (const auto& [vendor, eax1] : {std::pair<const unsigned*, unsigned>{kAmd, 0x00A10F11u},
                                     {kIntel, 0x00B00F21u},
                                     {kIntel, 0x000806F8u},
                                     {kAmd, 0x00B00621u}}) {
    const KernelTuning t = on(vendor, eax1);
    EXPECT_EQ(t.weight_streams, defaults.weight_streams) << std::hex << eax1;
    EXPECT_EQ(t.prefetch_float_cache, defaults.prefetch_float_cache) << std::hex << eax1;
  }
}

TEST(KernelTuning, CpuIdWordsDecodeToVendorFamilyAndModel) {
  using moh::CpuVendor;
  // An EPYC 9005 (Zen 5): base family 0xF + extended 0xB = 0x1A, model 0x0 + extended 0x2 << 4.
  const moh::CpuId zen5 = moh::detail::cpu_id_from_words(kAmd[0], kAmd[1], kAmd[2], 0x00B00F21u);
  EXPECT_EQ(zen5.vendor, CpuVendor::AMD);
  EXPECT_EQ(zen5.family, 0x1Au);
  EXPECT_EQ(zen5.model, 0x02u);
  // A Sapphire Rapids signature: family 6 takes the extended model too (0x8 << 4 | 0xF).
  const moh::CpuId intel =
      moh::detail::cpu_id_from_words(kIntel[0], kIntel[1], kIntel[2], 0x000806F8u);
  EXPECT_EQ(intel.vendor, CpuVendor::Intel);
  EXPECT_EQ(intel.family, 6u);
  EXPECT_EQ(intel.model, 0x8Fu);
  // A base family other than 0xF ignores the extended family; unknown vendors are Other.
  const moh::CpuId other = moh::detail::cpu_id_from_words(1u, 2u, 3u, 0x00B00621u);
  EXPECT_EQ(other.vendor, CpuVendor::Other);
  EXPECT_EQ(other.family, 6u);
}

TEST(KernelTuning, SetReplacesTheTuningAndABadOneLeavesItAlone) {
  const TuningGuard guard;
  EXPECT_NO_THROW(KernelTuning::for_this_cpu().validate());
  KernelTuning t;
  t.weight_streams = 4;
  t.prefetch_float_cache = true;
  moh::set_kernel_tuning(t);
  EXPECT_EQ(moh::kernel_tuning().weight_streams, 4);
  EXPECT_TRUE(moh::kernel_tuning().prefetch_float_cache);
  KernelTuning bad;
  bad.weight_streams = 0;
  bad.prefetch_float_cache = false;
  EXPECT_THROW(moh::set_kernel_tuning(bad), moh::Error);
  EXPECT_EQ(moh::kernel_tuning().weight_streams, 4);
  EXPECT_TRUE(moh::kernel_tuning().prefetch_float_cache);
}

// One row of A against long rows of W: every stream count gives the bits of one row at a time,
// for rows left over after the last whole step of parts too, from float, bfloat16 and double
// weights.
TEST(KernelTuning, WeightStreamsChangeNoBitOfADotProduct) {
  const TuningGuard guard;
  for (Index K : {Index(300), Index(1030)})
    for (Index count : {Index(1), Index(5), Index(7), Index(13), Index(29)}) {
      SCOPED_TRACE(testing::Message() << "K=" << K << " count=" << count);
      const moh::Matrix<float> A = moh_test::random_matrix<float>(1, K, 40);
      const moh::Matrix<float> W = moh_test::random_matrix<float>(count, K, 41);
      const moh::Matrix<double> Ad = A.cast<double>(), Wd = W.cast<double>();
      std::vector<std::uint16_t> w_bits(static_cast<std::size_t>(W.size()));
      for (Index i = 0; i < W.size(); ++i) w_bits[i] = moh::float_to_bfloat16(W.data()[i]);
      moh::Matrix<float> one(1, count), one_b(1, count);
      moh::Matrix<double> one_d(1, count);
      for (int streams = 1; streams <= KernelTuning::kMaxWeightStreams; ++streams) {
        KernelTuning t = guard.saved;
        t.weight_streams = streams;
        moh::set_kernel_tuning(t);
        moh::Matrix<float> c(1, count), c_b(1, count);
        moh::Matrix<double> c_d(1, count);
        moh::detail::rows_product<float>(A.data(), K, 1, W.data(), K, count, K, c.data(), count,
                                         false);
        moh::detail::rows_product<float>(A.data(), K, 1, w_bits.data(), K, count, K, c_b.data(),
                                         count, false);
        moh::detail::rows_product<double>(Ad.data(), K, 1, Wd.data(), K, count, K, c_d.data(),
                                          count, false);
        if (streams == 1) {
          one = c, one_b = c_b, one_d = c_d;
          EXPECT_LE(moh_test::max_abs_diff(c, Ad * Wd.transpose()), 1e-6 * (K + 2));
          EXPECT_LE(moh_test::max_abs_diff(c_d, Ad * Wd.transpose()), 1e-13 * (K + 2));
          continue;
        }
        EXPECT_TRUE(moh_test::BitEqual(c, one)) << streams << " streams";
        EXPECT_TRUE(moh_test::BitEqual(c_b, one_b)) << streams << " streams, bfloat16";
        EXPECT_TRUE(moh_test::BitEqual(c_d, one_d)) << streams << " streams, double";
      }
    }
}

// A whole decode (prompt, then steps) of one sequence and of two, dense GQA (4 query heads per
// key/value head: the prefetching few-query kernels) and MoH: the bits of every tuning. One
// sequence's products take weight_streams rows side by side, two sequences' the tiles, which
// ignore it. A prefetch cannot change a bit; switching it on here lets the sanitizer builds
// catch an address it computes outside the cache.
template <class Layer>
void expect_decode_independent_of_tuning(const typename Layer::Config& c, const std::string& what) {
  const TuningGuard guard;
  for (moh::WeightStorage storage : {moh::WeightStorage::Native, moh::WeightStorage::BFloat16})
    for (Index batch : {Index(1), Index(2)}) {
      typename Layer::Config config = c;
      config.weight_storage = storage;
      const Layer layer(config, 23);
      const moh::Tensor3<float> x = moh_test::random_tensor<float>(batch, 13, c.embed_dim, 24);
      moh::Tensor3<float> base;
      for (int streams : {1, 2, 3, 6})
        for (bool prefetch : {false, true}) {
          KernelTuning t;
          t.weight_streams = streams;
          t.prefetch_float_cache = prefetch;
          moh::set_kernel_tuning(t);
          const moh::Tensor3<float> y =
              moh_test::decode_prompt_then_steps(layer, x, 9, moh::ForwardOptions{});
          if (streams == 1 && !prefetch) {
            base = y;
            continue;
          }
          EXPECT_TRUE(moh_test::BitEqual(y, base))
              << what << (storage == moh::WeightStorage::BFloat16 ? " bf16" : " float")
              << ", batch " << batch << ", " << streams << " streams, prefetch " << prefetch;
        }
    }
}

TEST(KernelTuning, ChangesNoBitOfADecode) {
  // D = 512 (long weight rows), head_dim 32, 16 query heads over 4 key/value heads.
  expect_decode_independent_of_tuning<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(512, 16, 4, 32, /*bias=*/false, /*rope=*/true), "mha gqa");
  expect_decode_independent_of_tuning<moh::MoHAttention<float>>(
      moh_test::moh_config(512, 16, 4, 8, moh::MoHRouterKind::QueryNorm, 4, 32, false, true),
      "moh query-norm");
}

}  // namespace
