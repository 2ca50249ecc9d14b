// Tests for moh/linear.hpp: Y = X W^T + b against a naive loop, with and without bias, on strided
// views, and the tiled parallel form: bitwise the same for 1, 2 and 3 threads and equal to the
// serial GEMM, across shapes that cross the 128-row / 256-column tiles.
#include "moh/linear.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "reference/naive_blocks.hpp"

namespace {

using moh::Index;
using moh::Matrix;

struct Shape {
  Index rows, in, out;
};
// 1x1, odd small, exactly one tile, one past a tile in each direction, several tiles both ways.
const Shape kShapes[] = {{1, 1, 1},     {3, 5, 17},    {3, 17, 17},   {128, 9, 256},
                         {129, 7, 257}, {130, 33, 300}, {300, 4, 520}, {17, 64, 3}};

template <class T>
std::vector<double> bias_vector(const Matrix<T>& b) {
  return std::vector<double>(b.data(), b.data() + b.size());
}

TEST(Linear, MatchesNaiveWithAndWithoutBiasFloat) {
  for (const Shape& s : kShapes) {
    const Matrix<float> X = moh_test::random_matrix<float>(s.rows, s.in, 1);
    const Matrix<float> W = moh_test::random_matrix<float>(s.out, s.in, 2);
    const Matrix<float> b = moh_test::random_matrix<float>(1, s.out, 3);
    Matrix<float> Y(s.rows, s.out), Yb(s.rows, s.out);
    moh::linear<float>(X, W, nullptr, Y);
    moh::linear<float>(X, W, b.data(), Yb);
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
  const Matrix<double> b = moh_test::random_matrix<double>(1, 7, 6);
  Matrix<double> Y(13, 7);
  moh::linear<double>(X, W, b.data(), Y);
  EXPECT_LE(moh_test::max_abs_diff(Y, moh_test::naive_linear(X, W, bias_vector(b))), 1e-13);
}

TEST(Linear, StridedViewsAndUntouchedSurroundings) {
  // X, W and Y are blocks of larger matrices: only Y's block is written.
  const Matrix<float> Xbig = moh_test::random_matrix<float>(10, 20, 7);
  const Matrix<float> Wbig = moh_test::random_matrix<float>(9, 30, 8);
  const Matrix<float> b = moh_test::random_matrix<float>(1, 6, 9);
  Matrix<float> Ybig = Matrix<float>::Constant(12, 15, -99.0f);
  const auto X = Xbig.block(2, 3, 5, 11);
  const auto W = Wbig.block(1, 4, 6, 11);
  moh::linear<float>(X, W, b.data(), Ybig.block(4, 2, 5, 6));
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
  moh::linear<float>(X, W, b.data(), Ybig2.block(4, 2, 5, 6), &pool);
  EXPECT_EQ(Ybig2, Ybig);
}

TEST(Linear, ParallelIsBitwiseIdenticalForAnyThreadCount) {
  moh::ThreadPool p1(1), p2(2), p3(3);
  for (const Shape& s : kShapes) {
    for (bool with_bias : {false, true}) {
      const Matrix<float> X = moh_test::random_matrix<float>(s.rows, s.in, 11);
      const Matrix<float> W = moh_test::random_matrix<float>(s.out, s.in, 12);
      const Matrix<float> b = moh_test::random_matrix<float>(1, s.out, 13);
      const float* bias = with_bias ? b.data() : nullptr;
      Matrix<float> Y0(s.rows, s.out), Y1(s.rows, s.out), Y2(s.rows, s.out), Y3(s.rows, s.out);
      moh::linear<float>(X, W, bias, Y0, nullptr);
      moh::linear<float>(X, W, bias, Y1, &p1);
      moh::linear<float>(X, W, bias, Y2, &p2);
      moh::linear<float>(X, W, bias, Y3, &p3);
      EXPECT_EQ(Y1, Y0) << s.rows << "x" << s.in << "->" << s.out << " bias " << with_bias;
      EXPECT_EQ(Y2, Y0) << s.rows << "x" << s.in << "->" << s.out << " bias " << with_bias;
      EXPECT_EQ(Y3, Y0) << s.rows << "x" << s.in << "->" << s.out << " bias " << with_bias;
      // And the same run twice on a shared pool is deterministic.
      Matrix<float> Y3b(s.rows, s.out);
      moh::linear<float>(X, W, bias, Y3b, &p3);
      EXPECT_EQ(Y3b, Y3);
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
    const Matrix<double> b = moh_test::random_matrix<double>(1, s.out, 23);
    Matrix<double> serial(s.rows, s.out), parallel(s.rows, s.out);
    moh::linear<double>(X, W, b.data(), serial);
    moh::linear<double>(X, W, b.data(), parallel, &pool);
    EXPECT_LE(moh_test::max_abs_diff(parallel, serial), 1e-13)
        << s.rows << "x" << s.in << "->" << s.out;
    EXPECT_LE(moh_test::max_abs_diff(parallel, moh_test::naive_linear(X, W, bias_vector(b))),
              1e-13);
  }
}

}  // namespace
