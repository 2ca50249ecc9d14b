// Tests for moh/ops/linear.hpp: Y = X W^T (+ b) against a naive loop, with and without bias, on
// strided views, and the tiled parallel form: bitwise the same for 1, 2 and 3 threads and equal to
// the serial GEMM, across shapes that cross the 128-row / 256-column tiles; the same bits with and
// without a Workspace; and the shape checks (moh::Error in every build, Y left as it was).
#include "moh/ops/linear.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "reference/naive_blocks.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh::Vector;
using moh_test::BitEqual;
using moh_test::error_of;
using moh_test::Mentions;

struct Shape {
  Index rows, in, out;
};
// 1x1, odd small, exactly one tile, one past a tile in each direction, several tiles both ways.
const Shape kShapes[] = {{1, 1, 1},     {3, 5, 17},    {3, 17, 17},   {128, 9, 256},
                         {129, 7, 257}, {130, 33, 300}, {300, 4, 520}, {17, 64, 3}};

template <class T>
std::vector<double> bias_vector(const Vector<T>& b) {
  return std::vector<double>(b.data(), b.data() + b.size());
}

TEST(Linear, MatchesNaiveWithAndWithoutBiasFloat) {
  for (const Shape& s : kShapes) {
    const Matrix<float> X = moh_test::random_matrix<float>(s.rows, s.in, 1);
    const Matrix<float> W = moh_test::random_matrix<float>(s.out, s.in, 2);
    const Vector<float> b = moh_test::random_vector<float>(s.out, 3);
    Matrix<float> Y(s.rows, s.out), Yb(s.rows, s.out);
    moh::linear<float>(X, W, Y);
    moh::linear<float>(X, W, b, Yb);
    const Matrix<double> want = moh_test::naive_linear(X, W);
    const Matrix<double> want_b = moh_test::naive_linear(X, W, bias_vector(b));
    // |x|, |w| <= 1: each output is a sum of `in` products, float error ~ in * 6e-8.
    const double tol = 1e-6 * static_cast<double>(s.in + 1);
    EXPECT_LE(moh_test::max_abs_diff(Y, want), tol) << s.rows << "x" << s.in << "->" << s.out;
    EXPECT_LE(moh_test::max_abs_diff(Yb, want_b), tol) << s.rows << "x" << s.in << "->" << s.out;
    // The bias really is added: the two results differ by exactly b per column where b != 0.
    EXPECT_GT(moh_test::max_abs_diff(Y, Yb), 0.0);
  }
}

TEST(Linear, MatchesNaiveDouble) {
  const Matrix<double> X = moh_test::random_matrix<double>(13, 19, 4);
  const Matrix<double> W = moh_test::random_matrix<double>(7, 19, 5);
  const Vector<double> b = moh_test::random_vector<double>(7, 6);
  Matrix<double> Y(13, 7);
  moh::linear<double>(X, W, b, Y);
  EXPECT_LE(moh_test::max_abs_diff(Y, moh_test::naive_linear(X, W, bias_vector(b))), 1e-13);
}

TEST(Linear, StridedViewsAndUntouchedSurroundings) {
  // X, W and Y are blocks of larger matrices: only Y's block is written.
  const Matrix<float> Xbig = moh_test::random_matrix<float>(10, 20, 7);
  const Matrix<float> Wbig = moh_test::random_matrix<float>(9, 30, 8);
  const Vector<float> b = moh_test::random_vector<float>(6, 9);
  Matrix<float> Ybig = Matrix<float>::Constant(12, 15, -99.0f);
  const auto X = Xbig.block(2, 3, 5, 11);
  const auto W = Wbig.block(1, 4, 6, 11);
  moh::linear<float>(X, W, b, Ybig.block(4, 2, 5, 6));
  const Matrix<double> want = moh_test::naive_linear(X, W, bias_vector(b));
  EXPECT_LE(moh_test::max_abs_diff(Ybig.block(4, 2, 5, 6), want), 1e-5);
  for (Index r = 0; r < 12; ++r)
    for (Index c = 0; c < 15; ++c) {
      if (!(r >= 4 && r < 9 && c >= 2 && c < 8)) {
        EXPECT_EQ(Ybig(r, c), -99.0f) << r << "," << c;
      }
    }

  // The parallel form on the same strided views writes the same block.
  moh::ThreadPool pool(3);
  Matrix<float> Ybig2 = Matrix<float>::Constant(12, 15, -99.0f);
  moh::linear<float>(X, W, b, Ybig2.block(4, 2, 5, 6), &pool);
  EXPECT_EQ(Ybig2, Ybig);
}

TEST(Linear, ParallelIsBitwiseIdenticalForAnyThreadCount) {
  moh::ThreadPool p1(1), p2(2), p3(3);
  for (const Shape& s : kShapes) {
    for (bool with_bias : {false, true}) {
      const Matrix<float> X = moh_test::random_matrix<float>(s.rows, s.in, 11);
      const Matrix<float> W = moh_test::random_matrix<float>(s.out, s.in, 12);
      const Vector<float> b = moh_test::random_vector<float>(s.out, 13);
      auto run = [&](Matrix<float>& Y, moh::ThreadPool* pool) {
        if (with_bias)
          moh::linear<float>(X, W, b, Y, pool);
        else
          moh::linear<float>(X, W, Y, pool);
      };
      Matrix<float> Y0(s.rows, s.out), Y1(s.rows, s.out), Y2(s.rows, s.out), Y3(s.rows, s.out);
      run(Y0, nullptr);
      run(Y1, &p1);
      run(Y2, &p2);
      run(Y3, &p3);
      EXPECT_TRUE(BitEqual(Y1, Y0)) << s.rows << "x" << s.in << "->" << s.out << " bias " << with_bias;
      EXPECT_TRUE(BitEqual(Y2, Y0)) << s.rows << "x" << s.in << "->" << s.out << " bias " << with_bias;
      EXPECT_TRUE(BitEqual(Y3, Y0)) << s.rows << "x" << s.in << "->" << s.out << " bias " << with_bias;
      // And the same run twice on a shared pool is deterministic.
      Matrix<float> Y3b(s.rows, s.out);
      run(Y3b, &p3);
      EXPECT_TRUE(BitEqual(Y3b, Y3));
    }
  }
}

TEST(Linear, ParallelEqualsSerialGemm) {
  // The tiled form computes each tile with the same GEMM as the one-shot serial form; the values
  // must agree to rounding (the reduction over `in` is the same per element).
  moh::ThreadPool pool(2);
  for (const Shape& s : kShapes) {
    const Matrix<double> X = moh_test::random_matrix<double>(s.rows, s.in, 21);
    const Matrix<double> W = moh_test::random_matrix<double>(s.out, s.in, 22);
    const Vector<double> b = moh_test::random_vector<double>(s.out, 23);
    Matrix<double> serial(s.rows, s.out), parallel(s.rows, s.out);
    moh::linear<double>(X, W, b, serial);
    moh::linear<double>(X, W, b, parallel, &pool);
    EXPECT_LE(moh_test::max_abs_diff(parallel, serial), 1e-13)
        << s.rows << "x" << s.in << "->" << s.out;
    EXPECT_LE(moh_test::max_abs_diff(parallel, moh_test::naive_linear(X, W, bias_vector(b))),
              1e-13);
  }
}

// Past one row tile, a row's bits do not depend on where the tiling puts it: the last few rows
// (at most kDotRows past a whole tile) are not a tile of their own, which multiply() would take
// as dot products (another rounding), but join the tile before. Each of them equals the same row
// among rows that all go through the GEMM.
TEST(Linear, RowsPastTheLastWholeTileGetTheGemmBits) {
  const Index in = 96, out = 64;
  const Matrix<float> W = moh_test::random_matrix<float>(out, in, 31);
  for (Index tail : {Index(1), Index(5), moh::detail::kDotRows}) {
    const Index rows = 128 + tail;
    const Matrix<float> X = moh_test::random_matrix<float>(rows, in, 32);
    Matrix<float> Y(rows, out);
    moh::linear<float>(X, W, Y);
    // The tail's rows with enough others before them that the call is one GEMM tile.
    const Index few = moh::detail::kDotRows + 2;
    const Matrix<float> Xs = X.bottomRows(few);
    Matrix<float> Ys(few, out);
    moh::linear<float>(Xs, W, Ys);
    const Matrix<float> got = Y.bottomRows(tail), expected = Ys.bottomRows(tail);
    EXPECT_TRUE(BitEqual(got, expected)) << rows << " rows";
  }
}

// A Workspace only provides scratch: one workspace reused over every shape (growing and
// shrinking), with and without threads, gives the bits of a call without one; on the calling
// thread alone, once warm, a repeated shape does not grow it; release() empties it. (With a pool,
// which thread runs which tile varies from call to call, so a per-thread arena may still grow on
// a later call of the same shape: not asserted here.)
TEST(Linear, WorkspaceGivesTheSameBitsAndStopsGrowingWhenWarm) {
  moh::Workspace ws;
  moh::ThreadPool pool(3);
  for (const Shape& s : kShapes)
    for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool}) {
      SCOPED_TRACE(testing::Message() << s.rows << "x" << s.in << "->" << s.out
                                      << " threads " << (p ? p->size() : 1));
      const Matrix<float> X = moh_test::random_matrix<float>(s.rows, s.in, 31);
      const Matrix<float> W = moh_test::random_matrix<float>(s.out, s.in, 32);
      const Vector<float> b = moh_test::random_vector<float>(s.out, 33);
      Matrix<float> plain(s.rows, s.out), with_ws(s.rows, s.out);
      Matrix<float> plain_b(s.rows, s.out), with_ws_b(s.rows, s.out);
      moh::linear<float>(X, W, plain, p);
      moh::linear<float>(X, W, with_ws, p, &ws);
      moh::linear<float>(X, W, b, plain_b, p);
      moh::linear<float>(X, W, b, with_ws_b, p, &ws);
      EXPECT_TRUE(BitEqual(with_ws, plain));
      EXPECT_TRUE(BitEqual(with_ws_b, plain_b));
      const std::size_t warm = ws.bytes();
      moh::linear<float>(X, W, b, with_ws_b, p, &ws);
      if (p == nullptr) {
        EXPECT_EQ(ws.bytes(), warm);
      }
      EXPECT_TRUE(BitEqual(with_ws_b, plain_b));
    }
  EXPECT_GT(ws.bytes(), 0u);
  ws.release();
  EXPECT_EQ(ws.bytes(), 0u);
}

// Shapes are checked in every build (not by assertions): X [N, in] against W [out, in], Y
// [N, out] and bias [out]; the message names what was expected and what was given, and Y is
// not written.
TEST(Linear, WrongShapesThrowAndLeaveYAlone) {
  const Matrix<float> X = moh_test::random_matrix<float>(5, 7, 41);
  const Matrix<float> W = moh_test::random_matrix<float>(4, 7, 42);
  const Vector<float> b = moh_test::random_vector<float>(4, 43);
  const Matrix<float> Wshort = moh_test::random_matrix<float>(4, 6, 44);
  const Vector<float> b3 = moh_test::random_vector<float>(3, 45), b5 = moh_test::random_vector<float>(5, 46);
  moh::ThreadPool pool(2);
  for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool}) {
    // X has 7 columns, W 6.
    Matrix<float> Y = Matrix<float>::Constant(5, 4, 7.0f);
    const Matrix<float> before = Y;
    EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, Wshort, Y, p); }),
                         {"linear", "X", "in", "expected X with 6 columns, got 7"}));
    EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, Wshort, b, Y, p); }),
                         {"linear", "expected X with 6 columns, got 7"}));
    EXPECT_TRUE(BitEqual(Y, before));
    // Y with the wrong number of rows or columns.
    Matrix<float> Yrows = Matrix<float>::Constant(6, 4, 7.0f), Ycols = Matrix<float>::Constant(5, 3, 7.0f);
    EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, W, Yrows, p); }),
                         {"linear: Y", "expected shape [5, 4], got [6, 4]"}));
    EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, W, b, Ycols, p); }),
                         {"linear: Y", "expected shape [5, 4], got [5, 3]"}));
    EXPECT_TRUE(BitEqual(Yrows, Matrix<float>(Matrix<float>::Constant(6, 4, 7.0f))));
    EXPECT_TRUE(BitEqual(Ycols, Matrix<float>(Matrix<float>::Constant(5, 3, 7.0f))));
    // A bias of the wrong length, shorter or longer.
    EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, W, b3, Y, p); }),
                         {"linear: bias", "expected shape [4], got [3]"}));
    EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, W, b5, Y, p); }),
                         {"linear: bias", "expected shape [4], got [5]"}));
    EXPECT_TRUE(BitEqual(Y, before));
    // An empty bias is a bias of length 0, not "no bias".
    EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, W, Vector<float>(), Y, p); }),
                         {"linear: bias", "expected shape [4], got [0]"}));
    EXPECT_TRUE(BitEqual(Y, before));
  }
  // Double and strided views are checked the same way.
  const Matrix<double> Xd = moh_test::random_matrix<double>(6, 9, 47);
  const Matrix<double> Wd = moh_test::random_matrix<double>(5, 9, 48);
  Matrix<double> Yd(6, 5);
  EXPECT_THROW(moh::linear<double>(Xd.leftCols(8), Wd, Yd), moh::Error);
  EXPECT_THROW(moh::linear<double>(Xd, Wd.topRows(4), Yd), moh::Error);
  EXPECT_THROW(moh::linear<double>(Xd.topRows(5), Wd, Yd), moh::Error);
  EXPECT_NO_THROW(moh::linear<double>(Xd.topRows(5), Wd.topRows(4), Yd.block(1, 1, 5, 4)));
  // moh::Error is a std::invalid_argument.
  Matrix<float> Y(5, 4);
  EXPECT_THROW(moh::linear<float>(X, Wshort, Y), std::invalid_argument);
}

// project_dots (a router's logits) matches the naive product and gives each row the bits of that
// row alone, on any number of threads.
TEST(ProjectDots, MatchesNaiveAndEachRowStandsAlone) {
  const Index N = 150, D = 97, out = 11;  // more rows than one block of 64, odd sizes
  const Matrix<float> X = moh_test::random_matrix<float>(N, D, 71);
  const Matrix<float> W = moh_test::random_matrix<float>(out, D, 72);
  moh::ThreadPool pool(3);
  moh::Workspace ws;
  Matrix<float> one_thread(N, out), threads(N, out);
  {
    const moh::detail::WorkspaceLease lease(&ws, nullptr, "test");
    moh::detail::project_dots<float>(X, W, one_thread, lease.exec());
  }
  {
    const moh::detail::WorkspaceLease lease(&ws, &pool, "test");
    moh::detail::project_dots<float>(X, W, threads, lease.exec());
  }
  EXPECT_TRUE(moh_test::BitEqual(threads, one_thread));
  const Matrix<double> want = X.cast<double>() * W.cast<double>().transpose();
  EXPECT_LE(moh_test::max_abs_diff(one_thread, want), 1e-6 * (D + 2));
  for (Index r : {Index(0), Index(63), Index(64), N - 1}) {
    Matrix<float> row(1, out);
    const moh::detail::WorkspaceLease lease(&ws, nullptr, "test");
    moh::detail::project_dots<float>(X.middleRows(r, 1), W, row, lease.exec());
    EXPECT_TRUE(moh_test::BitEqual(row, Matrix<float>(one_thread.row(r)))) << "row " << r;
  }
}

// Zero rows is a valid shape (nothing to write); zero inputs gives the bias alone.
TEST(Linear, EmptyShapes) {
  const Matrix<float> W = moh_test::random_matrix<float>(4, 7, 51);
  const Vector<float> b = moh_test::random_vector<float>(4, 52);
  Matrix<float> none(0, 4);
  EXPECT_NO_THROW(moh::linear<float>(Matrix<float>(0, 7), W, b, none));
  const Matrix<float> X0(3, 0), W0(4, 0);
  Matrix<float> Y = Matrix<float>::Constant(3, 4, 5.0f);
  moh::linear<float>(X0, W0, b, Y);
  for (Index r = 0; r < 3; ++r) EXPECT_EQ(Matrix<float>(Y.row(r)), Matrix<float>(b.transpose()));
  moh::linear<float>(X0, W0, Y);
  EXPECT_EQ(Y, Matrix<float>::Zero(3, 4));
}

}  // namespace
