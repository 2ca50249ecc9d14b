// Tests for moh/ops/rope.hpp: hand-computed rotations (rotate-half convention,
// docs/semantics.md §4), position 0 is the identity, the norm is kept, rotations compose and only
// relative positions matter for dot products, and RopeTable (in storage the caller provides) agrees
// with rope_apply.
#include "moh/ops/rope.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "test_helpers.hpp"

namespace {

using moh::Index;

/// Rotates `heads` head vectors of size d, `stride` apart, all at `position` (angles: scratch of
/// d values), from the library's two pieces.
template <class T>
void rope_apply(T* x, Index heads, Index stride, Index d, Index position, double base, T* angles) {
  moh::rope_angles(position, d, base, angles, angles + d / 2);
  for (Index h = 0; h < heads; ++h) moh::rope_rotate(x + h * stride, d, angles, angles + d / 2);
}

std::vector<double> rotated(std::vector<double> x, Index position, double base) {
  std::vector<double> angles(x.size());
  rope_apply(x.data(), 1, static_cast<Index>(x.size()), static_cast<Index>(x.size()),
                  position, base, angles.data());
  return x;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

TEST(Rope, HandComputedD4Position1) {
  // d = 4, base 10000: theta_0 = 10000^0 = 1, theta_1 = 10000^(-2/4) = 0.01. Position 1: angles
  // 1 and 0.01. Pairs are (0, 2) and (1, 3):
  //   out0 = x0 cos1 - x2 sin1,          out2 = x2 cos1 + x0 sin1
  //   out1 = x1 cos.01 - x3 sin.01,      out3 = x3 cos.01 + x1 sin.01
  const double c0 = std::cos(1.0), s0 = std::sin(1.0), c1 = std::cos(0.01), s1 = std::sin(0.01);
  const std::vector<double> x = {1.0, 2.0, 3.0, 4.0};
  const std::vector<double> want = {1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0,
                                    4 * c1 + 2 * s1};
  const std::vector<double> got = rotated(x, 1, 10000.0);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i], 1e-15) << i;

  // The angles themselves.
  double cs[2], sn[2];
  moh::rope_angles<double>(1, 4, 10000.0, cs, sn);
  EXPECT_NEAR(cs[0], c0, 1e-16);
  EXPECT_NEAR(sn[0], s0, 1e-16);
  EXPECT_NEAR(cs[1], c1, 1e-16);
  EXPECT_NEAR(sn[1], s1, 1e-16);
}

TEST(Rope, HandComputedD2AndFloat) {
  // d = 2 has one pair with theta_0 = 1 for any base; position 3 rotates (x0, x1) by 3 radians:
  // (x0 cos3 - x1 sin3, x1 cos3 + x0 sin3). With base 100 and d = 6 at position 2:
  // theta = 1, 100^(-1/3), 100^(-2/3) (= 0.215443469..., 0.046415888...).
  const std::vector<double> a = rotated({0.5, -2.0}, 3, 500.0);
  EXPECT_NEAR(a[0], 0.5 * std::cos(3.0) + 2.0 * std::sin(3.0), 1e-15);
  EXPECT_NEAR(a[1], -2.0 * std::cos(3.0) + 0.5 * std::sin(3.0), 1e-15);

  const double th[3] = {1.0, 0.21544346900318834, 0.046415888336127774};
  const std::vector<double> x = {1, 2, 3, 4, 5, 6};
  const std::vector<double> got = rotated(x, 2, 100.0);
  for (int j = 0; j < 3; ++j) {
    const double c = std::cos(2 * th[j]), s = std::sin(2 * th[j]);
    EXPECT_NEAR(got[j], x[j] * c - x[j + 3] * s, 1e-14) << j;
    EXPECT_NEAR(got[j + 3], x[j + 3] * c + x[j] * s, 1e-14) << j;
  }

  // Float: the same numbers to float rounding.
  std::vector<float> f = {1, 2, 3, 4, 5, 6};
  std::vector<float> angles(6);
  rope_apply(f.data(), 1, 6, 6, 2, 100.0, angles.data());
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(f[i], got[i], 1e-5) << i;
}

TEST(Rope, PositionZeroIsIdentity) {
  const moh::Matrix<float> m = moh_test::random_matrix<float>(3, 16, 7);
  moh::Matrix<float> r = m;
  std::vector<float> angles(16);
  rope_apply(r.data(), 3, 16, 16, 0, 10000.0, angles.data());
  EXPECT_EQ(r, m);  // cos 0 = 1, sin 0 = 0: bitwise the same
  std::vector<float> storage(static_cast<std::size_t>(moh::RopeTable<float>::storage_size(1, 16)));
  const moh::RopeTable<float> table(0, 1, 16, 500000.0, storage.data());
  moh::Matrix<float> t = m;
  table.rotate(t.row(1).data(), 0);
  EXPECT_EQ(t, m);
}

TEST(Rope, KeepsNormAndComposes) {
  const moh::Matrix<double> m = moh_test::random_matrix<double>(1, 64, 3);
  const std::vector<double> x(m.data(), m.data() + 64);
  for (Index pos : {1, 17, 1234, 100000}) {
    const std::vector<double> r = rotated(x, pos, 10000.0);
    EXPECT_NEAR(std::sqrt(dot(r, r)), std::sqrt(dot(x, x)), 1e-12) << pos;
  }
  // Rotating by a then by b is rotating by a + b (angles add).
  const std::vector<double> twice = rotated(rotated(x, 5, 10000.0), 9, 10000.0);
  const std::vector<double> once = rotated(x, 14, 10000.0);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(twice[i], once[i], 1e-12) << i;
}

TEST(Rope, DotProductDependsOnRelativePositionOnly) {
  // <R(m) q, R(n) k> = <R(m + s) q, R(n + s) k>: what makes a KV cache with RoPE work.
  const moh::Matrix<double> m = moh_test::random_matrix<double>(2, 12, 21);
  const std::vector<double> q(m.data(), m.data() + 12), k(m.data() + 12, m.data() + 24);
  const double ref = dot(rotated(q, 7, 10000.0), rotated(k, 3, 10000.0));
  for (Index s : {1, 10, 333})
    EXPECT_NEAR(dot(rotated(q, 7 + s, 10000.0), rotated(k, 3 + s, 10000.0)), ref, 1e-12) << s;
  // And it does depend on the offset: positions 7 and 3 vs 7 and 4 differ.
  EXPECT_GT(std::abs(dot(rotated(q, 7, 10000.0), rotated(k, 4, 10000.0)) - ref), 1e-6);
}

TEST(Rope, ApplyRotatesEveryHeadAndLeavesGapsAlone) {
  // Three heads of d = 6 laid out 8 apart: each head is rotated like a single vector, the two
  // padding columns between heads stay as they were.
  const Index d = 6, stride = 8, heads = 3;
  const moh::Matrix<float> m = moh_test::random_matrix<float>(1, heads * stride, 9);
  std::vector<float> x(m.data(), m.data() + heads * stride);
  const std::vector<float> before = x;
  std::vector<float> angles(d);
  rope_apply(x.data(), heads, stride, d, 11, 10000.0, angles.data());
  for (Index h = 0; h < heads; ++h) {
    std::vector<float> one(before.begin() + h * stride, before.begin() + h * stride + d);
    rope_apply(one.data(), 1, d, d, 11, 10000.0, angles.data());
    for (Index i = 0; i < d; ++i) EXPECT_EQ(x[h * stride + i], one[i]) << h << "," << i;
    for (Index i = d; i < stride; ++i) EXPECT_EQ(x[h * stride + i], before[h * stride + i]);
  }
}

TEST(Rope, TableEqualsApply) {
  // RopeTable(first, count) rotating at index i equals rope_apply at position first + i, bitwise.
  const Index d = 10, first = 37, count = 9;
  const double base = 10000.0;
  std::vector<float> storage(static_cast<std::size_t>(moh::RopeTable<float>::storage_size(count, d)));
  const moh::RopeTable<float> table(first, count, d, base, storage.data());
  const moh::Matrix<float> m = moh_test::random_matrix<float>(count, d, 5);
  std::vector<float> angles(d);
  for (Index i = 0; i < count; ++i) {
    std::vector<float> a(m.row(i).data(), m.row(i).data() + d), b = a;
    table.rotate(a.data(), i);
    rope_apply(b.data(), 1, d, d, first + i, base, angles.data());
    EXPECT_EQ(a, b) << "i " << i;
  }
  // Same in double with another base.
  std::vector<double> dstorage(static_cast<std::size_t>(moh::RopeTable<double>::storage_size(4, 4)));
  const moh::RopeTable<double> dtable(0, 4, 4, 500000.0, dstorage.data());
  for (Index i = 0; i < 4; ++i) {
    std::vector<double> a = {0.1, -0.2, 0.3, 0.4}, b = a;
    std::vector<double> ang(4);
    dtable.rotate(a.data(), i);
    rope_apply(b.data(), 1, 4, 4, i, 500000.0, ang.data());
    EXPECT_EQ(a, b) << i;
  }
}

TEST(Rope, TableLivesInTheStorageItIsGiven) {
  // storage_size(count, d) = count * d values (cos then sin per position); the table writes
  // exactly those and reads them back: a sentinel past the end stays, and changing the storage
  // changes the rotation (no hidden copy). A default table is empty (a layer without RoPE).
  const Index d = 8, count = 5, first = 3;
  const double base = 10000.0;
  EXPECT_EQ(moh::RopeTable<float>::storage_size(count, d), count * d);
  EXPECT_EQ(moh::RopeTable<float>::storage_size(0, d), 0);
  const float sentinel = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> storage(static_cast<std::size_t>(count * d + 4), sentinel);
  const moh::RopeTable<float> table(first, count, d, base, storage.data());
  EXPECT_TRUE(static_cast<bool>(table));
  EXPECT_FALSE(static_cast<bool>(moh::RopeTable<float>()));
  for (Index i = 0; i < count; ++i) {
    std::vector<float> cs(static_cast<std::size_t>(d / 2)), sn(static_cast<std::size_t>(d / 2));
    moh::rope_angles<float>(first + i, d, base, cs.data(), sn.data());
    for (Index j = 0; j < d / 2; ++j) {
      EXPECT_EQ(storage[static_cast<std::size_t>(i * d + j)], cs[static_cast<std::size_t>(j)]);
      EXPECT_EQ(storage[static_cast<std::size_t>(i * d + d / 2 + j)], sn[static_cast<std::size_t>(j)]);
    }
  }
  for (Index k = count * d; k < count * d + 4; ++k)
    EXPECT_TRUE(std::isnan(storage[static_cast<std::size_t>(k)])) << k;
  // Position first + 2 rotated through the table, then with its storage overwritten by the
  // angles of position 0 (cos 1, sin 0): the identity.
  const moh::Matrix<float> m = moh_test::random_matrix<float>(1, d, 13);
  std::vector<float> x(m.data(), m.data() + d), y = x, angles(static_cast<std::size_t>(d));
  table.rotate(x.data(), 2);
  rope_apply(y.data(), 1, d, d, first + 2, base, angles.data());
  EXPECT_EQ(x, y);
  for (Index j = 0; j < d / 2; ++j) {
    storage[static_cast<std::size_t>(2 * d + j)] = 1.0f;
    storage[static_cast<std::size_t>(2 * d + d / 2 + j)] = 0.0f;
  }
  std::vector<float> z(m.data(), m.data() + d);
  table.rotate(z.data(), 2);
  EXPECT_EQ(z, std::vector<float>(m.data(), m.data() + d));
}

}  // namespace
