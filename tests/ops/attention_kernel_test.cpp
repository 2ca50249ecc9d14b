// Tests for moh/ops/attention_kernel.hpp: the tiled online-softmax kernel against a naive
// softmax(Q K^T * scale + mask) V (reference/naive_blocks.hpp) over key counts and query counts
// that cross the 256-key and 64-query blocks, odd head sizes, causal masks with and without a
// cache-style shift, key padding, rows that see nothing, gathered query positions, strided
// buffers, large scores; decode-sized groups of 3-4 queries over narrow and wide heads, prefetched
// and not; the scores of 1-4 queries against one chain per key, bit for bit;
// the weighted values of 1-4 queries against one chain per element, bit for bit;
// the same bits with and without a Workspace (reused across sizes); and
// the size and stride checks (moh::Error); and the route attend_route() gives the benchmark rows'
// heads.
#include "moh/ops/attention_kernel.hpp"
#include "moh/ops/detail/few_query.hpp"
#include "moh/runtime/tuning.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <random>
#include <vector>

#include "reference/naive_blocks.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh_test::BitEqual;
using moh_test::error_of;
using moh_test::Mentions;

/// One workspace shared by every run_case of the sweeps, so that it is reused across head sizes,
/// key counts and query counts (growing and shrinking) in both scalar types.
moh::Workspace& shared_workspace() {
  static moh::Workspace ws;
  return ws;
}

const Index kKeys[] = {1, 3, 17, 255, 256, 257, 600};
const Index kQueries[] = {1, 3, 64, 65, 130};
const Index kHeadDims[] = {3, 5, 12, 64};

struct Case {
  Index n_q, S, d;
  bool causal = false;
  Index shift = 0;
  std::vector<bool> padding = {};     // [S] or empty
  std::vector<Index> positions = {};  // [n_q] or empty (= 0, 1, ...)
  double scale = 0;                   // 0 = 1/sqrt(d)
};

/// Runs moh::attention on packed [n_q, d] / [S, d] inputs and the naive reference; returns
/// max |kernel - naive| / max(1, max |naive|). `out_copy` receives the kernel's output. The call
/// is made twice, without a workspace and with the shared one: the two must agree bitwise.
template <class T>
double run_case(const Case& c, std::uint64_t seed, Matrix<T>* out_copy = nullptr,
                double value_scale = 1.0) {
  Matrix<T> Q = moh_test::random_matrix<T>(c.n_q, c.d, seed, value_scale);
  Matrix<T> K = moh_test::random_matrix<T>(c.S, c.d, seed + 1, value_scale);
  if (value_scale > 1) {
    // Integer-valued queries and keys: float scores are then exact, so only the kernel's
    // softmax and accumulation differ from the double reference.
    Q = Q.array().round().matrix();
    K = K.array().round().matrix();
  }
  const Matrix<T> V = moh_test::random_matrix<T>(c.S, c.d, seed + 2);
  const double scale = c.scale != 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.d));
  std::vector<Index> pos = c.positions;
  if (pos.empty())
    for (Index i = 0; i < c.n_q; ++i) pos.push_back(i);
  std::unique_ptr<bool[]> pad(new bool[static_cast<std::size_t>(c.S)]);
  for (Index j = 0; j < c.S; ++j) pad[j] = !c.padding.empty() && c.padding[j];

  moh::AttentionMasking mask;
  mask.causal = c.causal;
  mask.causal_shift = c.shift;
  mask.key_padding = c.padding.empty() ? nullptr : pad.get();
  moh::QueryPositions qp;
  if (!c.positions.empty()) qp.list = c.positions.data();
  Matrix<T> O = Matrix<T>::Constant(c.n_q, c.d, T(123));
  Matrix<T> O_ws = Matrix<T>::Constant(c.n_q, c.d, T(-7));
  const moh::AttentionQueries<T> queries{Q.data(), c.d, c.n_q, c.d, static_cast<T>(scale), qp};
  const moh::AttentionKeysValues<T> kv{K.data(), c.d, V.data(), c.d, c.S};
  moh::attention<T>(queries, kv, mask, moh::AttentionOutput<T>{O.data(), c.d});
  moh::attention<T>(queries, kv, mask, moh::AttentionOutput<T>{O_ws.data(), c.d},
                    &shared_workspace());
  EXPECT_TRUE(BitEqual(O_ws, O)) << "with and without a workspace: n_q " << c.n_q << " S " << c.S
                                 << " d " << c.d;
  moh_test::NaiveMask nm{c.causal, c.shift, c.padding};
  const Matrix<double> want = moh_test::naive_attention(Q, K, V, pos, scale, nm);
  if (out_copy) *out_copy = O;
  return moh_test::max_abs_diff(O, want) / moh_test::scale_of(want);
}

std::vector<bool> random_padding(Index S, std::uint64_t seed, double p) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution pad(p);
  std::vector<bool> out(static_cast<std::size_t>(S));
  for (Index j = 0; j < S; ++j) out[j] = pad(rng);
  return out;
}

/// Puts the process's kernel tuning back when a test that changes it ends.
struct RestoreTuning {
  moh::KernelTuning t;
  ~RestoreTuning() { moh::set_kernel_tuning(t); }
};

constexpr double kFloatTol = 2e-6;
constexpr double kDoubleTol = 1e-13;

TEST(AttentionKernel, SweepNoMaskFloat) {
  for (Index S : kKeys)
    for (Index n_q : kQueries)
      for (Index d : kHeadDims) {
        Case c{n_q, S, d};
        EXPECT_LE(run_case<float>(c, 100 + S * 7 + n_q * 3 + d), kFloatTol)
            << "S " << S << " n_q " << n_q << " d " << d;
      }
}

TEST(AttentionKernel, SweepCausalSelfAndCacheShiftFloat) {
  // Shift 0: queries are the first n_q keys' positions (self-attention when S = n_q). Shift
  // S - n_q: bottom-right alignment, the last query sees every key (a KV cache); negative when
  // n_q > S, so the first queries see nothing (zeros).
  for (Index S : kKeys)
    for (Index n_q : kQueries)
      for (Index d : {Index(3), Index(12)}) {
        for (Index shift : {Index(0), S - n_q, Index(5)}) {
          Case c{n_q, S, d, true, shift};
          EXPECT_LE(run_case<float>(c, 200 + S + n_q + d), kFloatTol)
              << "S " << S << " n_q " << n_q << " d " << d << " shift " << shift;
        }
      }
}

TEST(AttentionKernel, SweepKeyPaddingFloat) {
  for (Index S : kKeys)
    for (Index n_q : {Index(1), Index(65), Index(130)})
      for (Index d : {Index(5), Index(64)})
        for (bool causal : {false, true}) {
          Case c{n_q, S, d, causal, causal ? S - n_q : 0, random_padding(S, S + d, 0.3)};
          EXPECT_LE(run_case<float>(c, 300 + S + n_q + d), kFloatTol)
              << "S " << S << " n_q " << n_q << " d " << d << " causal " << causal;
        }
}

TEST(AttentionKernel, DoubleAgreesToRounding) {
  for (Index S : {Index(3), Index(256), Index(257), Index(600)})
    for (Index n_q : {Index(1), Index(64), Index(65)})
      for (Index d : {Index(5), Index(12)}) {
        Case plain{n_q, S, d};
        EXPECT_LE(run_case<double>(plain, 400 + S + d), kDoubleTol) << S << " " << n_q << " " << d;
        Case masked{n_q, S, d, true, S - n_q, random_padding(S, 9 + S, 0.25)};
        EXPECT_LE(run_case<double>(masked, 500 + S + d), kDoubleTol) << S << " " << n_q << " " << d;
      }
}

TEST(AttentionKernel, RowWithNoVisibleKeyIsExactZero) {
  // All keys padding: every row is zeros (not NaN, not the 123 the buffer held).
  for (Index S : {Index(1), Index(300)}) {
    Case c{5, S, 7, false, 0, std::vector<bool>(static_cast<std::size_t>(S), true)};
    Matrix<float> O;
    EXPECT_EQ(run_case<float>(c, 1, &O), 0.0);
    for (Index i = 0; i < O.size(); ++i) ASSERT_EQ(O.data()[i], 0.0f) << "S " << S;
  }
  // Causal with shift -3 (3 more queries than keys): queries 0..2 see nothing, query 3 sees key 0.
  Case c{70, 67, 4, true, -3};
  Matrix<double> O;
  EXPECT_LE(run_case<double>(c, 2, &O), kDoubleTol);
  for (Index i = 0; i < 3; ++i)
    for (Index j = 0; j < 4; ++j) EXPECT_EQ(O(i, j), 0.0) << i;
  EXPECT_NE(O.row(3).norm(), 0.0);
  // Padding that hides exactly the keys a causal row could see: query 0 (sees key 0 only) with
  // key 0 padded outputs zeros, query 1 does not.
  std::vector<bool> pad(300, false);
  pad[0] = true;
  Case p{130, 300, 6, true, 0, pad};
  Matrix<float> P;
  EXPECT_LE(run_case<float>(p, 3, &P), kFloatTol);
  for (Index j = 0; j < 6; ++j) EXPECT_EQ(P(0, j), 0.0f);
  EXPECT_NE(P.row(1).norm(), 0.0f);
}

TEST(AttentionKernel, PaddingInLaterKeyBlockOnly) {
  // A whole 256-key block hidden for every query, with earlier and later blocks visible: the
  // online softmax must carry its running max/sum across the hidden block.
  std::vector<bool> pad(600, false);
  for (Index j = 256; j < 512; ++j) pad[j] = true;
  Case c{65, 600, 12, false, 0, pad};
  EXPECT_LE(run_case<float>(c, 77), kFloatTol);
  Case causal{65, 600, 12, true, 600 - 65, pad};
  EXPECT_LE(run_case<double>(causal, 78), kDoubleTol);
}

// A decode step's few queries (fewer than 8) read the keys in blocks of up to 16384 (as many as
// the score tile holds for them): the online softmax must carry across those long blocks too,
// for one query and for groups of 2 to 7, in float and double, with padding and a causal cache
// shift, and with a whole long block hidden. Head sizes: whole packets of 2, 4 and 8 (unrolled
// kernels) and 3 packets (the general loop).
TEST(AttentionKernel, FewQueriesOverSeveralLongKeyBlocks) {
  const Index L = moh::detail::packet_size<float>();
  for (Index n_q : {Index(1), Index(2), Index(3), Index(4), Index(7)}) {
    const Index block = std::max<Index>(256, 64 * 256 / n_q / 256 * 256);
    const Index S = 2 * block + 37;
    for (Index d : {2 * L, 3 * L, 4 * L, 8 * L}) {
      if (n_q > 2 && d > 4 * L) continue;  // the sizes that matter, in test time
      std::vector<bool> pad = random_padding(S, S + n_q + d, 0.2);
      for (Index j = block; j < 2 * block; ++j) pad[j] = true;  // the whole second block
      Case c{n_q, S, d, true, S - n_q, pad};
      EXPECT_LE(run_case<float>(c, 400 + n_q + d), 2 * kFloatTol)
          << "n_q " << n_q << " d " << d << " S " << S;
      Case open{n_q, S, d};
      EXPECT_LE(run_case<double>(open, 500 + n_q + d), kDoubleTol)
          << "n_q " << n_q << " d " << d << " S " << S;
    }
  }
}

// A decode step's group of 3 or 4 query heads: the weighted values go in groups of queries whose
// accumulators fit the registers (all of them over narrow heads; pairs or one by one over wide
// ones, each pass over runs of keys: value_run()), the scores one key at a time. Heads of 2-16
// packets, key counts around the runs, float and double, with padding and a causal cache shift;
// each case with the cache prefetched and not (KernelTuning::prefetch_float_cache), which must
// give the same bits.
TEST(AttentionKernel, FewQueriesInGroupsOverNarrowAndWideHeads) {
  const moh::KernelTuning saved = moh::kernel_tuning();
  const RestoreTuning restore{saved};
  const Index L = moh::detail::packet_size<float>();
  const Index Ld = moh::detail::packet_size<double>();
  for (Index n_q : {Index(3), Index(4)})
    for (Index packets : {Index(2), Index(3), Index(4), Index(5), Index(6), Index(8), Index(16)})
      for (Index S : {Index(129), Index(300)}) {
        Matrix<float> out[2];
        Matrix<double> out_d[2];
        for (bool prefetch : {false, true}) {
          moh::KernelTuning t = saved;
          t.prefetch_float_cache = prefetch;
          moh::set_kernel_tuning(t);
          Case c{n_q, S, packets * L, true, S - n_q, random_padding(S, S + packets, 0.2)};
          EXPECT_LE(run_case<float>(c, 700 + n_q + packets + S, &out[prefetch]), 2 * kFloatTol)
              << "n_q " << n_q << " d " << packets * L << " S " << S << " prefetch " << prefetch;
          Case open{n_q, S, packets * Ld};
          EXPECT_LE(run_case<double>(open, 800 + n_q + packets + S, &out_d[prefetch]), kDoubleTol)
              << "n_q " << n_q << " d " << packets * Ld << " S " << S << " prefetch " << prefetch;
        }
        EXPECT_TRUE(BitEqual(out[0], out[1])) << "n_q " << n_q << " packets " << packets;
        EXPECT_TRUE(BitEqual(out_d[0], out_d[1])) << "n_q " << n_q << " packets " << packets;
      }
}

// A bfloat16 cache is widened in registers: attention over it gives, bit for bit, what it
// gives over a float cache holding the widened keys and values, for the few-query kernels of
// a decode step (1-4 queries: scores four keys or one key at a time; value panels of one packet
// or of pairs of packets, where AVX-512 widens two packets per load), prefetched or not, and
// for the tiled path (9 queries).
TEST(AttentionKernel, BFloat16CacheGivesTheBitsOfItsWidenedFloats) {
  const moh::KernelTuning saved = moh::kernel_tuning();
  const RestoreTuning restore{saved};
  const Index L = moh::detail::packet_size<float>();
  for (Index n_q : {Index(1), Index(2), Index(3), Index(4), Index(9)})
    for (Index packets : {Index(1), Index(2), Index(3), Index(4), Index(6), Index(8), Index(16)})
      for (bool prefetch : {false, true}) {
        const Index S = 300, d = packets * L;
        SCOPED_TRACE(testing::Message() << "n_q " << n_q << " d " << d << " prefetch " << prefetch);
        moh::KernelTuning t = saved;
        t.prefetch_float_cache = prefetch;
        moh::set_kernel_tuning(t);
        const Matrix<float> Q = moh_test::random_matrix<float>(n_q, d, 60 + d);
        Matrix<float> K = moh_test::random_matrix<float>(S, d, 61 + d);
        Matrix<float> V = moh_test::random_matrix<float>(S, d, 62 + d);
        std::vector<std::uint16_t> k16(static_cast<std::size_t>(S * d)), v16(k16.size());
        for (Index i = 0; i < S * d; ++i) {
          k16[i] = moh::float_to_bfloat16(K.data()[i]);
          v16[i] = moh::float_to_bfloat16(V.data()[i]);
          K.data()[i] = moh::bfloat16_to_float(k16[i]);
          V.data()[i] = moh::bfloat16_to_float(v16[i]);
        }
        const std::vector<bool> padding = random_padding(S, 70 + d, 0.1);
        std::unique_ptr<bool[]> pad(new bool[static_cast<std::size_t>(S)]);
        for (Index j = 0; j < S; ++j) pad[j] = padding[j];
        moh::AttentionMasking mask;
        mask.causal = true;
        mask.causal_shift = S - n_q;
        mask.key_padding = pad.get();
        const moh::AttentionQueries<float> queries{
            Q.data(), d, n_q, d, 1.0f / std::sqrt(static_cast<float>(d)), moh::QueryPositions{}};
        Matrix<float> wide(n_q, d), narrow(n_q, d);
        moh::attention<float>(queries, moh::AttentionKeysValues<float>{K.data(), d, V.data(), d, S},
                              mask, moh::AttentionOutput<float>{wide.data(), d});
        moh::AttentionKeysValues<float> kv16{nullptr, d, nullptr, d, S};
        kv16.keys_bf16 = k16.data();
        kv16.values_bf16 = v16.data();
        moh::attention<float>(queries, kv16, mask, moh::AttentionOutput<float>{narrow.data(), d});
        EXPECT_TRUE(BitEqual(narrow, wide));
        moh_test::NaiveMask nm{true, S - n_q, padding};
        std::vector<Index> pos;
        for (Index i = 0; i < n_q; ++i) pos.push_back(i);
        const Matrix<double> want = moh_test::naive_attention(
            Q, K, V, pos, 1.0 / std::sqrt(static_cast<double>(d)), nm);
        EXPECT_LE(moh_test::max_abs_diff(narrow, want) / moh_test::scale_of(want), 2 * kFloatTol);
      }
}

/// Calls check(std::integral_constant<int, n>{}, d, row_stride, nk) for n = 1-4 queries, heads
/// of 1-16 float packets, rows at the head's size or 3 packets wider, and each key count given:
/// the sweep of the few-query kernels' bit tests.
template <class Check>
void sweep_few_queries(std::initializer_list<Index> key_counts, Check check) {
  const Index L = moh::detail::packet_size<float>();
  for (Index packets : {Index(1), Index(2), Index(4), Index(5), Index(8), Index(16)})
    for (Index extra : {Index(0), Index(3) * L})
      for (Index nk : key_counts) {
        const Index d = packets * L;
        check(std::integral_constant<int, 1>{}, d, d + extra, nk);
        check(std::integral_constant<int, 2>{}, d, d + extra, nk);
        check(std::integral_constant<int, 3>{}, d, d + extra, nk);
        check(std::integral_constant<int, 4>{}, d, d + extra, nk);
      }
}

// A decode step's few queries per key/value head: their scores (score_parts() parts of the keys
// side by side, one key of each at a time; with one part, one query over float keys: four keys at a
// time, sixteen where have_sums_of_sixteen() (rows back to back of 2, 4, 8 or 16 packets at fixed
// offsets, one_query_sixteen_keys<T, DS>); three or four queries: one key at a time) have the bits
// of one chain per (query, key) over the packets in order and Eigen's predux (what the tail
// computes), for 1-4 queries, key counts around multiples of 16 and of the parts, float and
// bfloat16 keys (widened in registers: the bits of their widened floats), and key rows at a stride
// wider than the head or back to back. Nothing is written past the last key.
TEST(AttentionKernel, FewQueryScoresHaveTheBitsOfOneChainPerKey) {
  using P = moh::detail::GemmPacket<float>;
  const Index L = moh::detail::packet_size<float>();
  const auto check = [&](auto queries, Index d, Index k_stride, Index nk) {
    constexpr int NQ = decltype(queries)::value;
    SCOPED_TRACE(testing::Message() << "queries " << NQ << " d " << d << " k_stride " << k_stride
                                    << " nk " << nk);
    const Index q_stride = d + L, ld = nk + 1;
    const Matrix<float> q = moh_test::random_matrix<float>(NQ, q_stride, 90 + d);
    Matrix<float> K =
        moh_test::random_matrix<float>(std::max<Index>(nk, 1), k_stride, 91 + d + nk);
    std::vector<std::uint16_t> k16(static_cast<std::size_t>(K.size()));
    const float scale = 0.37f;
    // Row-major: query r at q.data() + r * q_stride, key c at K.data() + c * k_stride.
    const float* k = K.data();
    std::vector<float> got(static_cast<std::size_t>(NQ * ld), -1.0f);
    const auto expect_chains = [&](const char* cache) {
      for (Index r = 0; r < NQ; ++r) {
        for (Index c = 0; c < nk; ++c) {
          P acc = Eigen::internal::pset1<P>(0.0f);
          for (Index x = 0; x < d; x += L)
            acc = Eigen::internal::pmadd(Eigen::internal::ploadu<P>(q.data() + r * q_stride + x),
                                         Eigen::internal::ploadu<P>(k + c * k_stride + x), acc);
          const float want = scale * Eigen::internal::predux(acc);
          const float g = got[static_cast<std::size_t>(r * ld + c)];
          ASSERT_EQ(std::memcmp(&g, &want, sizeof want), 0)
              << cache << " query " << r << " key " << c << ": " << g << " vs " << want;
        }
        EXPECT_EQ(got[static_cast<std::size_t>(r * ld + nk)], -1.0f)
            << cache << ": wrote past the last key";
      }
    };
    moh::detail::few_query_scores<float, NQ>(q.data(), q_stride, k, k_stride, nk, d, scale,
                                             got.data(), ld);
    expect_chains("float");
    // The same keys rounded to bfloat16: the bits of their widened floats.
    for (Index i = 0; i < K.size(); ++i) {
      k16[static_cast<std::size_t>(i)] = moh::float_to_bfloat16(K.data()[i]);
      K.data()[i] = moh::bfloat16_to_float(k16[static_cast<std::size_t>(i)]);
    }
    std::fill(got.begin(), got.end(), -1.0f);
    moh::detail::few_query_scores<float, NQ>(q.data(), q_stride, k16.data(), k_stride, nk, d,
                                             scale, got.data(), ld);
    expect_chains("bfloat16");
  };
  sweep_few_queries({0, 1, 15, 16, 17, 35, 48, 300}, check);
}

// fixed_key_rows(), which sends one query's scores to the fixed offsets of
// one_query_sixteen_keys<T, DS>, picks exactly the heads the sweep above expects there: float
// keys of 2, 4, 8 or 16 packets where have_sums_of_sixteen() (AVX-512 with DQ), rows at the
// head's size; never other head sizes, rows at a wider stride, bfloat16 keys or other targets.
// (Which path runs is checked only here: every path gives the same bits, which the sweep checks.)
TEST(AttentionKernel, FixedKeyRowsPicksCommonHeadsBackToBack) {
  const Index L = moh::detail::packet_size<float>();
  const bool sixteen = moh::detail::have_sums_of_sixteen<float>();
  for (Index packets : {Index(1), Index(2), Index(3), Index(4), Index(5), Index(8), Index(16),
                        Index(32)}) {
    const Index d = packets * L;
    const bool common = packets == 2 || packets == 4 || packets == 8 || packets == 16;
    EXPECT_EQ((moh::detail::fixed_key_rows<float, float>(d, d)), sixteen && common ? packets : 0)
        << "packets " << packets;
    EXPECT_EQ((moh::detail::fixed_key_rows<float, float>(d, d + L)), 0) << "packets " << packets;
    EXPECT_EQ((moh::detail::fixed_key_rows<float, std::uint16_t>(d, d)), 0)
        << "packets " << packets;
  }
  EXPECT_EQ((moh::detail::fixed_key_rows<float, float>(2 * L + 1, 2 * L + 1)), 0);
}

// local_queries(), which copies 2-4 float queries to fixed offsets for their scores, takes them
// only where their packets fit AVX-512's registers beside the step's sums and key packets (with
// AVX-512 float keys in 2 parts for 2 queries, bfloat16 keys in 4, one part for 3 or 4): 2 or 3
// queries of 8 packets, 4 of 4, never 4 of 8 (a LLaMA3-8B group, slower copied) nor 2 of 16
// packets, nor one query, nor a head size known only at run time (DP = 0), nor double queries,
// nor on other targets. (The bits are the same either way: the sweep above checks them.)
TEST(AttentionKernel, LocalQueriesOnlyWhereTheyFitTheRegisters) {
  using moh::detail::local_queries;
  const bool avx512 = moh::detail::packet_size<float>() == 16;
  EXPECT_EQ((local_queries<float, 2, 8, 2, 1>()), avx512);
  EXPECT_EQ((local_queries<float, 2, 8, 4, 1>()), avx512);  // 16 + 8 + 4 = 28
  EXPECT_EQ((local_queries<float, 3, 8, 1, 1>()), avx512);  // 24 + 3 + 1 = 28
  EXPECT_EQ((local_queries<float, 4, 4, 1, 1>()), avx512);
  EXPECT_FALSE((local_queries<float, 4, 8, 1, 1>()));  // 32 + 4 + 1 = 37
  EXPECT_FALSE((local_queries<float, 2, 16, 2, 1>()));
  EXPECT_FALSE((local_queries<float, 1, 8, 1, 4>()));
  EXPECT_FALSE((local_queries<float, 3, 0, 1, 1>()));
  EXPECT_FALSE((local_queries<double, 2, 4, 2, 1>()));
}

// A decode step's weighted values, A[r, :] += sum_c W[r, c] v_c, have the bits of one chain per
// element over the keys in order (Eigen's pmadd, packet by packet), whatever the groups of
// queries, the column panels and the runs of keys (value_run()) they are computed in: for 1-4
// queries, heads of 1-16 packets, key counts around the runs (64 float rows of 128 with AVX2,
// 128 otherwise), value rows at a stride wider than the head, float and bfloat16 values (widened
// in registers: the bits of their widened floats). Nothing is written past A's d columns.
TEST(AttentionKernel, FewQueryValuesHaveTheBitsOfOneChainPerElement) {
  using P = moh::detail::GemmPacket<float>;
  const Index L = moh::detail::packet_size<float>();
  const auto check = [&](auto queries, Index d, Index v_stride, Index nk) {
    constexpr int NQ = decltype(queries)::value;
    SCOPED_TRACE(testing::Message() << "queries " << NQ << " d " << d << " v_stride " << v_stride
                                    << " nk " << nk);
    const Index ldw = nk + 5, lda = d + L;
    const Matrix<float> W = moh_test::random_matrix<float>(NQ, ldw, 200 + d + nk);
    Matrix<float> V = moh_test::random_matrix<float>(std::max<Index>(nk, 1), v_stride, 201 + nk);
    std::vector<std::uint16_t> v16(static_cast<std::size_t>(V.size()));
    for (Index i = 0; i < V.size(); ++i) {
      v16[static_cast<std::size_t>(i)] = moh::float_to_bfloat16(V.data()[i]);
      V.data()[i] = moh::bfloat16_to_float(v16[static_cast<std::size_t>(i)]);
    }
    const Matrix<float> A0 = moh_test::random_matrix<float>(NQ, lda, 202 + d);
    // Row-major: W's row r at W.data() + r * ldw, value row c at V.data() + c * v_stride, A's row
    // r at A.data() + r * lda (A0's columns past d must survive).
    std::vector<float> want(static_cast<std::size_t>(A0.size()));
    std::memcpy(want.data(), A0.data(), want.size() * sizeof(float));
    for (Index r = 0; r < NQ; ++r)
      for (Index x = 0; x < d; x += L) {
        P acc = Eigen::internal::ploadu<P>(want.data() + r * lda + x);
        for (Index c = 0; c < nk; ++c)
          acc = Eigen::internal::pmadd(Eigen::internal::pset1<P>(W.data()[r * ldw + c]),
                                       Eigen::internal::ploadu<P>(V.data() + c * v_stride + x),
                                       acc);
        Eigen::internal::pstoreu(want.data() + r * lda + x, acc);
      }
    Matrix<float> got = A0, got16 = A0;
    moh::detail::few_query_values<float, NQ>(W.data(), ldw, V.data(), v_stride, nk, d,
                                             got.data(), lda);
    moh::detail::few_query_values<float, NQ>(W.data(), ldw, v16.data(), v_stride, nk, d,
                                             got16.data(), lda);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << "float";
    EXPECT_EQ(std::memcmp(got16.data(), want.data(), want.size() * sizeof(float)), 0)
        << "bfloat16";
  };
  sweep_few_queries({0, 1, 17, 63, 64, 65, 128, 129, 300}, check);
}

// The weighted values ask for the next run of values while they read the current one: every
// line of its rows once (from each row's first byte, 64 bytes apart), in order, none outside
// them (rows at a stride wider than the row, rows of part of a line), spread evenly over the
// steps they are given; none when there are no rows, none after the last row.
TEST(AttentionKernel, NextRunLinesAskForEachLineOfTheRunOnce) {
  const auto check = [](Index rows, Index stride, Index row_bytes, Index steps) {
    SCOPED_TRACE(testing::Message() << "rows " << rows << " stride " << stride << " row_bytes "
                                    << row_bytes << " steps " << steps);
    std::vector<char> buffer(static_cast<std::size_t>(std::max<Index>(1, rows * stride)));
    const char* first = buffer.data();
    auto next = moh::detail::NextRunLines::over(first, rows, stride, row_bytes, steps);
    std::vector<const char*> want;
    for (Index r = 0; r < rows; ++r)
      for (Index o = 0; o < row_bytes; o += 64) want.push_back(first + r * stride + o);
    std::vector<const char*> got;
    std::vector<Index> at;  // the step of each line
    for (Index i = 0; i < steps; ++i)
      if (const char* line = next.step()) {
        got.push_back(line);
        at.push_back(i);
      }
    if (static_cast<std::size_t>(steps) >= want.size()) {
      EXPECT_EQ(got, want);
    } else {  // fewer steps than lines: the first `steps` lines, one per step
      ASSERT_EQ(got.size(), static_cast<std::size_t>(steps));
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()));
    }
    for (Index i = 0; i < 3 * steps + 10 && got.size() < want.size(); ++i)
      if (const char* line = next.step()) got.push_back(line);
    EXPECT_EQ(got, want) << "every line once, in order, when given steps enough";
    for (Index i = 0; i < 3 * steps + 10; ++i) EXPECT_EQ(next.step(), nullptr) << "past the run";
    // Evenly spread: the same number of steps before each line.
    for (std::size_t i = 1; i < at.size(); ++i) EXPECT_EQ(at[i] - at[i - 1], at[0] + 1);
  };
  check(64, 512, 512, 512);    // float rows of 128, as many steps as lines
  check(128, 256, 256, 1024);  // bfloat16 rows of 128, two steps per line
  check(16, 1024, 256, 200);   // rows at a stride of 4 rows, 3 steps per line
  check(16, 96, 96, 20);       // rows of a line and a half, fewer steps than lines
  check(0, 256, 256, 64);
  check(5, 64, 32, 1000);
}

// Two one-query heads' weighted values in one pass (few_query_values_pair()) have the bits of
// each alone (few_query_values(), one chain per element over the keys in order), for equal and
// unequal key counts (the longer one's last keys alone), none, and from accumulators not zero;
// heads of one value panel and of half of one.
TEST(AttentionKernel, PairedValuesHaveEachQuerysBitsAlone) {
  const auto heads_of = [](auto packets) {
    constexpr int NP = decltype(packets)::value;
    const Index d = NP * moh::detail::packet_size<float>();
    SCOPED_TRACE(testing::Message() << "head_dim " << d);
    ASSERT_EQ(moh::detail::paired_values_packets<float>(d), NP);
    const Index stride = d + 8;  // rows wider than the head
    for (const auto& n : std::vector<std::pair<Index, Index>>{
             {0, 0}, {0, 5}, {17, 300}, {300, 17}, {64, 64}, {1, 1}}) {
      SCOPED_TRACE(testing::Message() << "keys " << n.first << " and " << n.second);
      const Index n0 = n.first, n1 = n.second;
      const Matrix<float> W = moh_test::random_matrix<float>(2, 301, 300 + n0);
      const Matrix<float> V0 = moh_test::random_matrix<float>(301, stride, 301 + n0);
      const Matrix<float> V1 = moh_test::random_matrix<float>(301, stride, 302 + n1);
      const Matrix<float> A = moh_test::random_matrix<float>(2, d, 303);
      Matrix<float> want = A, got = A;
      moh::detail::few_query_values<float, 1>(W.data(), 0, V0.data(), stride, n0, d,
                                              want.data(), 0);
      moh::detail::few_query_values<float, 1>(W.data() + 301, 0, V1.data(), stride, n1, d,
                                              want.data() + d, 0);
      moh::detail::few_query_values_pair<float, NP>(W.data(), V0.data(), stride, n0, got.data(),
                                                    W.data() + 301, V1.data(), stride, n1,
                                                    got.data() + d);
      EXPECT_TRUE(BitEqual(got, want));
    }
  };
  heads_of(std::integral_constant<int, moh::detail::kPairedPanel>{});      // one panel
  heads_of(std::integral_constant<int, moh::detail::kPairedHalfPanel>{});  // half of one
}

// attend() with `defer` stops one query of a head of one value panel (or half of one) before
// its weighted values, and finish_values() then writes the bits attend() writes without it: two
// heads in one pass, or one; keys visible, partly hidden (causal, padding) or all hidden
// (nothing pending: zeros). What it cannot defer it attends whole: a bias, probabilities, keys
// past the caller's room, more than one block of keys, a head of two panels or of three halves.
TEST(AttentionKernel, DeferredValuesFinishWithTheBitsOfAttend) {
  const Index L = moh::detail::packet_size<float>();
  const Index full = moh::detail::kPairedPanel * L, half = moh::detail::kPairedHalfPanel * L;
  const float scale = 0.3f;
  moh::detail::Arena arena;
  const auto run = [&](const Matrix<float>& q, const Matrix<float>& K, const Matrix<float>& V,
                       Index S, const moh::AttentionMasking& mask, float* out,
                       moh::detail::DeferredValues<float>* defer,
                       const moh::AttentionBias<float>& bias = {},
                       const moh::AttentionWeights<float>& weights = {}) {
    moh::detail::attend<float>(
        moh::AttentionQueries<float>{q.data(), q.cols(), 1, q.cols(), scale, {nullptr, 0}},
        moh::AttentionKeysValues<float>{K.data(), K.cols(), V.data(), V.cols(), S}, mask,
        moh::AttentionOutput<float>{out, q.cols()}, arena, nullptr, bias, weights, defer);
  };
  for (const Index d : {full, half}) {
    SCOPED_TRACE(testing::Message() << "head_dim " << d);
    for (const Index S : {Index(1), Index(37), Index(300)}) {
      std::unique_ptr<bool[]> padding(new bool[static_cast<std::size_t>(S)]);
      for (Index j = 0; j < S; ++j) padding[j] = j % 5 == 3;
      std::unique_ptr<bool[]> all_padded(new bool[static_cast<std::size_t>(S)]);
      std::fill(all_padded.get(), all_padded.get() + S, true);
      const moh::AttentionMasking masks[] = {
          {false, 0, nullptr},          // every key
          {true, S / 2 - 1, nullptr},   // position 0 sees keys 0 .. S / 2 - 1 (none when S is 1)
          {false, 0, padding.get()},    // some keys padding
          {false, 0, all_padded.get()}  // nothing to see
      };
      for (const moh::AttentionMasking& mask : masks) {
        SCOPED_TRACE(testing::Message() << "S " << S << " causal " << mask.causal << " padding "
                                        << (mask.key_padding != nullptr));
        Matrix<float> q[2], K[2], V[2], want[2], got[2];
        for (int h = 0; h < 2; ++h) {
          q[h] = moh_test::random_matrix<float>(1, d, 400 + h);
          K[h] = moh_test::random_matrix<float>(S, d, 402 + h + S);
          V[h] = moh_test::random_matrix<float>(S, d, 404 + h + S);
          want[h] = got[h] = moh_test::random_matrix<float>(1, d, 406);
          run(q[h], K[h], V[h], S, mask, want[h].data(), nullptr);
        }
        std::vector<float> room(static_cast<std::size_t>(2 * S + 2 * d));
        for (const int count : {1, 2}) {
          moh::detail::DeferredValues<float> deferred[2];
          for (int h = 0; h < count; ++h) {
            deferred[h].w = room.data() + h * S;
            deferred[h].capacity = S;
            run(q[h], K[h], V[h], S, mask, got[h].data(), &deferred[h]);
            const bool sees = mask.key_padding != all_padded.get() && (!mask.causal || S >= 2);
            EXPECT_EQ(deferred[h].pending, sees) << "head " << h;
          }
          moh::detail::finish_values(deferred, count, d, room.data() + 2 * S);
          for (int h = 0; h < count; ++h) {
            EXPECT_FALSE(deferred[h].pending);
            EXPECT_TRUE(BitEqual(got[h], want[h])) << count << " heads, head " << h;
          }
        }
      }
      // Head 0 sees nothing (not pending), head 1 does: finish_values() takes the second alone.
      {
        const Matrix<float> q = moh_test::random_matrix<float>(1, d, 430);
        const Matrix<float> K = moh_test::random_matrix<float>(S, d, 431);
        const Matrix<float> V = moh_test::random_matrix<float>(S, d, 432);
        const moh::AttentionMasking hidden{false, 0, all_padded.get()}, seen{false, 0, nullptr};
        Matrix<float> want[2], got[2];
        for (int h = 0; h < 2; ++h) {
          want[h] = got[h] = Matrix<float>::Constant(1, d, 5.0f);
          run(q, K, V, S, h == 0 ? hidden : seen, want[h].data(), nullptr);
        }
        std::vector<float> room(static_cast<std::size_t>(2 * S + 2 * d));
        moh::detail::DeferredValues<float> deferred[2];
        for (int h = 0; h < 2; ++h) {
          deferred[h].w = room.data() + h * S;
          deferred[h].capacity = S;
          run(q, K, V, S, h == 0 ? hidden : seen, got[h].data(), &deferred[h]);
        }
        EXPECT_FALSE(deferred[0].pending);
        EXPECT_TRUE(deferred[1].pending);
        moh::detail::finish_values(deferred, 2, d, room.data() + 2 * S);
        EXPECT_TRUE(BitEqual(got[0], want[0])) << "nothing seen: zeros";
        EXPECT_TRUE(BitEqual(got[1], want[1])) << "the second alone";
      }
      // Not deferred, attended whole: the same bits as without `defer`.
      const Matrix<float> q = moh_test::random_matrix<float>(1, d, 410);
      const Matrix<float> K = moh_test::random_matrix<float>(S, 2 * d, 411);
      const Matrix<float> V = moh_test::random_matrix<float>(S, 2 * d, 412);
      const Matrix<float> bias_row = moh_test::random_matrix<float>(1, S, 413);
      std::vector<float> probabilities(static_cast<std::size_t>(S));
      std::vector<float> room(static_cast<std::size_t>(S));
      const moh::AttentionMasking all{false, 0, nullptr};
      const auto expect_whole = [&](const char* what, Index capacity,
                                    const moh::AttentionBias<float>& bias,
                                    const moh::AttentionWeights<float>& weights) {
        Matrix<float> want = Matrix<float>::Zero(1, d), got = Matrix<float>::Constant(1, d, 7.0f);
        run(q, K, V, S, all, want.data(), nullptr, bias, weights);
        moh::detail::DeferredValues<float> deferred;
        deferred.w = room.data();
        deferred.capacity = capacity;
        deferred.pending = true;  // attend() clears it
        run(q, K, V, S, all, got.data(), &deferred, bias, weights);
        EXPECT_FALSE(deferred.pending) << what;
        EXPECT_TRUE(BitEqual(got, want)) << what;
      };
      expect_whole("bias", S, moh::AttentionBias<float>{bias_row.data(), 0, nullptr}, {});
      expect_whole("probabilities", S, {},
                   moh::AttentionWeights<float>{probabilities.data(), S, nullptr});
      expect_whole("room for fewer keys", S - 1, {}, {});
    }
    // Keys past one block (a one-query block holds 16384), and (once) heads of two panels and of
    // three halves: attended whole.
    std::vector<std::pair<Index, Index>> shapes{{16384 + 5, d}};
    if (d == full) shapes.insert(shapes.end(), {{40, 2 * full}, {40, 3 * half}});
    for (const auto& shape : shapes) {
      const Index S = shape.first, width = shape.second;
      SCOPED_TRACE(testing::Message() << "S " << S << " d " << width);
      const Matrix<float> q = moh_test::random_matrix<float>(1, width, 420);
      const Matrix<float> K = moh_test::random_matrix<float>(S, width, 421);
      const Matrix<float> V = moh_test::random_matrix<float>(S, width, 422);
      Matrix<float> want(1, width), got(1, width);
      std::vector<float> room(static_cast<std::size_t>(S));
      run(q, K, V, S, {false, 0, nullptr}, want.data(), nullptr);
      moh::detail::DeferredValues<float> deferred;
      deferred.w = room.data();
      deferred.capacity = S;
      run(q, K, V, S, {false, 0, nullptr}, got.data(), &deferred);
      EXPECT_FALSE(deferred.pending);
      EXPECT_TRUE(BitEqual(got, want));
    }
  }
}

TEST(AttentionKernel, GatheredQueryPositions) {
  // Queries of a routed head: a subset of the tokens of a 300-token sequence, at ascending
  // positions given as a list; causal shift 0 (self) and 40 (40 cached keys before them).
  const Index T = 300;
  std::mt19937_64 rng(5);
  std::bernoulli_distribution keep(0.45);
  std::vector<Index> positions;
  for (Index t = 0; t < T; ++t)
    if (keep(rng) || t == 0 || t == 63 || t == 64 || t == T - 1) positions.push_back(t);
  ASSERT_GT(positions.size(), 64u);  // more than one query block
  for (Index shift : {Index(0), Index(40)}) {
    Case c{static_cast<Index>(positions.size()), T + shift, 6, true, shift};
    c.positions = positions;
    EXPECT_LE(run_case<float>(c, 600 + shift), kFloatTol) << "shift " << shift;
    EXPECT_LE(run_case<double>(c, 700 + shift), kDoubleTol) << "shift " << shift;
  }
  // A short list of far-apart positions, with padding as well.
  Case few{5, 600, 5, true, 0, random_padding(600, 4, 0.2)};
  few.positions = {0, 2, 255, 256, 599};
  EXPECT_LE(run_case<double>(few, 800), kDoubleTol);
  // Gathered rows equal the same rows of the full causal computation.
  Case full{T, T, 6, true, 0};
  Matrix<double> all;
  run_case<double>(full, 900, &all);
  const Matrix<double> Qall = moh_test::random_matrix<double>(T, 6, 900);
  const Matrix<double> K = moh_test::random_matrix<double>(T, 6, 901);
  const Matrix<double> V = moh_test::random_matrix<double>(T, 6, 902);
  Matrix<double> Qg(static_cast<Index>(positions.size()), 6), Og(Qg.rows(), 6);
  for (Index i = 0; i < Qg.rows(); ++i) Qg.row(i) = Qall.row(positions[i]);
  moh::attention<double>(
      moh::AttentionQueries<double>{Qg.data(), 6, Qg.rows(), 6, 1.0 / std::sqrt(6.0),
                                    moh::QueryPositions{positions.data(), 0}},
      moh::AttentionKeysValues<double>{K.data(), 6, V.data(), 6, T},
      moh::AttentionMasking{true, 0, nullptr}, moh::AttentionOutput<double>{Og.data(), 6});
  for (Index i = 0; i < Qg.rows(); ++i)
    EXPECT_LE((Og.row(i) - all.row(positions[i])).cwiseAbs().maxCoeff(), kDoubleTol) << i;
}

TEST(AttentionKernel, QueryPositionsFirstOffset) {
  // QueryPositions{nullptr, first}: queries at first, first + 1, ... (a later query block).
  const Index S = 200, n_q = 70, first = 100, d = 8;
  const Matrix<double> Q = moh_test::random_matrix<double>(n_q, d, 31);
  const Matrix<double> K = moh_test::random_matrix<double>(S, d, 32);
  const Matrix<double> V = moh_test::random_matrix<double>(S, d, 33);
  Matrix<double> O(n_q, d);
  moh::attention<double>(
      moh::AttentionQueries<double>{Q.data(), d, n_q, d, 0.25, moh::QueryPositions{nullptr, first}},
      moh::AttentionKeysValues<double>{K.data(), d, V.data(), d, S},
      moh::AttentionMasking{true, 0, nullptr}, moh::AttentionOutput<double>{O.data(), d});
  std::vector<Index> pos;
  for (Index i = 0; i < n_q; ++i) pos.push_back(first + i);
  const Matrix<double> want =
      moh_test::naive_attention(Q, K, V, pos, 0.25, moh_test::NaiveMask{true, 0, {}});
  EXPECT_LE(moh_test::max_abs_diff(O, want), kDoubleTol);
}

TEST(AttentionKernel, StridedBuffers) {
  // Q, K, V and O live inside wider row-major buffers (like heads inside a [tokens, H*d] or
  // [tokens, 3*H*d] matrix); columns outside the views stay untouched.
  const Index n_q = 70, S = 260, d = 5;
  const Index q_stride = 13, kv_stride = 3 * d + 2, o_stride = 11;
  Matrix<float> QB = moh_test::random_matrix<float>(n_q, q_stride, 41);
  Matrix<float> KVB = moh_test::random_matrix<float>(S, kv_stride, 42);
  Matrix<float> OB = Matrix<float>::Constant(n_q, o_stride, -5.0f);
  const std::vector<bool> pad = random_padding(S, 43, 0.2);
  std::unique_ptr<bool[]> padb(new bool[S]);
  for (Index j = 0; j < S; ++j) padb[j] = pad[j];
  const float* q = QB.data() + 4;           // columns 4..8
  const float* k = KVB.data() + 1;          // columns 1..5
  const float* v = KVB.data() + 2 * d + 1;  // columns 11..15
  moh::attention<float>(
      moh::AttentionQueries<float>{q, q_stride, n_q, d, 0.4f, moh::QueryPositions{}},
      moh::AttentionKeysValues<float>{k, kv_stride, v, kv_stride, S},
      moh::AttentionMasking{true, S - n_q, padb.get()},
      moh::AttentionOutput<float>{OB.data() + 3, o_stride});
  const Matrix<float> Q = QB.middleCols(4, d), K = KVB.middleCols(1, d),
                      V = KVB.middleCols(2 * d + 1, d);
  std::vector<Index> pos;
  for (Index i = 0; i < n_q; ++i) pos.push_back(i);
  const Matrix<double> want =
      moh_test::naive_attention(Q, K, V, pos, 0.4, moh_test::NaiveMask{true, S - n_q, pad});
  EXPECT_LE(moh_test::max_abs_diff(OB.middleCols(3, d), want), kFloatTol);
  for (Index i = 0; i < n_q; ++i)
    for (Index c = 0; c < o_stride; ++c) {
      if (c < 3 || c >= 3 + d) {
        ASSERT_EQ(OB(i, c), -5.0f) << i << "," << c;
      }
    }
}

TEST(AttentionKernel, LargeScoresStayFinite) {
  // Scores of several thousand (integer |q|, |k| up to 40 with d = 12 and scale 1: |q.k| up to
  // 19200, typically ~2000) would overflow exp() without the running max; the largest scores sit
  // in different key blocks for different rows, so the online rescaling is exercised.
  Case c{65, 600, 12, false, 0, {}, {}, 1.0};
  Matrix<float> O;
  const double err = run_case<float>(c, 55, &O, 40.0);
  EXPECT_TRUE(O.allFinite());
  EXPECT_LE(err, 1e-5);
  Case causal{130, 600, 12, true, 470, {}, {}, 1.0};
  EXPECT_LE(run_case<double>(causal, 56, nullptr, 40.0), 1e-12);
}

TEST(AttentionKernel, WorkspaceReuseAcrossHeadSizes) {
  // One workspace reused for d = 64, then d = 3, 17 and 64 again gives what a fresh workspace
  // and no workspace give, bitwise; a repeated call does not grow it, and it holds nothing in use
  // between calls.
  moh::Workspace shared;
  for (Index d : {Index(64), Index(3), Index(17), Index(64)}) {
    const Index n_q = 65, S = 257;
    const Matrix<float> Q = moh_test::random_matrix<float>(n_q, d, d);
    const Matrix<float> K = moh_test::random_matrix<float>(S, d, d + 1);
    const Matrix<float> V = moh_test::random_matrix<float>(S, d, d + 2);
    Matrix<float> A(n_q, d), B(n_q, d), C(n_q, d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const moh::AttentionQueries<float> queries{Q.data(), d, n_q, d, scale, moh::QueryPositions{}};
    const moh::AttentionKeysValues<float> kv{K.data(), d, V.data(), d, S};
    const moh::AttentionMasking mask{true, S - n_q, nullptr};
    moh::attention<float>(queries, kv, mask, moh::AttentionOutput<float>{A.data(), d}, &shared);
    moh::Workspace fresh;
    moh::attention<float>(queries, kv, mask, moh::AttentionOutput<float>{B.data(), d}, &fresh);
    moh::attention<float>(queries, kv, mask, moh::AttentionOutput<float>{C.data(), d});
    EXPECT_TRUE(BitEqual(A, B)) << "d " << d;
    EXPECT_TRUE(BitEqual(A, C)) << "d " << d;
    EXPECT_GT(fresh.bytes(), 0u);
    EXPECT_EQ(moh::detail::WorkspaceAccess::call(shared).in_use(), 0u);
    const std::size_t warm = shared.bytes();
    moh::attention<float>(queries, kv, mask, moh::AttentionOutput<float>{A.data(), d}, &shared);
    EXPECT_EQ(shared.bytes(), warm) << "d " << d;
    EXPECT_TRUE(BitEqual(A, C)) << "d " << d;
  }
  shared.release();
  EXPECT_EQ(shared.bytes(), 0u);
}

TEST(AttentionKernel, SingleVisibleKeyCopiesItsValue) {
  // With exactly one visible key the softmax is 1 on it and the output is that value row, exactly.
  const Index S = 300, d = 7;
  const Matrix<float> Q = moh_test::random_matrix<float>(1, d, 61);
  const Matrix<float> K = moh_test::random_matrix<float>(S, d, 62);
  const Matrix<float> V = moh_test::random_matrix<float>(S, d, 63);
  std::unique_ptr<bool[]> pad(new bool[S]);
  for (Index j = 0; j < S; ++j) pad[j] = j != 280;
  Matrix<float> O(1, d);
  moh::attention<float>(moh::AttentionQueries<float>{Q.data(), d, 1, d, 0.3f, moh::QueryPositions{}},
                        moh::AttentionKeysValues<float>{K.data(), d, V.data(), d, S},
                        moh::AttentionMasking{false, 0, pad.get()},
                        moh::AttentionOutput<float>{O.data(), d});
  EXPECT_EQ(O, V.row(280));
}

TEST(AttentionKernel, NoKeysGivesZerosAndNoQueriesWritesNothing) {
  // S = 0: nothing to see, every row is zeros (the naive reference says the same); the keys and
  // values may then be null with any stride. n_q = 0: nothing is read or written.
  for (bool causal : {false, true}) {
    Case c{5, 0, 7, causal, causal ? -5 : 0};
    Matrix<double> O;
    EXPECT_EQ(run_case<double>(c, 71, &O), 0.0);
    EXPECT_EQ(O, Matrix<double>::Zero(5, 7));
  }
  const Matrix<float> Q = moh_test::random_matrix<float>(3, 4, 72);
  Matrix<float> O = Matrix<float>::Constant(3, 4, 9.0f);
  moh::attention<float>(moh::AttentionQueries<float>{Q.data(), 4, 3, 4, 0.5f, moh::QueryPositions{}},
                        moh::AttentionKeysValues<float>{nullptr, 0, nullptr, 0, 0},
                        moh::AttentionMasking{}, moh::AttentionOutput<float>{O.data(), 4});
  EXPECT_EQ(O, Matrix<float>::Zero(3, 4));
  const Matrix<float> K = moh_test::random_matrix<float>(6, 4, 73);
  moh::Workspace ws;
  EXPECT_NO_THROW(moh::attention<float>(
      moh::AttentionQueries<float>{nullptr, 4, 0, 4, 0.5f, moh::QueryPositions{}},
      moh::AttentionKeysValues<float>{K.data(), 4, K.data(), 4, 6}, moh::AttentionMasking{true, 0, nullptr},
      moh::AttentionOutput<float>{nullptr, 4}, &ws));
}

// Sizes, pointers and strides are checked in every build: a moh::Error that names what was
// expected and what was given, before anything is written (the output keeps its values), and a
// workspace passed to a call that failed stays usable.
TEST(AttentionKernel, ChecksSizesPointersAndStrides) {
  const Index n_q = 3, S = 5, d = 4;
  const Matrix<float> Q = moh_test::random_matrix<float>(n_q, d, 81);
  const Matrix<float> K = moh_test::random_matrix<float>(S, d, 82);
  const Matrix<float> V = moh_test::random_matrix<float>(S, d, 83);
  Matrix<float> O = Matrix<float>::Constant(n_q, d, 4.0f);
  const Matrix<float> before = O;
  const moh::AttentionQueries<float> q{Q.data(), d, n_q, d, 0.5f, moh::QueryPositions{}};
  const moh::AttentionKeysValues<float> kv{K.data(), d, V.data(), d, S};
  const moh::AttentionOutput<float> out{O.data(), d};
  const moh::AttentionMasking mask{true, S - n_q, nullptr};
  moh::Workspace ws;
  for (moh::Workspace* w : {static_cast<moh::Workspace*>(nullptr), &ws}) {
    auto message = [&](moh::AttentionQueries<float> q2, moh::AttentionKeysValues<float> kv2,
                       moh::AttentionOutput<float> out2) {
      return error_of([&] { moh::attention<float>(q2, kv2, mask, out2, w); });
    };
    moh::AttentionQueries<float> bad = q;
    bad.head_dim = 0;
    EXPECT_TRUE(Mentions(message(bad, kv, out),
                         {"attention: sizes", "head_dim > 0", "got 3, 0, 5"}));
    bad.head_dim = -4;
    EXPECT_TRUE(Mentions(message(bad, kv, out), {"attention: sizes", "got 3, -4, 5"}));
    bad = q;
    bad.count = -1;
    EXPECT_TRUE(Mentions(message(bad, kv, out), {"attention: sizes", "queries >= 0", "got -1, 4, 5"}));
    moh::AttentionKeysValues<float> bad_kv = kv;
    bad_kv.count = -2;
    EXPECT_TRUE(Mentions(message(q, bad_kv, out), {"attention: sizes", "keys >= 0", "got 3, 4, -2"}));

    bad = q;
    bad.data = nullptr;
    EXPECT_TRUE(Mentions(message(bad, kv, out),
                         {"attention", "query and output data for 3 queries", "null pointer"}));
    EXPECT_TRUE(Mentions(message(q, kv, moh::AttentionOutput<float>{nullptr, d}),
                         {"attention", "query and output data for 3 queries", "null pointer"}));
    bad_kv = kv;
    bad_kv.keys = nullptr;
    EXPECT_TRUE(Mentions(message(q, bad_kv, out),
                         {"attention", "key and value data for 5 keys", "null pointer"}));
    bad_kv = kv;
    bad_kv.values = nullptr;
    EXPECT_TRUE(Mentions(message(q, bad_kv, out),
                         {"attention", "key and value data for 5 keys", "null pointer"}));

    // A row stride shorter than a head, for each of the four buffers.
    bad = q;
    bad.stride = d - 1;
    EXPECT_TRUE(Mentions(message(bad, kv, out),
                         {"attention: row strides must hold a head", "expected >= 4",
                          "got queries 3, keys 4, values 4, output 4"}));
    bad_kv = kv;
    bad_kv.key_stride = 2;
    EXPECT_TRUE(Mentions(message(q, bad_kv, out), {"row strides", "got queries 4, keys 2, values 4, output 4"}));
    bad_kv = kv;
    bad_kv.value_stride = 0;
    EXPECT_TRUE(Mentions(message(q, bad_kv, out), {"row strides", "got queries 4, keys 4, values 0, output 4"}));
    EXPECT_TRUE(Mentions(message(q, kv, moh::AttentionOutput<float>{O.data(), 3}),
                         {"row strides", "got queries 4, keys 4, values 4, output 3"}));
    EXPECT_TRUE(BitEqual(O, before));

    // The error is a moh::Error (a std::invalid_argument) ...
    bad = q;
    bad.stride = 1;
    EXPECT_THROW(moh::attention<float>(bad, kv, mask, out, w), std::invalid_argument);
    // ... and the same call with valid sizes runs, also on the workspace a failed call was given.
    Matrix<float> good(n_q, d), plain(n_q, d);
    EXPECT_NO_THROW(moh::attention<float>(q, kv, mask, moh::AttentionOutput<float>{good.data(), d}, w));
    moh::attention<float>(q, kv, mask, moh::AttentionOutput<float>{plain.data(), d});
    EXPECT_TRUE(BitEqual(good, plain));
  }
  // Wider strides than the head are fine (heads inside a wider row), and equal to the packed call.
  Matrix<float> wide = Matrix<float>::Zero(n_q, 2 * d), packed(n_q, d);
  moh::attention<float>(q, kv, mask, moh::AttentionOutput<float>{wide.data(), 2 * d});
  moh::attention<float>(q, kv, mask, moh::AttentionOutput<float>{packed.data(), d});
  EXPECT_TRUE(BitEqual(Matrix<float>(wide.leftCols(d)), packed));
  EXPECT_EQ(Matrix<float>(wide.rightCols(d)), Matrix<float>::Zero(n_q, d));
}

}  // namespace

namespace {

// The route attend_route() gives one head's queries in the benchmark rows (bench/moh_bench.cpp,
// bench/moh_bench_decode.cpp; float): a decode step's kv-head group of new queries (heads / kv
// heads of them) reads the cache in place, a prefill call's blocks of tokens take the tiled
// kernel, and a head size of no whole packets Eigen's products.
TEST(AttendRoute, BenchmarkRowsTakeTheirKernels) {
  using moh::detail::AttendRoute;
  using moh::detail::attend_route;
  const auto route = [](Index queries, Index d, bool packed = false) {
    return static_cast<int>(attend_route<float>(queries, d, packed));
  };
  const int few = static_cast<int>(AttendRoute::FewQuery);
  const int tiled = static_cast<int>(AttendRoute::Tiled);
  EXPECT_EQ(route(1, 64), few) << "BM_MHA_Decode/.../d_model:1024/heads:16/kv_heads:16, and "
                                  "BM_MoH_Decode's at d_model 1024";
  EXPECT_EQ(route(4, 128), few) << "BM_MHA_Decode/.../d_model:4096/heads:32/kv_heads:8, and "
                                   "BM_MoH_Decode's LLaMA3-8B rows";
  EXPECT_EQ(route(2, 128), few) << "BM_MHA_Decode/.../d_model:2048/heads:32/kv_heads:16/"
                                   "head_dim:128, and BM_JetMoE_Decode";
  EXPECT_EQ(route(moh::detail::kPackedQueries - 1, 128), few) << "the most queries it takes";
  EXPECT_EQ(route(moh::detail::kPackedQueries, 64), tiled);
  EXPECT_EQ(route(1, 64, true), tiled) << "keys the caller laid out";
  EXPECT_EQ(route(moh::kQueryBlock, 64), tiled) << "BM_MHA_Prefill, BM_MoH_Prefill, BM_MoA_Prefill";
  EXPECT_EQ(route(moh::kQueryBlock, 128), tiled) << "the LLaMA3-8B prefill rows";
  EXPECT_EQ(route(1, 65), static_cast<int>(AttendRoute::Strided));
  EXPECT_EQ(route(moh::kQueryBlock, 65), static_cast<int>(AttendRoute::Strided));
}

}  // namespace
