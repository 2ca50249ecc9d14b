// Tests for moh/ops/gemm.hpp and its kernels (ops/detail/packed_gemm.hpp, rows_product.hpp): the
// packed GEMM and the few-rows product against a naive double loop, for B given as [K, N] and as
// the transpose of [N, K], in T and in bfloat16, on strided views, with and without accumulation,
// over shapes that cross every block edge (MR, NR, KC, MC, NC); the promise that each element is
// one in-order chain, so a row or a tile computed alone is bitwise the row or tile of the whole
// product; the packs coming from the caller's arena (handed back after each call, nothing new once
// warm); and the route multiply_route() and rows_product_route() give each product of every
// benchmark row.
#include "moh/ops/gemm.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moh/float16.hpp"
#include "moh/ops/detail/packed_gemm.hpp"
#include "moh/ops/detail/rows_product.hpp"
#include "moh/ops/linear.hpp"
#include "reference/naive_blocks.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh::detail::Arena;
using moh::detail::GemmB;
using moh::detail::GemmShape;
using moh_test::BitEqual;

// Shapes around the block sizes of the float kernel on this target.
std::vector<std::array<Index, 3>> shapes() {
  using S = GemmShape<float>;
  return {{1, 1, 1},
          {2, 3, 5},
          {S::MR, S::NR, 7},
          {S::MR + 1, S::NR + 1, S::KC + 1},
          {S::MC + 5, S::NC + 3, 2 * S::KC + 17},
          {2 * S::MC + 1, 2 * S::NC + S::NR + 1, 64},
          {5, 3 * S::NR - 1, S::KC - 1},
          {37, 17, 300}};
}

// B as a dense [K, N] reference in double, from `stored` laid out as the operand describes.
template <class T>
Matrix<double> b_reference(const Matrix<T>& stored, bool transposed) {
  return transposed ? Matrix<double>(stored.template cast<double>().transpose())
                    : Matrix<double>(stored.template cast<double>());
}

/// The operands of a product C [M, N] = A [M, K] B [K, N]: B stored as [K, N], or as [N, K] when
/// `transposed`, and a C0 to accumulate onto.
template <class T>
struct Operands {
  Matrix<T> A, Bs, C0;
  bool transposed;

  GemmB<T> b() const { return GemmB<T>{Bs.data(), nullptr, Bs.cols(), transposed}; }
  /// A B in double, plus C0 when `accumulate`.
  Matrix<double> want(bool accumulate) const {
    Matrix<double> w = A.template cast<double>() * b_reference(Bs, transposed);
    if (accumulate) w += C0.template cast<double>();
    return w;
  }
};
/// Runs f(M, N, K, transposed) for every shape of shapes() and both layouts of B, under a trace
/// that names them.
template <class F>
void for_shapes_and_layouts(F&& f) {
  for (const auto& [M, N, K] : shapes())
    for (bool transposed : {false, true}) {
      SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " K=" << K
                                      << " transposed=" << transposed);
      f(M, N, K, transposed);
    }
}

/// The values of W rounded to bfloat16: their bits, and the bits widened back to float.
struct BFloat16Copy {
  std::vector<std::uint16_t> bits;
  Matrix<float> widened;

  explicit BFloat16Copy(const Matrix<float>& W)
      : bits(static_cast<std::size_t>(W.size())), widened(W.rows(), W.cols()) {
    for (Index i = 0; i < W.size(); ++i) {
      bits[i] = moh::float_to_bfloat16(W.data()[i]);
      widened.data()[i] = moh::bfloat16_to_float(bits[i]);
    }
  }
};

/// Seeded random operands: A from `seed`, B from seed + 1, C0 from seed + 2.
template <class T>
Operands<T> random_operands(Index M, Index N, Index K, bool transposed, std::uint64_t seed) {
  return {moh_test::random_matrix<T>(M, K, seed),
          transposed ? moh_test::random_matrix<T>(N, K, seed + 1) : moh_test::random_matrix<T>(K, N, seed + 1),
          moh_test::random_matrix<T>(M, N, seed + 2), transposed};
}

TEST(Gemm, MatchesNaiveForBothLayoutsWithAndWithoutAccumulation) {
  Arena arena;
  for_shapes_and_layouts([&](Index M, Index N, Index K, bool transposed) {
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(testing::Message() << "accumulate=" << accumulate);
      const Operands<float> op = random_operands<float>(M, N, K, transposed, 1);
      Matrix<float> C = op.C0;
      moh::detail::gemm<float>(op.A.data(), K, op.b(), C.data(), N, M, N, K, accumulate, arena);
      EXPECT_LE(moh_test::max_abs_diff(C, op.want(accumulate)), 1e-6 * static_cast<double>(K + 2));
    }
  });
}

TEST(Gemm, ReadsStridedViewsAndLeavesTheRestOfCAlone) {
  Arena arena;
  const Index M = 23, N = 70, K = 260, pad = 9;
  const Matrix<float> Abig = moh_test::random_matrix<float>(M + 2, K + pad, 4);
  const Matrix<float> Wbig = moh_test::random_matrix<float>(N + 3, K + pad, 5);
  Matrix<float> Cbig = moh_test::random_matrix<float>(M + 4, N + pad, 6);
  const Matrix<float> before = Cbig;
  const float* a = Abig.data() + 1 * Abig.cols() + 2;
  const float* w = Wbig.data() + 2 * Wbig.cols() + 3;
  float* c = Cbig.data() + 3 * Cbig.cols() + 4;
  moh::detail::gemm<float>(a, Abig.cols(), GemmB<float>{w, nullptr, Wbig.cols(), true}, c,
                           Cbig.cols(), M, N, K, false, arena);
  const Matrix<double> want =
      Abig.block(1, 2, M, K).cast<double>() * Wbig.block(2, 3, N, K).cast<double>().transpose();
  EXPECT_LE(moh_test::max_abs_diff(Cbig.block(3, 4, M, N), want), 1e-6 * (K + 2));
  // Everything outside the [M, N] block at (3, 4) is untouched.
  Matrix<float> outside = Cbig;
  outside.block(3, 4, M, N) = before.block(3, 4, M, N);
  EXPECT_TRUE(BitEqual(outside, before));
}

TEST(Gemm, EachElementIsOneChainWhateverTheTiling) {
  Arena arena;
  // Rows, columns and tiles computed on their own are bitwise those of the whole product,
  // including the edge tiles and the depth split at KC.
  using S = GemmShape<float>;
  const Index M = 2 * S::MC + 7, N = S::NC + S::NR + 5, K = 2 * S::KC + 3;
  for (bool transposed : {false, true}) {
    const Operands<float> op = random_operands<float>(M, N, K, transposed, 7);
    const Matrix<float>& A = op.A;
    const GemmB<float> B = op.b();
    Matrix<float> whole(M, N);
    moh::detail::gemm<float>(A.data(), K, B, whole.data(), N, M, N, K, false, arena);

    Matrix<float> tiled(M, N);
    const Index rows[] = {0, 1, S::MR + 2, S::MC + 3, M};
    const Index cols[] = {0, 3, S::NR + 1, N};
    for (int i = 0; i + 1 < 5; ++i)
      for (int j = 0; j + 1 < 4; ++j) {
        const Index r0 = rows[i], c0 = cols[j];
        moh::detail::gemm<float>(A.data() + r0 * K, K, B.offset(0, c0), tiled.data() + r0 * N + c0,
                                 N, rows[i + 1] - r0, cols[j + 1] - c0, K, false, arena);
      }
    EXPECT_TRUE(BitEqual(tiled, whole)) << "transposed=" << transposed;

    // Accumulating the depth in two calls is the same chain as one call.
    Matrix<float> split(M, N);
    const Index k1 = S::KC + 5;
    moh::detail::gemm<float>(A.data(), K, B, split.data(), N, M, N, k1, false, arena);
    moh::detail::gemm<float>(A.data() + k1, K, B.offset(k1, 0), split.data(), N, M, N, K - k1,
                             true, arena);
    EXPECT_TRUE(BitEqual(split, whole)) << "transposed=" << transposed;
  }
}

// W [rows, cols] in the packed layout of GemmB::packed, with panels of `nr` rows (and the nr
// elements after the last panel that the layout asks for).
std::vector<float> packed_layout(const Matrix<float>& W, Index nr) {
  const Index panels = (W.rows() + nr - 1) / nr;
  std::vector<float> p(static_cast<std::size_t>(panels * nr * W.cols() + nr), 0.0f);
  for (Index i = 0; i < W.rows(); ++i)
    for (Index j = 0; j < W.cols(); ++j)
      p[static_cast<std::size_t>((i / nr) * W.cols() * nr + j * nr + i % nr)] = W(i, j);
  return p;
}

// A transposed operand that also carries its matrix packed is read from the packed panels where
// its columns lie in one of them (a panel's rows from any offset in it, such as one head's d rows
// at an odd head), and packed from `values` where they do not. The packed copy here holds 2 W,
// so that the result shows which was read: 2 (A W^T) exactly, or A W^T.
TEST(Gemm, ReadsPanelsStoredPackedInPlace) {
  using S = GemmShape<float>;
  Arena arena;
  const Index rows = 3 * S::NR + 5, cols = S::KC + 40;  // a last panel of 5 rows, two depth blocks
  const Matrix<float> W = moh_test::random_matrix<float>(rows, cols, 40);
  const Matrix<float> W2 = 2.0f * W;
  const std::vector<float> packed = packed_layout(W2, S::NR);
  struct Case {
    Index r0, c0, N;
    bool in_place;
  };
  const Index half = S::NR / 2;
  const Case cases[] = {{0, 0, rows, true},              // every panel, the last partial
                        {half, 0, half, true},           // the second half of the first panel
                        {S::NR + half, 7, S::L, true},   // one packet inside a panel, deeper k
                        {S::NR, 0, 2 * S::NR + 5, true},
                        {half, 0, S::NR, false},         // straddles two panels: packed per call
                        {3, 0, S::NR - 3, true}};        // not on a packet: read in place too
  for (const Case& c : cases)
    for (Index M : {Index(1), Index(5), Index(S::MR), Index(2 * S::MR + 3), Index(49)})
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(testing::Message() << "r0=" << c.r0 << " c0=" << c.c0 << " N=" << c.N
                                        << " M=" << M << " accumulate=" << accumulate);
        const Index K = cols - c.c0;
        const Matrix<float> A = moh_test::random_matrix<float>(M, K, 41);
        const Matrix<float> C0 = moh_test::random_matrix<float>(M, c.N, 42);
        GemmB<float> B{W.data(), nullptr, cols, true};
        B.packed = packed.data();
        B.packed_nr = S::NR;
        B.packed_cols = cols;
        B = B.offset(c.c0, c.r0);
        EXPECT_EQ(B.packed_row, c.r0);
        EXPECT_EQ(B.packed_col, c.c0);
        const Matrix<float>& read = c.in_place ? W2 : W;
        Matrix<float> got = C0, want = C0;
        moh::detail::gemm<float>(A.data(), K, B, got.data(), c.N, M, c.N, K, accumulate, arena);
        moh::detail::gemm<float>(A.data(), K,
                                 GemmB<float>{read.data() + c.r0 * cols + c.c0, nullptr, cols, true},
                                 want.data(), c.N, M, c.N, K, accumulate, arena);
        EXPECT_TRUE(BitEqual(got, want));
      }
}

#if defined(__FMA__)
// Each element of gemm()'s C is one fused multiply-add chain over k in order, from C or zero:
// the chain written out with std::fma gives the same bits, whatever computes the element (whole
// tiles, tiles of 12 rows for narrow panels, tails of their own height, edge columns, panels
// packed per call or read in place).
TEST(Gemm, EachElementIsTheFusedChainOverKInOrder) {
  using S = GemmShape<float>;
  Arena arena;
  const Index K = S::KC + 21;
  for (Index M : {Index(1), Index(5), Index(6), Index(13), Index(49)})
    for (Index N : {Index(2), S::L, 2 * S::L, S::NR, S::NR + 3})
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " accumulate=" << accumulate);
        const Operands<float> op = random_operands<float>(M, N, K, true, 44);
        Matrix<float> want(M, N);
        for (Index i = 0; i < M; ++i)
          for (Index j = 0; j < N; ++j) {
            float c = accumulate ? op.C0(i, j) : 0.0f;
            for (Index k = 0; k < K; ++k) c = std::fma(op.A(i, k), op.Bs(j, k), c);
            want(i, j) = c;
          }
        Matrix<float> packed_per_call = op.C0, in_place = op.C0;
        moh::detail::gemm<float>(op.A.data(), K, op.b(), packed_per_call.data(), N, M, N, K,
                                 accumulate, arena);
        EXPECT_TRUE(BitEqual(packed_per_call, want));
        const std::vector<float> packed = packed_layout(op.Bs, S::NR);
        GemmB<float> B = op.b();
        B.packed = packed.data();
        B.packed_nr = S::NR;
        B.packed_cols = K;
        moh::detail::gemm<float>(op.A.data(), K, B, in_place.data(), N, M, N, K, accumulate, arena);
        EXPECT_TRUE(BitEqual(in_place, want));
      }
}
#endif

// Panels of whole packets narrower than NR / 2 (a head of d = 32 on AVX-512) run in tiles of
// twice the rows; rows left over run in tiles of their own height. Each element is still the one
// chain: a narrow product equals the same columns of a wide one, bit for bit, for every row
// count around the tile heights.
TEST(Gemm, NarrowPanelsOfWholePacketsGiveTheBitsOfWideOnes) {
  using S = GemmShape<float>;
  Arena arena;
  const Index K = S::KC + 9, wide = 4 * S::NR;
  for (Index n : {S::L, 2 * S::L})
    for (Index M = 1; M <= 4 * S::MR + 1; ++M) {
      SCOPED_TRACE(testing::Message() << "M=" << M << " n=" << n);
      const Operands<float> op = random_operands<float>(M, wide, K, true, 43);
      Matrix<float> all(M, wide), narrow(M, n);
      moh::detail::gemm<float>(op.A.data(), K, op.b(), all.data(), wide, M, wide, K, false, arena);
      const Index c0 = S::NR + S::L;  // a panel that starts one packet into a wide one
      moh::detail::gemm<float>(op.A.data(), K, op.b().offset(0, c0), narrow.data(), n, M, n, K,
                               false, arena);
      EXPECT_TRUE(BitEqual(narrow, Matrix<float>(all.middleCols(c0, n))));
    }
}

TEST(Gemm, BFloat16OperandEqualsTheWidenedValuesExactly) {
  Arena arena;
  for_shapes_and_layouts([&](Index M, Index N, Index K, bool transposed) {
    const Operands<float> op = random_operands<float>(M, N, K, transposed, 9);
    const BFloat16Copy w(op.Bs);
    const Index ld = op.Bs.cols();
    Matrix<float> from_bits(M, N), from_floats(M, N);
    moh::detail::gemm<float>(op.A.data(), K, GemmB<float>{nullptr, w.bits.data(), ld, transposed},
                             from_bits.data(), N, M, N, K, false, arena);
    moh::detail::gemm<float>(op.A.data(), K, GemmB<float>{w.widened.data(), nullptr, ld, transposed},
                             from_floats.data(), N, M, N, K, false, arena);
    EXPECT_TRUE(BitEqual(from_bits, from_floats));
  });
}

TEST(Gemm, DoubleMatchesNaive) {
  Arena arena;
  const Index M = 13, N = 41, K = 300;
  const Matrix<double> A = moh_test::random_matrix<double>(M, K, 11);
  const Matrix<double> W = moh_test::random_matrix<double>(N, K, 12);
  Matrix<double> C(M, N);
  moh::detail::gemm<double>(A.data(), K, GemmB<double>{W.data(), nullptr, K, true}, C.data(), N, M,
                            N, K, false, arena);
  const Matrix<double> want = A * W.transpose();
  EXPECT_LE(moh_test::max_abs_diff(C, want), 1e-13 * K);
}

TEST(Gemm, NoDepthGivesZeroOrLeavesC) {
  Arena arena;
  Matrix<float> C = Matrix<float>::Constant(3, 4, 2.0f);
  const float a = 0, w = 0;
  moh::detail::gemm<float>(&a, 0, GemmB<float>{&w, nullptr, 0, true}, C.data(), 4, 3, 4, 0, true, arena);
  EXPECT_EQ(C, Matrix<float>::Constant(3, 4, 2.0f));
  moh::detail::gemm<float>(&a, 0, GemmB<float>{&w, nullptr, 0, true}, C.data(), 4, 3, 4, 0, false, arena);
  EXPECT_EQ(C, Matrix<float>::Zero(3, 4));
}

TEST(Multiply, UnpackedFewRowsGiveTheBitsOfThePackedGemm) {
  Arena arena;
  // multiply() runs a [K, N] operand unpacked below kUnpackedRows rows: the same chain per
  // element as gemm(), from float or bfloat16, accumulating or not.
  using S = GemmShape<float>;
  for (Index M : {Index(1), Index(5), Index(S::MR + 1), moh::detail::kUnpackedRows - 1})
    for (Index N : {S::L, S::NR, S::NR + S::L, 3 * S::NR})
      for (bool bf16 : {false, true})
        for (bool accumulate : {false, true}) {
          const Index K = 300;
          SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " bf16=" << bf16
                                          << " accumulate=" << accumulate);
          const Matrix<float> A = moh_test::random_matrix<float>(M, K, 18);
          const Matrix<float> W = moh_test::random_matrix<float>(K, N, 19);
          const BFloat16Copy w(W);
          const Matrix<double> Wd = (bf16 ? w.widened : W).cast<double>();  // the values B holds
          const GemmB<float> B = bf16 ? GemmB<float>{nullptr, w.bits.data(), N, false}
                                      : GemmB<float>{W.data(), nullptr, N, false};
          const Matrix<float> C0 = moh_test::random_matrix<float>(M, N, 20);
          Matrix<float> unpacked = C0, packed = C0;
          moh::detail::multiply<float>(A.data(), K, B, unpacked.data(), N, M, N, K, accumulate, arena);
          moh::detail::gemm<float>(A.data(), K, B, packed.data(), N, M, N, K, accumulate, arena);
          EXPECT_TRUE(BitEqual(unpacked, packed));
          Matrix<double> want = A.cast<double>() * Wd;
          if (accumulate) want += C0.cast<double>();
          EXPECT_LE(moh_test::max_abs_diff(unpacked, want), 1e-6 * (K + 2));
        }
}

TEST(Multiply, ReachIsAPrefetchHintOnly) {
  Arena arena;
  // An operand over the first K of a taller matrix's rows may prefetch the rows below (a routed
  // expert's weights followed by the next expert's); the product is bitwise the same. K spans
  // several of small_product's depth blocks, M several row tiles and N two whole strips and a
  // narrow one, so that row tiles prefetch the next block, the next strip and the rows past K;
  // in a build with assertions small_product checks that no prefetch reaches row `reach`.
  // M = 2 MR has no rows after its whole tiles, and K = 0 no depth block at all.
  using S = GemmShape<float>;
  const Index N = 2 * S::NR + S::L;
  for (Index M : {S::MR + 1, 2 * S::MR, 2 * S::MR + 1})
    for (Index K : {0, 64, 1100}) {
      SCOPED_TRACE(testing::Message() << "M=" << M << " K=" << K);
      const Index rows = K + 5;
      const Matrix<float> A = moh_test::random_matrix<float>(M, std::max<Index>(K, 1), 21);
      const Matrix<float> W = moh_test::random_matrix<float>(rows, N, 22);
      GemmB<float> near{W.data(), nullptr, N, false}, far = near;
      far.reach = rows;
      EXPECT_EQ(far.offset(K, 0).reach, rows - K);
      EXPECT_EQ(far.offset(rows, 0).reach, 0);
      Matrix<float> with(M, N), without(M, N);
      moh::detail::multiply<float>(A.data(), A.cols(), far, with.data(), N, M, N, K, false, arena);
      moh::detail::multiply<float>(A.data(), A.cols(), near, without.data(), N, M, N, K, false, arena);
      EXPECT_TRUE(BitEqual(with, without));
      const Matrix<double> want = A.leftCols(K).cast<double>() * W.topRows(K).cast<double>();
      EXPECT_LE(moh_test::max_abs_diff(with, want), 1e-6 * (K + 2));
    }
}

TEST(RowsProduct, MatchesNaiveFromFloatAndBFloat16AndAccumulates) {
  for (Index n = 1; n <= moh::detail::kDotRows; ++n)
    for (Index K : {1, 15, 16, 17, 100, 256, 257, 300, 1027})
      for (Index count : {1, 7, 8, 9, 70}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " K=" << K << " count=" << count);
        const Matrix<float> A = moh_test::random_matrix<float>(n, K, 13);
        const Matrix<float> W = moh_test::random_matrix<float>(count, K, 14);
        const Matrix<float> C0 = moh_test::random_matrix<float>(n, count, 15);
        Matrix<float> C = C0;
        moh::detail::rows_product<float>(A.data(), K, n, W.data(), K, count, K, C.data(), count,
                                         true);
        const Matrix<double> want = A.cast<double>() * W.cast<double>().transpose();
        EXPECT_LE(moh_test::max_abs_diff(C, want + C0.cast<double>()), 1e-6 * (K + 2));

        const BFloat16Copy w(W);
        Matrix<float> Cb(n, count);
        moh::detail::rows_product<float>(A.data(), K, n, w.bits.data(), K, count, K, Cb.data(),
                                         count, false);
        EXPECT_LE(moh_test::max_abs_diff(Cb, A.cast<double>() * w.widened.cast<double>().transpose()),
                  1e-6 * (K + 2));
      }
}

// The last rows of W that fill no part of short rows, or no chunk or tile of long rows, are the
// same chains as in a whole part, chunk or tile: every count of rows gives each element the bits
// it has in a larger product.
TEST(RowsProduct, AnElementDoesNotDependOnTheRowsOfWBesideIt) {
  const Index n = 3, most = 19;
  for (Index K : {Index(100), Index(301)}) {
    SCOPED_TRACE(testing::Message() << "K=" << K);
    const Matrix<float> A = moh_test::random_matrix<float>(n, K, 26);
    const Matrix<float> W = moh_test::random_matrix<float>(most, K, 27);
    Matrix<float> all(n, most);
    moh::detail::rows_product<float>(A.data(), K, n, W.data(), K, most, K, all.data(), most,
                                     false);
    for (Index count = 1; count < most; ++count) {
      Matrix<float> some(n, count);
      moh::detail::rows_product<float>(A.data(), K, n, W.data(), K, count, K, some.data(), count,
                                       false);
      EXPECT_TRUE(BitEqual(some, Matrix<float>(all.leftCols(count)))) << count << " rows of W";
    }
  }
}

// Strided A, W and C (views into larger matrices), short and long rows, float and bfloat16,
// accumulating: the product is right and nothing outside C's block changes. No rows of A (C is
// left alone), one row of A with each weight_streams setting (long rows in parts, at W's and
// C's strides; fewer rows of W than parts too) and tiles of rows of A.
TEST(RowsProduct, ReadsStridedViewsAndLeavesTheRestOfCAlone) {
  const moh::KernelTuning saved = moh::kernel_tuning();
  const Index pad = 7;
  for (Index n : {0, 1, 5})
    for (Index count : {0, 3, 11})
      for (int streams = 1; streams <= moh::KernelTuning::kMaxWeightStreams; ++streams)
        for (Index K : {Index(200), Index(309)}) {
          SCOPED_TRACE(testing::Message()
                       << "n=" << n << " count=" << count << " streams=" << streams << " K=" << K);
          moh::KernelTuning t;
          t.weight_streams = streams;
          moh::set_kernel_tuning(t);
          const Matrix<float> Abig = moh_test::random_matrix<float>(n + 2, K + pad, 30);
          const Matrix<float> Wbig = moh_test::random_matrix<float>(count + 3, K + pad, 31);
          const BFloat16Copy wb(Wbig);
          for (bool bf16 : {false, true}) {
            Matrix<float> Cbig = moh_test::random_matrix<float>(n + 4, count + pad, 32);
            const Matrix<float> before = Cbig;
            const float* a = Abig.data() + 1 * Abig.cols() + 2;
            const Index w_offset = 2 * Wbig.cols() + 3, ldw = Wbig.cols();
            float* c = Cbig.data() + 3 * Cbig.cols() + 4;
            if (bf16)
              moh::detail::rows_product<float>(a, Abig.cols(), n, wb.bits.data() + w_offset, ldw,
                                               count, K, c, Cbig.cols(), true);
            else
              moh::detail::rows_product<float>(a, Abig.cols(), n, Wbig.data() + w_offset, ldw,
                                               count, K, c, Cbig.cols(), true);
            const Matrix<float>& Wsrc = bf16 ? wb.widened : Wbig;
            const Matrix<double> want =
                before.block(3, 4, n, count).cast<double>() +
                Abig.block(1, 2, n, K).cast<double>() *
                    Wsrc.block(2, 3, count, K).cast<double>().transpose();
            EXPECT_LE(moh_test::max_abs_diff(Cbig.block(3, 4, n, count), want), 1e-6 * (K + 2))
                << (bf16 ? "bfloat16" : "float");
            Matrix<float> outside = Cbig;
            outside.block(3, 4, n, count) = before.block(3, 4, n, count);
            EXPECT_TRUE(BitEqual(outside, before)) << (bf16 ? "bfloat16" : "float");
          }
        }
  moh::set_kernel_tuning(saved);
}

// One row of A reads long rows of W in weight_streams() parts, more rows take W in tiles of
// rows: the bits of a row are the same either way, from float and from bfloat16 weights (short
// rows too).
TEST(RowsProduct, ARowDoesNotDependOnTheOtherRows) {
  for (Index K : {moh::detail::kShortRow, Index(300), Index(333), Index(1030)})
    for (Index n : {Index(2), Index(3), moh::detail::kDotRows - 1, moh::detail::kDotRows}) {
      SCOPED_TRACE(testing::Message() << "K=" << K << " n=" << n);
      const Index count = 29;  // tiles of W rows and the rows left over
      const Matrix<float> A = moh_test::random_matrix<float>(n, K, 16);
      const Matrix<float> W = moh_test::random_matrix<float>(count, K, 17);
      const BFloat16Copy w(W);
      Matrix<float> all(n, count), all_b(n, count);
      moh::detail::rows_product<float>(A.data(), K, n, W.data(), K, count, K, all.data(), count,
                                       false);
      moh::detail::rows_product<float>(A.data(), K, n, w.bits.data(), K, count, K, all_b.data(),
                                       count, false);
      for (Index r = 0; r < n; ++r) {
        Matrix<float> one(1, count), one_b(1, count);
        moh::detail::rows_product<float>(A.data() + r * K, K, 1, W.data(), K, count, K,
                                         one.data(), count, false);
        moh::detail::rows_product<float>(A.data() + r * K, K, 1, w.bits.data(), K, count, K,
                                         one_b.data(), count, false);
        EXPECT_TRUE(BitEqual(one, Matrix<float>(all.row(r)))) << "row " << r;
        EXPECT_TRUE(BitEqual(one_b, Matrix<float>(all_b.row(r)))) << "row " << r << ", bfloat16";
      }
    }
}

// With an arena, long bfloat16 rows go through the even/odd loop where the build has it (float,
// AVX-512 or AVX2: two packets widened per full-width load, A's rows laid out to match): every
// element keeps the bits of the plain loop, for strided rows of A, one or more rows (tiles of W
// and pairs of A), every weight_streams setting, whole steps and the packets and elements left
// over, accumulating or not; the arena is given back. Elsewhere both calls take the plain loop.
TEST(RowsProduct, BFloat16LongRowsKeepTheirBitsThroughTheEvenOddLoop) {
  const moh::KernelTuning saved = moh::kernel_tuning();
  Arena arena;
  for (Index K : {Index(257), Index(320), Index(333), Index(1030), Index(4160)})
    for (Index n : {Index(1), Index(2), Index(3), moh::detail::kDotRows})
      for (int streams : {1, 4, moh::KernelTuning::kMaxWeightStreams})
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(testing::Message() << "K=" << K << " n=" << n << " streams=" << streams
                                          << " accumulate=" << accumulate);
          moh::KernelTuning t;
          t.weight_streams = streams;
          moh::set_kernel_tuning(t);
          const Index count = 13, lda = K + 3;
          const Matrix<float> A = moh_test::random_matrix<float>(n, lda, 40);
          const BFloat16Copy w(moh_test::random_matrix<float>(count, K, 41));
          const Matrix<float> C0 = moh_test::random_matrix<float>(n, count, 42);
          Matrix<float> plain = C0, even_odd = C0;
          moh::detail::rows_product<float>(A.data(), lda, n, w.bits.data(), K, count, K,
                                           plain.data(), count, accumulate);
          moh::detail::rows_product<float>(A.data(), lda, n, w.bits.data(), K, count, K,
                                           even_odd.data(), count, accumulate, &arena);
          EXPECT_TRUE(BitEqual(even_odd, plain));
          const Matrix<double> want =
              (accumulate ? Matrix<double>(C0.cast<double>()) : Matrix<double>::Zero(n, count)) +
              A.leftCols(K).cast<double>() * w.widened.cast<double>().transpose();
          EXPECT_LE(moh_test::max_abs_diff(even_odd, want), 1e-6 * (K + 2));
          EXPECT_EQ(arena.in_use(), 0u);
        }
  moh::set_kernel_tuning(saved);
}

// The chains that rows_product() promises, written out plainly: packet p of a row into chain
// p % chains (one multiply-add per packet, in order), the chains added pairwise, then reduced;
// short rows (K <= kShortRow) have one chain, long rows row_chains() (2 for bfloat16 on AVX2,
// 4 otherwise). K is whole packets here, so that no product is left to add one by one.
template <class Src>
float documented_chains(const float* a, const Src* w, Index K) {
  using P = moh::detail::GemmPacket<float>;
  constexpr Index L = sizeof(P) / sizeof(float);
  const int chains = K > moh::detail::kShortRow ? moh::detail::row_chains<float, Src>() : 1;
  std::vector<float> widened(static_cast<std::size_t>(K));
  for (Index i = 0; i < K; ++i) widened[i] = moh::detail::load_scalar<float>(w + i);
  static_assert(moh::detail::kRowChains <= 4, "the chains below");
  P acc[4];
  for (P& c : acc) c = Eigen::internal::pset1<P>(0.f);
  for (Index p = 0; p < K / L; ++p)
    acc[p % chains] = Eigen::internal::pmadd(Eigen::internal::ploadu<P>(a + p * L),
                                             Eigen::internal::ploadu<P>(widened.data() + p * L),
                                             acc[p % chains]);
  for (int half = chains / 2; half > 0; half /= 2)
    for (int c = 0; c < half; ++c) acc[c] = Eigen::internal::padd(acc[c], acc[c + half]);
  return Eigen::internal::predux(acc[0]);
}

// Every route gives each element exactly those bits, from float and from bfloat16 weights: one
// row of A with each weight_streams setting (long rows and short rows in parts read side by
// side, with rows of W left over), chunks or tiles of W against pairs of rows of A (a chunk of
// fewer than 15 rows here: ChunksOfPartsGiveTheDocumentedChains has more), tiles computed chain
// by chain (4 or more rows of A in float; an odd row of A and rows of W left over), the
// even/odd loop with an arena; accumulating or not. (K with products left over:
// ARowDoesNotDependOnTheOtherRows.)
TEST(RowsProduct, EveryRouteGivesTheDocumentedChains) {
  constexpr Index L = sizeof(moh::detail::GemmPacket<float>) / sizeof(float);
  const moh::KernelTuning saved = moh::kernel_tuning();
  Arena arena;
  // 1-6 parts of long rows, 2-6 of short rows (2-4 with AVX-512), and tiles. 15 rows of W
  // leave rows over after 2, 4 or 6 parts (none after 3 or 5); 4 rows are fewer than 5 or 6
  // parts, which then take none.
  for (const Index count : {Index(4), Index(15)}) {
    // Short rows (a head of 128, the longest short row), then 33 and 130 packets of AVX2 (33
    // leaves a packet over for 2 or 4 chains, 130 two for 4).
    for (Index K : {Index(128), moh::detail::kShortRow, (moh::detail::kShortRow / L + 1) * L,
                    (1024 / L + 2) * L})
      for (Index n : {1, 2, 3, 4, 5, 8, 9}) {
        const Matrix<float> A = moh_test::random_matrix<float>(n, K, 50);
        const Matrix<float> W = moh_test::random_matrix<float>(count, K, 51);
        const BFloat16Copy w(W);
        const Matrix<float> C0 = moh_test::random_matrix<float>(n, count, 52);
        Matrix<float> want(n, count), want_b(n, count);
        for (Index r = 0; r < n; ++r)
          for (Index j = 0; j < count; ++j) {
            want(r, j) = documented_chains(A.data() + r * K, W.data() + j * K, K);
            want_b(r, j) = documented_chains(A.data() + r * K, w.bits.data() + j * K, K);
          }
        for (int streams = 1; streams <= moh::KernelTuning::kMaxWeightStreams; ++streams) {
          SCOPED_TRACE(testing::Message() << "count=" << count << " K=" << K << " n=" << n
                                          << " streams=" << streams);
          moh::KernelTuning t;
          t.weight_streams = streams;
          moh::set_kernel_tuning(t);
          Matrix<float> C(n, count), Cb(n, count), Ce(n, count);
          moh::detail::rows_product<float>(A.data(), K, n, W.data(), K, count, K, C.data(), count,
                                           false);
          moh::detail::rows_product<float>(A.data(), K, n, w.bits.data(), K, count, K, Cb.data(),
                                           count, false);
          moh::detail::rows_product<float>(A.data(), K, n, w.bits.data(), K, count, K, Ce.data(),
                                           count, false, &arena);
          EXPECT_TRUE(BitEqual(C, want)) << "float";
          EXPECT_TRUE(BitEqual(Cb, want_b)) << "bfloat16";
          EXPECT_TRUE(BitEqual(Ce, want_b)) << "bfloat16 through the arena";
          // Accumulating: each sum added once to what C held.
          Matrix<float> Ca = C0, Cab = C0;
          moh::detail::rows_product<float>(A.data(), K, n, W.data(), K, count, K, Ca.data(), count,
                                           true);
          moh::detail::rows_product<float>(A.data(), K, n, w.bits.data(), K, count, K, Cab.data(),
                                           count, true, &arena);
          EXPECT_TRUE(BitEqual(Ca, Matrix<float>(C0 + want))) << "float, accumulating";
          EXPECT_TRUE(BitEqual(Cab, Matrix<float>(C0 + want_b))) << "bfloat16, accumulating";
        }
      }
  }
  moh::set_kernel_tuning(saved);
}

// Rows of W in rows_product_long_chunks()'s full chunks for Src at row length K: G parts of
// kLongRowChunkBytes / (G K sizeof(Src)) rows (at least one).
template <class Src>
Index chunk_rows(Index K) {
  constexpr Index G = moh::detail::long_row_tile<float, Src>();
  return G * std::max<Index>(1, moh::detail::kLongRowChunkBytes / (G * K * Index(sizeof(Src))));
}

// Two rows of A or more against more rows of W than one chunk holds: two full chunks, a last
// smaller one (two rows per part) and rows left over after it; every element has the documented
// chains, from strided views (A, W and C each with a gap after each row), with the rest of C
// left alone, accumulating or not, float and bfloat16 (with and without the even/odd loop).
// Where long_row_tile() is 1 (float without AVX-512) there are no chunks: the same rows then
// check one row of W at a time and the tiles computed chain by chain.
template <class Src>
void check_chunks(const std::vector<Src>& Wbits, Index count, Index K, Index ldw) {
  constexpr Index G = moh::detail::long_row_tile<float, Src>();
  Arena arena;
  for (Index n : {2, 3, 8})
    for (bool accumulate : {false, true})
      for (bool with_arena : {false, true}) {
        if (with_arena && !std::is_same<Src, std::uint16_t>::value) continue;  // float: no arena
        SCOPED_TRACE(testing::Message() << "bytes=" << sizeof(Src) << " n=" << n << " count="
                                        << count << " accumulate=" << accumulate
                                        << " arena=" << with_arena << " G=" << G);
        const Index lda = K + 3, ldc = count + 2;
        const Matrix<float> A = moh_test::random_matrix<float>(n, lda, 60);
        const Matrix<float> C0 = moh_test::random_matrix<float>(n, ldc, 61);
        Matrix<float> C = C0;
        moh::detail::rows_product<float>(A.data(), lda, n, Wbits.data(), ldw, count, K, C.data(),
                                         ldc, accumulate, with_arena ? &arena : nullptr);
        Matrix<float> want = C0;
        for (Index r = 0; r < n; ++r)
          for (Index j = 0; j < count; ++j) {
            const float sum = documented_chains(A.data() + r * lda, Wbits.data() + j * ldw, K);
            want(r, j) = accumulate ? C0(r, j) + sum : sum;
          }
        EXPECT_TRUE(BitEqual(C, want));
        EXPECT_EQ(arena.in_use(), 0u);
      }
}

TEST(RowsProduct, ChunksOfPartsGiveTheDocumentedChains) {
  constexpr Index L = sizeof(moh::detail::GemmPacket<float>) / sizeof(float);
  const Index K = (1024 / L + 2) * L, ldw = K + 5;
  // Float rows.
  {
    const Index G = moh::detail::long_row_tile<float, float>();
    const Index count = 2 * chunk_rows<float>(K) + 2 * G + (G - 1);
    const Matrix<float> W = moh_test::random_matrix<float>(count, ldw, 62);
    check_chunks(std::vector<float>(W.data(), W.data() + W.size()), count, K, ldw);
  }
  // bfloat16 rows.
  {
    const Index G = moh::detail::long_row_tile<float, std::uint16_t>();
    const Index count = 2 * chunk_rows<std::uint16_t>(K) + 2 * G + (G - 1);
    const Matrix<float> W = moh_test::random_matrix<float>(count, ldw, 63);
    const BFloat16Copy w(W);
    check_chunks(w.bits, count, K, ldw);
  }
}

// for_parts<G, kStep>: every item of the whole steps taken once, part g from its first item to
// its last (its items in increasing order), fewer than G kStep items left, all G parts equal.
template <int G, Index kStep>
void check_for_parts() {
  for (Index count = 0; count <= 40; ++count) {
    SCOPED_TRACE(testing::Message() << "G=" << G << " step=" << kStep << " count=" << count);
    std::vector<int> seen(count, 0);
    std::vector<Index> last(G, -1);  // the last item taken in each part
    Index parts_of = -1;
    const Index taken = moh::detail::for_parts<G, kStep>(count, [&](Index i, Index part) {
      parts_of = part;
      EXPECT_EQ(i % kStep, 0);
      for (int g = 0; g < G; ++g)
        for (Index j = 0; j < kStep; ++j) {
          const Index item = g * part + i + j;
          ASSERT_LT(item, count);
          ++seen[item];
          EXPECT_GT(item, last[g]);
          last[g] = item;
        }
    });
    EXPECT_EQ(taken, count / (G * kStep) * (G * kStep));
    if (taken > 0) {
      EXPECT_EQ(parts_of * G, taken);
    } else {
      EXPECT_EQ(parts_of, -1) << "no step without a whole step in every part";
    }
    for (Index item = 0; item < count; ++item) EXPECT_EQ(seen[item], item < taken ? 1 : 0);
  }
}

TEST(RowsProduct, PartsTakeEveryItemOfTheirWholeStepsOnceInOrder) {
  check_for_parts<1, 1>();
  check_for_parts<2, 1>();
  check_for_parts<3, 1>();
  check_for_parts<4, 1>();
  check_for_parts<5, 1>();
  check_for_parts<6, 1>();
  check_for_parts<1, 4>();
  check_for_parts<3, 4>();
}

// with_streams<kMost>: one call, with G = streams, for 2 <= streams <= kMost; none otherwise.
TEST(RowsProduct, StreamCountsReachTheirCompiledTileOrNothing) {
  constexpr int kMost = 5;
  for (int streams = 0; streams <= kMost + 2; ++streams) {
    std::vector<int> calls;
    moh::detail::with_streams<kMost>(streams, [&](auto g) { calls.push_back(decltype(g)::value); });
    if (streams >= 2 && streams <= kMost) {
      EXPECT_EQ(calls, std::vector<int>{streams});
    } else {
      EXPECT_TRUE(calls.empty()) << streams;
    }
  }
}

}  // namespace

namespace {

// multiply() switches from rows_product to gemm between kDotRows and kDotRows + 1 rows of a
// transposed operand, runs [K, N] operands through few_rows_product up to kFewRows rows and
// unpacked below kUnpackedRows: every route matches
// the naive product, in float and double.
template <class T>
void check_multiply_routes(double tol_per_term) {
  Arena arena;
  const Index K = 131;
  for (bool transposed : {true, false})
    for (Index M : {moh::detail::kFewRows, moh::detail::kFewRows + 1, moh::detail::kDotRows,
                    moh::detail::kDotRows + 1, moh::detail::kUnpackedRows - 1,
                    moh::detail::kUnpackedRows})
      for (Index N : {GemmShape<T>::L, 3 * GemmShape<T>::L, 3 * GemmShape<T>::L + 1}) {
        SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " transposed=" << transposed);
        const Operands<T> op = random_operands<T>(M, N, K, transposed, 21);
        Matrix<T> C = op.C0;
        moh::detail::multiply<T>(op.A.data(), K, op.b(), C.data(), N, M, N, K, true, arena);
        EXPECT_LE(moh_test::max_abs_diff(C, op.want(true)), tol_per_term * (K + 2));
      }
}

TEST(Multiply, EveryRouteMatchesNaiveInFloatAndDouble) {
  check_multiply_routes<float>(1e-6);
  check_multiply_routes<double>(1e-14);
}

}  // namespace

namespace {

// The packs of B come from the caller's arena: each call hands
// them back (nothing in use afterwards), a warm arena does not grow for the same or a smaller
// shape, and what earlier calls left in it does not leak into a result (the zero padding of edge
// panels is rewritten every time): a reused arena gives the bits of a fresh one.
TEST(Gemm, PacksComeFromTheArenaAndLeaveNothingBehind) {
  Arena reused;
  // Fill the arena with garbage of a large call first: NaNs everywhere the packs will lie.
  {
    Arena::Scope scope(reused);
    float* junk = reused.allocate<float>(1 << 18);
    for (Index i = 0; i < (1 << 18); ++i) junk[i] = std::numeric_limits<float>::quiet_NaN();
  }
  EXPECT_EQ(reused.in_use(), 0u);
  for_shapes_and_layouts([&](Index M, Index N, Index K, bool transposed) {
    const Operands<float> op = random_operands<float>(M, N, K, transposed, 31);
    const Matrix<float>& A = op.A;
    const GemmB<float> B = op.b();
    Matrix<float> with_reused(M, N), with_fresh(M, N);
    moh::detail::gemm<float>(A.data(), K, B, with_reused.data(), N, M, N, K, false, reused);
    EXPECT_EQ(reused.in_use(), 0u);
    Arena fresh;
    moh::detail::gemm<float>(A.data(), K, B, with_fresh.data(), N, M, N, K, false, fresh);
    EXPECT_EQ(fresh.in_use(), 0u);
    EXPECT_TRUE(BitEqual(with_reused, with_fresh));
    EXPECT_TRUE(with_reused.allFinite());
    // Warm: the same call again takes no new memory and gives the same bits.
    const std::size_t warm = fresh.bytes();
    Matrix<float> again(M, N);
    moh::detail::gemm<float>(A.data(), K, B, again.data(), N, M, N, K, false, fresh);
    EXPECT_EQ(fresh.bytes(), warm);
    EXPECT_TRUE(BitEqual(again, with_fresh));
    // multiply() takes the same arena and also hands it back.
    moh::detail::multiply<float>(A.data(), K, B, again.data(), N, M, N, K, false, fresh);
    EXPECT_EQ(fresh.in_use(), 0u);
  });
  // An arena already in use by the caller keeps what the caller holds.
  Arena held;
  Arena::Scope outer(held);
  float* mine = held.allocate<float>(100);
  for (Index i = 0; i < 100; ++i) mine[i] = static_cast<float>(i);
  const std::size_t in_use = held.in_use();
  const Matrix<float> A = moh_test::random_matrix<float>(40, 300, 33);
  const Matrix<float> W = moh_test::random_matrix<float>(70, 300, 34);
  Matrix<float> C(40, 70), D(40, 70);
  moh::detail::gemm<float>(A.data(), 300, GemmB<float>{W.data(), nullptr, 300, true}, C.data(), 70,
                           40, 70, 300, false, held);
  Arena other;
  moh::detail::gemm<float>(A.data(), 300, GemmB<float>{W.data(), nullptr, 300, true}, D.data(), 70,
                           40, 70, 300, false, other);
  EXPECT_EQ(held.in_use(), in_use);
  for (Index i = 0; i < 100; ++i) ASSERT_EQ(mine[i], static_cast<float>(i)) << i;
  EXPECT_TRUE(BitEqual(C, D));
}

}  // namespace

namespace {

// The route of every benchmark row's products (bench/moh_bench.cpp, bench/moh_bench_decode.cpp;
// compute in float): each product asks multiply_route() with the rows and columns multiply()
// gets (a projection: each tile of for_each_linear_tile(), linear.hpp), and on the dot-product
// route rows_product_route() with its depth, as docs/design.md's dispatch tables say. A routed
// head's or expert's rows are the mean the router gives it (tokens x picks / heads it picks
// among). A change of a threshold, a tiling or a route's condition moves one of these.
using moh::detail::ProductRoute;
using moh::detail::RowsRoute;

// Long bfloat16 rows with an arena: the even/odd loop where it is compiled.
#if defined(EIGEN_VECTORIZE_AVX2)
constexpr RowsRoute kBenchLongBf16 = RowsRoute::LongRowsEvenOdd;
#else
constexpr RowsRoute kBenchLongBf16 = RowsRoute::LongRows;
#endif

/// How a benchmark product reaches its kernel.
enum class BenchVia {
  Multiply,     // one multiply() call of M rows and N columns (a routed head or expert)
  Tiles,        // a projection: multiply() per tile of for_each_linear_tile()
  DecodeTiles,  // the same on a pool of several threads in a decode call (dot_tile() columns)
  Dots,         // project_dots(): rows_product() without an arena (a router)
};

/// One product of a benchmark row: C[M, N] = A[M, K] B, B stored [out, in] (`transposed`) or
/// [in, out], in bfloat16 or not; `dot_rows` as the call's Exec sets it.
struct BenchProduct {
  std::string row;      // the benchmark's name
  const char* product;  // which of the layer's products
  BenchVia via;
  Index M, N, K;
  bool transposed, dot_rows, bf16;
  ProductRoute route;
  RowsRoute rows_route;  // on ProductRoute::Rows (and BenchVia::Dots) only
};

void expect_bench_routes(const std::vector<BenchProduct>& products) {
  for (const BenchProduct& p : products) {
    SCOPED_TRACE(testing::Message() << p.row << ": " << p.product);
    if (p.via == BenchVia::Dots) {
      EXPECT_EQ(static_cast<int>(moh::detail::rows_product_route<float, float>(p.K, false)),
                static_cast<int>(p.rows_route));
      continue;
    }
    std::vector<std::array<Index, 2>> calls;  // [M, N] of each multiply() call
    if (p.via == BenchVia::Multiply)
      calls.push_back({p.M, p.N});
    else
      moh::detail::for_each_linear_tile(
          p.M, p.N, nullptr,
          [&](Index, Index rows, Index, Index cols, int) { calls.push_back({rows, cols}); },
          p.via == BenchVia::DecodeTiles);
    ASSERT_FALSE(calls.empty());
    for (const auto& [m, n] : calls) {
      EXPECT_EQ(static_cast<int>(moh::detail::multiply_route<float>(m, n, p.transposed,
                                                                    p.dot_rows)),
                static_cast<int>(p.route))
          << "M=" << m << " N=" << n;
    }
    if (p.route != ProductRoute::Rows) continue;
    // multiply() hands rows_product() its arena for bfloat16 weights only.
    const RowsRoute rows = p.bf16 ? moh::detail::rows_product_route<float, std::uint16_t>(p.K, true)
                                  : moh::detail::rows_product_route<float, float>(p.K, false);
    EXPECT_EQ(static_cast<int>(rows), static_cast<int>(p.rows_route));
  }
}

// Prefill shapes of bench/moh_bench.cpp: (batch, tokens, d_model, heads).
constexpr Index kBenchPrefillShapes[][4] = {
    {1, 197, 768, 12}, {8, 256, 512, 8}, {1, 2048, 1024, 16}};

std::string bench_name(const char* name, std::initializer_list<std::pair<const char*, Index>> args,
                       const char* suffix = "") {
  std::string s = name;
  for (const auto& [arg, value] : args) s += "/" + std::string(arg) + ":" + std::to_string(value);
  return s + suffix;
}

// MoH's prefill rows: the split rule of bench/bench_common.hpp (moh_split).
void add_moh_prefill(std::vector<BenchProduct>& out, const std::string& row, Index N, Index D,
                     Index H, Index pct) {
  const ProductRoute packed = ProductRoute::Packed;
  const RowsRoute none = RowsRoute::LongRows;
  const Index d = D / H;
  const Index active = std::clamp<Index>((pct * H + 50) / 100, 1, H);
  const Index shared = std::min(active, pct == 25 ? std::max<Index>(1, H / 8) : H / 4);
  const Index routed_k = active - shared;
  out.push_back({row, "keys and values", BenchVia::Tiles, N, 2 * D, D, true, false, false, packed,
                 none});
  if (active == H) {  // every head: the dense path
    out.push_back({row, "queries", BenchVia::Tiles, N, D, D, true, false, false, packed, none});
    out.push_back({row, "output", BenchVia::Tiles, N, D, D, true, false, false, packed, none});
    return;
  }
  out.push_back({row, "router", BenchVia::Dots, N, H, D, true, false, false, packed,
                 RowsRoute::LongRows});
  out.push_back({row, "a shared head's queries", BenchVia::Multiply, N, d, D, true, false, false,
                 packed, none});
  const Index routed_rows = N * routed_k / (H - shared);
  out.push_back({row, "a routed head's queries", BenchVia::Multiply, routed_rows, d, D, true,
                 false, false, packed, none});
  out.push_back({row, "a routed head's output", BenchVia::Multiply, routed_rows, 128, d, true,
                 false, false, packed, none});
}

TEST(MultiplyRoute, PrefillBenchmarkRowsRunTheirKernels) {
  const ProductRoute packed = ProductRoute::Packed;
  const RowsRoute none = RowsRoute::LongRows;
  std::vector<BenchProduct> p;
  for (const auto& s : kBenchPrefillShapes) {
    const Index B = s[0], T = s[1], D = s[2], H = s[3], N = B * T;
    p.push_back({bench_name("BM_MohGEMM", {{"rows", N}, {"in", D}, {"out", 3 * D}}), "linear",
                 BenchVia::Tiles, N, 3 * D, D, true, false, false, packed, none});
    const std::string mha =
        bench_name("BM_MHA_Prefill", {{"batch", B}, {"tokens", T}, {"d_model", D}, {"heads", H}});
    p.push_back({mha, "queries", BenchVia::Tiles, N, D, D, true, false, false, packed, none});
    p.push_back({mha, "keys and values", BenchVia::Tiles, N, 2 * D, D, true, false, false, packed,
                 none});
    p.push_back({mha, "output", BenchVia::Tiles, N, D, D, true, false, false, packed, none});
    for (Index pct : {25, 50, 75, 90, 100})
      add_moh_prefill(p,
                      bench_name("BM_MoH_Prefill", {{"batch", B}, {"tokens", T}, {"d_model", D},
                                                    {"heads", H}, {"active_pct", pct}}),
                      N, D, H, pct);
    // MoA: the gate [D, E] and the experts [in, out]; an expert's mean rows N k / E take
    // small_product() below kUnpackedRows (the ViT shape's 16 and 32 experts).
    for (Index k : {2, 4})
      for (Index E : {8, 16, 32}) {
        const Index d = D / H, rows = N * k / E;
        const std::string moa =
            bench_name("BM_MoA_Prefill", {{"batch", B}, {"tokens", T}, {"d_model", D},
                                          {"experts", E}, {"top_k", k}, {"head_dim", d}});
        const bool few_tokens = N == 197 && (E == 32 || (E == 16 && k == 2));  // 12 to 24 rows
        const ProductRoute expert = few_tokens ? ProductRoute::Small : packed;
        p.push_back({moa, "gate", BenchVia::Multiply, N, E, D, false, false, false, packed, none});
        p.push_back({moa, "keys and values", BenchVia::Tiles, N, 2 * d, D, true, false, false,
                     packed, none});
        p.push_back({moa, "an expert's queries", BenchVia::Multiply, rows, d, D, false, false,
                     false, expert, none});
        p.push_back({moa, "an expert's output", BenchVia::Multiply, rows, std::min<Index>(D, 128),
                     d, false, false, false, expert, none});
      }
  }
  for (Index threads : {1, 2}) {
    const std::string mha = bench_name("BM_MHA_Prefill_Threads",
                                       {{"batch", 1}, {"tokens", 2048}, {"d_model", 1024},
                                        {"heads", 16}, {"threads", threads}},
                                       "/real_time");
    p.push_back({mha, "queries", BenchVia::Tiles, 2048, 1024, 1024, true, false, false, packed,
                 none});
    p.push_back({mha, "keys and values", BenchVia::Tiles, 2048, 2048, 1024, true, false, false,
                 packed, none});
    p.push_back({mha, "output", BenchVia::Tiles, 2048, 1024, 1024, true, false, false, packed,
                 none});
    add_moh_prefill(p,
                    bench_name("BM_MoH_Prefill_Threads",
                               {{"batch", 1}, {"tokens", 2048}, {"d_model", 1024}, {"heads", 16},
                                {"active_pct", 50}, {"threads", threads}},
                               "/real_time"),
                    2048, 1024, 16, 50);
  }
  // The LLaMA3-8B layer (bench/moh_bench_decode.cpp), causal; MoH-LLaMA3-8B as released: the
  // query-norm router projects every query, heads 0-15 shared, 8 of the 16 routed a token.
  const std::string mha =
      "BM_MHA_Prefill/batch:1/tokens:2048/d_model:4096/heads:32/kv_heads:8/causal:1";
  const std::string moh_row =
      "BM_MoH_Prefill/batch:1/tokens:2048/d_model:4096/heads:32/kv_heads:8/causal:1/active_pct:75";
  for (const std::string& row : {mha, moh_row}) {
    p.push_back({row, "queries", BenchVia::Tiles, 2048, 4096, 4096, true, false, false, packed,
                 none});
    p.push_back({row, "keys and values", BenchVia::Tiles, 2048, 2048, 4096, true, false, false,
                 packed, none});
  }
  p.push_back({mha, "output", BenchVia::Tiles, 2048, 4096, 4096, true, false, false, packed, none});
  p.push_back({moh_row, "a shared head's output", BenchVia::Multiply, 2048, 128, 128, true, false,
               false, packed, none});
  p.push_back({moh_row, "a routed head's output", BenchVia::Multiply, 2048 * 8 / 16, 128, 128,
               true, false, false, packed, none});
  expect_bench_routes(p);
}

TEST(MultiplyRoute, DecodeBenchmarkRowsRunTheirKernels) {
  const ProductRoute rows = ProductRoute::Rows;
  const RowsRoute lng = RowsRoute::LongRows, shrt = RowsRoute::ShortRows;
  std::vector<BenchProduct> p;
  // MHA at d_model 1024 (16 heads of 64): every projection of 1, 8 or 16 sequences (16 rows,
  // more than kDotRows, still dot products: the decode call's dot_rows).
  const auto mha_1024 = [&](const std::string& row, Index B) {
    p.push_back({row, "queries", BenchVia::Tiles, B, 1024, 1024, true, true, false, rows, lng});
    p.push_back({row, "keys and values", BenchVia::Tiles, B, 2048, 1024, true, true, false, rows,
                 lng});
    p.push_back({row, "output", BenchVia::Tiles, B, 1024, 1024, true, true, false, rows, lng});
  };
  for (Index c : {512, 4096, 16384})
    mha_1024(bench_name("BM_MHA_Decode", {{"batch", 1}, {"context", c}, {"d_model", 1024},
                                          {"heads", 16}, {"kv_heads", 16}}),
             1);
  mha_1024("BM_MHA_Decode/batch:8/context:4096/d_model:1024/heads:16/kv_heads:16", 8);
  mha_1024("BM_MHA_Decode/batch:16/context:1024/d_model:1024/heads:16/kv_heads:16", 16);
  EXPECT_EQ(static_cast<int>(moh::detail::multiply_route<float>(16, 1024, true, false)),
            static_cast<int>(ProductRoute::Packed))
      << "16 rows of a prefill call go to gemm(): the batch:16 row is on rows_product() by "
         "dot_rows alone";
  mha_1024("BM_MHA_Decode/batch:8/context:4096/d_model:1024/heads:16/kv_heads:16/ragged:1", 8);
  // The LLaMA3-8B layer: 32 heads of 128 over 8 kv heads, in float, on two threads, and with
  // bfloat16 weights (and a bfloat16 cache, which no product reads).
  const std::string llama = "BM_MHA_Decode/batch:1/context:4096/d_model:4096/heads:32/kv_heads:8";
  struct LlamaRow {
    const char* suffix;
    BenchVia via;
    bool bf16;
  };
  for (const LlamaRow& r : {LlamaRow{"", BenchVia::Tiles, false},
                            LlamaRow{"/threads:2", BenchVia::DecodeTiles, false},
                            LlamaRow{"/bf16:1", BenchVia::Tiles, true},
                            LlamaRow{"/bf16:1/kv_bf16:1", BenchVia::Tiles, true}}) {
    const RowsRoute long_rows = r.bf16 ? kBenchLongBf16 : lng;
    const std::string row = llama + r.suffix;
    p.push_back({row, "queries", r.via, 1, 4096, 4096, true, true, r.bf16, rows, long_rows});
    p.push_back({row, "keys and values", r.via, 1, 2048, 4096, true, true, r.bf16, rows,
                 long_rows});
    p.push_back({row, "output", r.via, 1, 4096, 4096, true, true, r.bf16, rows, long_rows});
  }
  // MoH at d_model 1024: the learned router, each active head's query row and its slice of W_o
  // (depth 64: short rows); every head active (100) is the dense path.
  const auto moh_1024 = [&](const std::string& row, Index B, Index pct) {
    p.push_back({row, "keys and values", BenchVia::Tiles, B, 2048, 1024, true, true, false, rows,
                 lng});
    if (pct == 100) {
      p.push_back({row, "queries", BenchVia::Tiles, B, 1024, 1024, true, true, false, rows, lng});
      p.push_back({row, "output", BenchVia::Tiles, B, 1024, 1024, true, true, false, rows, lng});
      return;
    }
    p.push_back({row, "router", BenchVia::Dots, B, 12, 1024, true, true, false, rows, lng});
    p.push_back({row, "a head's queries", BenchVia::Multiply, B, 64, 1024, true, true, false, rows,
                 lng});
    p.push_back({row, "a head's output", BenchVia::Multiply, B, 1024, 64, true, true, false, rows,
                 shrt});
  };
  for (Index c : {512, 4096, 16384})
    for (Index pct : {50, 75, 100})
      moh_1024(bench_name("BM_MoH_Decode", {{"batch", 1}, {"context", c}, {"d_model", 1024},
                                            {"heads", 16}, {"kv_heads", 16}, {"active_pct", pct}}),
               1, pct);
  moh_1024("BM_MoH_Decode/batch:8/context:4096/d_model:1024/heads:16/kv_heads:16/active_pct:50", 8,
           50);
  moh_1024(
      "BM_MoH_Decode/batch:8/context:4096/d_model:1024/heads:16/kv_heads:16/active_pct:50/ragged:1",
      8, 50);
  // MoH-LLaMA3-8B: the query-norm router projects every query; a head's W_o slice is 128 deep.
  const std::string moh_llama =
      "BM_MoH_Decode/batch:1/context:4096/d_model:4096/heads:32/kv_heads:8/active_pct:75";
  for (const bool bf16 : {false, true}) {
    const RowsRoute long_rows = bf16 ? kBenchLongBf16 : lng;
    const std::string suffix = bf16 ? "/bf16:1" : "";
    p.push_back({moh_llama + suffix, "queries", BenchVia::Tiles, 1, 4096, 4096, true, true, bf16,
                 rows, long_rows});
    p.push_back({moh_llama + suffix, "keys and values", BenchVia::Tiles, 1, 2048, 4096, true, true,
                 bf16, rows, long_rows});
    p.push_back({moh_llama + suffix, "a head's output", BenchVia::Multiply, 1, 4096, 128, true,
                 true, bf16, rows, shrt});
  }
  // JetMoE: keys and values [out, in]; the gate [D, E] and the experts [in, out]. The gate's 8
  // columns are whole packets with AVX2 (few_rows_product()), not with AVX-512 (gemm()).
  const std::string jetmoe = "BM_JetMoE_Decode/batch:1/context:4096/d_model:2048/kv_heads:16/"
                             "experts:8/top_k:2/head_dim:128";
  const ProductRoute gate =
      8 % GemmShape<float>::L == 0 ? ProductRoute::FewRows : ProductRoute::Packed;
  p.push_back({jetmoe, "gate", BenchVia::Multiply, 1, 8, 2048, false, true, false, gate, lng});
  p.push_back({jetmoe, "keys and values", BenchVia::Tiles, 1, 4096, 2048, true, true, false, rows,
               lng});
  p.push_back({jetmoe, "an expert's queries", BenchVia::Multiply, 1, 2048, 2048, false, true, false,
               ProductRoute::FewRows, lng});
  p.push_back({jetmoe, "an expert's output", BenchVia::Multiply, 1, 128, 2048, false, true, false,
               ProductRoute::FewRows, lng});
  const std::string jet_dense =
      "BM_MHA_Decode/batch:1/context:4096/d_model:2048/heads:32/kv_heads:16/head_dim:128";
  p.push_back({jet_dense, "queries", BenchVia::Tiles, 1, 4096, 2048, true, true, false, rows, lng});
  p.push_back({jet_dense, "keys and values", BenchVia::Tiles, 1, 4096, 2048, true, true, false,
               rows, lng});
  p.push_back({jet_dense, "output", BenchVia::Tiles, 1, 2048, 4096, true, true, false, rows, lng});
  expect_bench_routes(p);
}

// The boundaries the benchmark rows sit on either side of, in both route functions.
TEST(MultiplyRoute, ThresholdsSitWhereTheDispatchTablesSay) {
  using moh::detail::multiply_route;
  constexpr Index L = GemmShape<float>::L;
  const auto is = [](ProductRoute got, ProductRoute want) {
    return static_cast<int>(got) == static_cast<int>(want);
  };
  EXPECT_TRUE(is(multiply_route<float>(moh::detail::kDotRows, 7, true, false), ProductRoute::Rows));
  EXPECT_TRUE(is(multiply_route<float>(moh::detail::kDotRows + 1, 7, true, false),
                 ProductRoute::Packed));
  EXPECT_TRUE(is(multiply_route<float>(1000, 7, true, true), ProductRoute::Rows));
  EXPECT_TRUE(is(multiply_route<float>(moh::detail::kFewRows, 2 * L, false, false),
                 ProductRoute::FewRows));
  EXPECT_TRUE(is(multiply_route<float>(moh::detail::kFewRows + 1, 2 * L, false, true),
                 ProductRoute::Small));
  EXPECT_TRUE(is(multiply_route<float>(moh::detail::kUnpackedRows - 1, 2 * L, false, false),
                 ProductRoute::Small));
  EXPECT_TRUE(is(multiply_route<float>(moh::detail::kUnpackedRows, 2 * L, false, false),
                 ProductRoute::Packed));
  EXPECT_TRUE(is(multiply_route<float>(1, 2 * L + 1, false, false), ProductRoute::Packed));
  const auto rows_is = [](RowsRoute got, RowsRoute want) {
    return static_cast<int>(got) == static_cast<int>(want);
  };
  using moh::detail::kShortRow;
  using moh::detail::rows_product_route;
  EXPECT_TRUE(rows_is(rows_product_route<float, float>(kShortRow, true), RowsRoute::ShortRows));
  EXPECT_TRUE(rows_is(rows_product_route<float, float>(kShortRow + 1, true), RowsRoute::LongRows));
  EXPECT_TRUE(rows_is(rows_product_route<float, std::uint16_t>(kShortRow, true),
                      RowsRoute::ShortRows));
  EXPECT_TRUE(rows_is(rows_product_route<float, std::uint16_t>(kShortRow + 1, false),
                      RowsRoute::LongRows));
  EXPECT_TRUE(rows_is(rows_product_route<float, std::uint16_t>(kShortRow + 1, true),
                      kBenchLongBf16));
  EXPECT_TRUE(rows_is(rows_product_route<double, std::uint16_t>(kShortRow + 1, true),
                      RowsRoute::LongRows));
}

}  // namespace
