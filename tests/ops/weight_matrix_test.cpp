// Tests for moh/ops/weight_matrix.hpp: WeightMatrix storage (native and bfloat16, row-major and in
// column panels), linear() on a WeightMatrix against the GEMM on the rounded weights (every thread
// count, with and without a Workspace, bitwise the Matrix form for native storage), the shape
// checks of linear() on a WeightMatrix (moh::Error in every build), and the layers with bfloat16
// weights against the same layers holding the rounded weights in float. The float <-> bfloat16
// conversions themselves are tested in float16_test.cpp.
#include "moh/ops/weight_matrix.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moh/moh.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh::Vector;
using moh::WeightMatrix;
using moh::WeightStorage;
using moh_test::BitEqual;
using moh_test::error_of;
using moh_test::Mentions;

Matrix<float> rounded(const Matrix<float>& m) {
  Matrix<float> out(m.rows(), m.cols());
  for (Index i = 0; i < m.size(); ++i)
    out.data()[i] = moh::bfloat16_to_float(moh::float_to_bfloat16(m.data()[i]));
  return out;
}

/// The sizes of a linear(): X [n, in], W [out, in].
struct Shape {
  Index n, in, out;
};

/// Seeded inputs of a linear() of shape `s` (X from `seed`, W from seed + 1, the bias from seed + 2),
/// and W set into a WeightMatrix of the given storage.
struct LinearInputs {
  Matrix<float> X, W;
  Vector<float> bias;
  WeightMatrix<float> wm;

  LinearInputs(const Shape& s, WeightStorage storage, std::uint64_t seed)
      : X(moh_test::random_matrix<float>(s.n, s.in, seed)),
        W(moh_test::random_matrix<float>(s.out, s.in, seed + 1)),
        bias(moh_test::random_vector<float>(s.out, seed + 2)),
        wm(s.out, s.in, storage) {
    wm.set(W);
  }
};

TEST(WeightMatrix, StoresValuesRoundedAndHalvesTheBytes) {
  const Matrix<float> w = moh_test::random_matrix<float>(37, 53, 1);
  WeightMatrix<float> native(37, 53, WeightStorage::Native), bf16(37, 53, WeightStorage::BFloat16);
  native.set(w);
  bf16.set(w);
  EXPECT_EQ(native.values(), w);
  EXPECT_EQ(bf16.values(), rounded(w));
  EXPECT_NE(bf16.values(), w);
  EXPECT_EQ(bf16.bytes() * 2, native.bytes());
  const Matrix<float> top = moh_test::random_matrix<float>(5, 53, 2);
  bf16.set_rows(10, top);
  EXPECT_EQ(Matrix<float>(bf16.values().middleRows(10, 5)), rounded(top));
  EXPECT_EQ(Matrix<float>(bf16.values().topRows(10)), Matrix<float>(rounded(w).topRows(10)));
}

// Column panels change where the weights live, not what they are: values() and set_rows() see
// the same matrix as in row-major storage, and an untransposed operand at a panel's first column
// multiplies to the same bits as the row-major operand, for whole panels and a narrower last one.
TEST(WeightMatrix, ColumnPanelsHoldTheSameMatrix) {
  const Index rows = 40, cols = 300, panel = 128;  // panels of 128, 128 and 44 columns
  const Matrix<float> w = moh_test::random_matrix<float>(rows, cols, 6);
  const Matrix<float> part = moh_test::random_matrix<float>(7, cols, 7);
  const Matrix<float> A = moh_test::random_matrix<float>(13, 10, 8);
  for (WeightStorage storage : {WeightStorage::Native, WeightStorage::BFloat16}) {
    SCOPED_TRACE(moh::enum_name(storage));
    WeightMatrix<float> plain(rows, cols, storage), panels(rows, cols, storage, panel);
    EXPECT_EQ(panels.panel(), panel);
    EXPECT_EQ(plain.panel(), cols);
    plain.set(w);
    panels.set(w);
    plain.set_rows(20, part);
    panels.set_rows(20, part);
    EXPECT_EQ(panels.values(), plain.values());
    EXPECT_EQ(panels.bytes(), plain.bytes());
    EXPECT_THROW(panels.operand(0, 0, true), moh::Error);  // W^T would cross panels
    for (Index c0 = 0; c0 < cols; c0 += panel)
      for (Index r0 : {Index(0), Index(10), Index(30)}) {
        const Index n = std::min(panel, cols - c0);
        const moh::detail::GemmB<float> b = panels.operand(r0, c0, false);
        EXPECT_EQ(b.ld, n);
        EXPECT_EQ(b.reach, rows - r0);
        Matrix<float> got(A.rows(), n), want(A.rows(), n);
        moh::detail::Arena arena;
        moh::detail::multiply<float>(A.data(), A.cols(), b, got.data(), n, A.rows(), n, A.cols(),
                                     false, arena);
        moh::detail::multiply<float>(A.data(), A.cols(), plain.operand(r0, c0, false), want.data(),
                                     n, A.rows(), n, A.cols(), false, arena);
        EXPECT_TRUE(BitEqual(got, want)) << "rows from " << r0 << ", columns from " << c0;
      }
  }
}

// linear() on bfloat16 weights equals the GEMM on the rounded weights to float rounding, for a
// decode-sized and larger inputs, narrow and very wide rows, with and without bias, on every
// thread count and with a Workspace, all bitwise alike.
TEST(WeightMatrix, LinearMatchesTheGemmOnRoundedWeights) {
  moh::ThreadPool pool(2);
  moh::Workspace ws;
  for (const Shape& s : {Shape{1, 64, 96}, Shape{5, 33, 17}, Shape{130, 512, 700}, Shape{3, 70001, 5}}) {
    SCOPED_TRACE(testing::Message() << s.n << "x" << s.in << "x" << s.out);
    const LinearInputs in(s, WeightStorage::BFloat16, 3);
    const Matrix<float>& X = in.X;
    const Matrix<float>& W = in.W;
    const Vector<float>& bias = in.bias;
    const WeightMatrix<float>& wm = in.wm;
    const Matrix<double> ref = X.cast<double>() * rounded(W).cast<double>().transpose() +
                               bias.cast<double>().transpose().replicate(s.n, 1);
    const Matrix<double> ref_no_bias = X.cast<double>() * rounded(W).cast<double>().transpose();
    const double tol = 1e-5 * std::sqrt(static_cast<double>(s.in));
    Matrix<float> first_Y, first_Y0;
    for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool})
      for (moh::Workspace* w : {static_cast<moh::Workspace*>(nullptr), &ws}) {
        Matrix<float> Y(s.n, s.out), Y0(s.n, s.out);
        moh::linear<float>(X, wm, bias, Y, p, w);
        moh::linear<float>(X, wm, Y0, p, w);
        EXPECT_LE((Y.cast<double>() - ref).cwiseAbs().maxCoeff(), tol);
        EXPECT_LE((Y0.cast<double>() - ref_no_bias).cwiseAbs().maxCoeff(), tol);
        if (first_Y.size() == 0) {
          first_Y = Y;
          first_Y0 = Y0;
        }
        EXPECT_TRUE(BitEqual(Y, first_Y)) << "threads " << (p ? p->size() : 1) << " workspace " << (w != nullptr);
        EXPECT_TRUE(BitEqual(Y0, first_Y0)) << "threads " << (p ? p->size() : 1) << " workspace " << (w != nullptr);
      }
    // A sub-range of rows, no bias (what the layers' projections do with one fused weight; an
    // internal entry point now that the public linear() takes the whole matrix).
    const Index first = s.out / 3, count = s.out - first;
    Matrix<float> Z(s.n, count);
    {
      const moh::detail::WorkspaceLease lease(nullptr, nullptr, "test");
      moh::detail::project<float>(X, wm, first, nullptr, Z, lease.exec());
    }
    const Matrix<double> ref_z =
        X.cast<double>() * rounded(W).middleRows(first, count).cast<double>().transpose();
    EXPECT_LE((Z.cast<double>() - ref_z).cwiseAbs().maxCoeff(), tol);
  }
}

// With native storage a WeightMatrix holds the weights exactly as set, so linear() on it gives
// the bits of linear() on the Matrix, with and without bias, on any thread count.
TEST(WeightMatrix, NativeLinearIsBitwiseTheMatrixLinear) {
  moh::ThreadPool pool(3);
  for (const Shape& s : {Shape{1, 64, 96}, Shape{4, 17, 9}, Shape{5, 33, 17}, Shape{129, 70, 300}}) {
    SCOPED_TRACE(testing::Message() << s.n << "x" << s.in << "x" << s.out);
    const LinearInputs in(s, WeightStorage::Native, 13);
    for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool}) {
      Matrix<float> from_wm(s.n, s.out), from_matrix(s.n, s.out);
      moh::linear<float>(in.X, in.wm, in.bias, from_wm, p);
      moh::linear<float>(in.X, in.W, in.bias, from_matrix, p);
      EXPECT_TRUE(BitEqual(from_wm, from_matrix));
      moh::linear<float>(in.X, in.wm, from_wm, p);
      moh::linear<float>(in.X, in.W, from_matrix, p);
      EXPECT_TRUE(BitEqual(from_wm, from_matrix));
    }
  }
}

// NativePacked keeps the row-major matrix and adds the packed copy: values(), set_rows() and
// every product see the same matrix, bit for bit, as Native storage, for row-major and column
// panel storage, transposed operands from any row (a head's slice) and column, and any row count.
template <class T>
void check_packed_copy() {
  using S = moh::detail::GemmShape<T>;
  constexpr Index L = S::L;
  const Index rows = 2 * S::NR + 40, cols = S::KC + 64;
  const Matrix<T> w = moh_test::random_matrix<T>(rows, cols, 50);
  const Matrix<T> part = moh_test::random_matrix<T>(9, cols, 51);
  for (Index panel : {Index(0), Index(32)}) {
    SCOPED_TRACE(testing::Message() << "panel=" << panel);
    WeightMatrix<T> native(rows, cols, WeightStorage::Native, panel),
        packed(rows, cols, WeightStorage::NativePacked, panel);
    native.set(w);
    packed.set(w);
    native.set_rows(S::NR - 4, part);  // rows across a panel boundary of the packed copy
    packed.set_rows(S::NR - 4, part);
    EXPECT_EQ(packed.values(), native.values());
    const std::size_t padded = static_cast<std::size_t>((rows + S::NR - 1) / S::NR * S::NR);
    EXPECT_EQ(packed.bytes(), native.bytes() + (padded * cols + S::NR) * sizeof(T));
    EXPECT_EQ(packed.operand(0, 0, false).packed, nullptr);  // serves W^T only
    moh::detail::Arena arena;
    // Row offsets on a panel, half into one, a packet short of a panel's end (a head of one
    // packet), and off the packets (the kernels then read lanes past the columns, down to the
    // copy's last element: it must extend past its last panel).
    for (Index r0 : {Index(0), S::NR / 2, S::NR + S::NR / 2, rows - 16, rows - L, rows - 3})
      for (Index c0 : {Index(0), Index(32)})
        // 5: dot products; kDotRows + 1: the first row count that packs (gemm reads the copy).
        for (Index M : {Index(1), Index(4), Index(5), moh::detail::kDotRows + 1, Index(16),
                        Index(49)}) {
          const Index N = std::min<Index>(rows - r0, 2 * S::NR), K = cols - c0;
          for (Index n : {N, std::min<Index>(N, 32), std::min<Index>(N, 2)}) {
            SCOPED_TRACE(testing::Message() << "r0=" << r0 << " c0=" << c0 << " M=" << M
                                            << " N=" << n);
            const moh::detail::GemmB<T> b = packed.operand(r0, c0, true);
            ASSERT_NE(b.packed, nullptr);
            const Matrix<T> A = moh_test::random_matrix<T>(M, K, 52);
            Matrix<T> got = Matrix<T>::Ones(M, n), want = got;
            moh::detail::multiply<T>(A.data(), K, b, got.data(), n, M, n, K, true, arena);
            moh::detail::multiply<T>(A.data(), K, native.operand(r0, c0, true), want.data(), n, M,
                                     n, K, true, arena);
            EXPECT_TRUE(BitEqual(got, want));
          }
        }
  }
  // A matrix of one whole panel, read from a few rows before its end: the kernels' packets run
  // past the copy's last row (AddressSanitizer reads the bounds of the allocation here).
  WeightMatrix<T> native(S::NR, cols, WeightStorage::Native),
      packed(S::NR, cols, WeightStorage::NativePacked);
  native.set(w.topRows(S::NR));
  packed.set(w.topRows(S::NR));
  moh::detail::Arena arena;
  for (Index n : {Index(2), Index(3)}) {
    const Matrix<T> A = moh_test::random_matrix<T>(13, cols, 53);
    Matrix<T> got(13, n), want(13, n);
    moh::detail::multiply<T>(A.data(), cols, packed.operand(S::NR - n, 0, true), got.data(), n,
                             13, n, cols, false, arena);
    moh::detail::multiply<T>(A.data(), cols, native.operand(S::NR - n, 0, true), want.data(), n,
                             13, n, cols, false, arena);
    EXPECT_TRUE(BitEqual(got, want)) << "the last " << n << " rows";
  }
}

TEST(WeightMatrix, PackedCopyGivesTheBitsOfNativeStorage) {
  check_packed_copy<float>();
  check_packed_copy<double>();
  EXPECT_STREQ(moh::enum_name(WeightStorage::NativePacked), "native_packed");
}

// linear() on a WeightMatrix checks shapes in every build, like the Matrix form: X's columns
// against W's, Y [N, out] and the bias [out]; Y is not written when they disagree.
TEST(WeightMatrix, LinearRejectsWrongShapes) {
  const Matrix<float> X = moh_test::random_matrix<float>(5, 7, 21);
  const Matrix<float> X6 = moh_test::random_matrix<float>(5, 6, 22);
  const Vector<float> b = moh_test::random_vector<float>(4, 23), b3 = moh_test::random_vector<float>(3, 24);
  moh::ThreadPool pool(2);
  for (WeightStorage storage : {WeightStorage::Native, WeightStorage::BFloat16}) {
    SCOPED_TRACE(moh::enum_name(storage));
    WeightMatrix<float> wm(4, 7, storage);
    wm.set(moh_test::random_matrix<float>(4, 7, 25));
    for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool}) {
      Matrix<float> Y = Matrix<float>::Constant(5, 4, 3.0f);
      const Matrix<float> before = Y;
      EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X6, wm, Y, p); }),
                           {"linear", "expected X with 7 columns, got 6"}));
      EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X6, wm, b, Y, p); }),
                           {"linear", "expected X with 7 columns, got 6"}));
      Matrix<float> Yrows = Matrix<float>::Constant(4, 4, 3.0f), Ycols = Matrix<float>::Constant(5, 5, 3.0f);
      EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, wm, Yrows, p); }),
                           {"linear: Y", "expected shape [5, 4], got [4, 4]"}));
      EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, wm, b, Ycols, p); }),
                           {"linear: Y", "expected shape [5, 4], got [5, 5]"}));
      EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, wm, b3, Y, p); }),
                           {"linear: bias", "expected shape [4], got [3]"}));
      EXPECT_TRUE(Mentions(error_of([&] { moh::linear<float>(X, wm, Vector<float>(), Y, p); }),
                           {"linear: bias", "expected shape [4], got [0]"}));
      EXPECT_TRUE(BitEqual(Y, before));
      EXPECT_TRUE(BitEqual(Yrows, Matrix<float>(Matrix<float>::Constant(4, 4, 3.0f))));
      EXPECT_TRUE(BitEqual(Ycols, Matrix<float>(Matrix<float>::Constant(5, 5, 3.0f))));
      EXPECT_NO_THROW(moh::linear<float>(X, wm, b, Y, p));
    }
  }
  // An empty WeightMatrix (default-constructed) is [0, 0]: any X with columns is refused.
  const WeightMatrix<float> empty;
  Matrix<float> Y(5, 0);
  EXPECT_THROW(moh::linear<float>(X, empty, Y), moh::Error);
}

// ---- layers with bfloat16 weights ----------------------------------------------------------

/// max |a - b| over two tensors of the same shape (a test failure, and infinity, if they differ).
double max_diff(const moh::Tensor3<float>& a, const moh::Tensor3<float>& b) {
  if (a.dimensions() != b.dimensions()) {
    ADD_FAILURE() << "shapes differ";
    return std::numeric_limits<double>::infinity();
  }
  return moh_test::max_abs_diff(moh_test::rows_of(a), moh_test::rows_of(b));
}

/// Copies every tensor of `from` into `to` by name (the values `from` reports: exact for
/// bfloat16 storage).
template <class Layer>
void copy_weights(const Layer& from, Layer& to) {
  for (const moh::WeightInfo& info : from.weight_infos()) {
    const std::vector<float> values = from.weight(info.name);
    to.set_weight(info.name, values.data(), static_cast<Index>(values.size()));
  }
}

// Three copies of a layer: `bf16` stores bfloat16, `rounded` stores in float the values `bf16`
// reports, `exact` keeps the original float weights. The bfloat16 layer must equal `rounded` to
// float rounding (the storage is the only difference), and `exact` within bfloat16's precision.
template <class Layer, class Config>
void check_bf16_layer(Config config, bool same_routing, const char* what) {
  SCOPED_TRACE(what);
  Config native_config = config, bf16_config = config;
  native_config.weight_storage = WeightStorage::Native;
  bf16_config.weight_storage = WeightStorage::BFloat16;
  const Layer exact(native_config, 11), bf16(bf16_config, 11);
  Layer rounded(native_config);
  EXPECT_FALSE(rounded.weights_set());
  copy_weights(bf16, rounded);
  ASSERT_TRUE(rounded.weights_set());
  EXPECT_LT(bf16.weight_bytes(), exact.weight_bytes() * 6 / 10);

  moh::ThreadPool pool(2);
  for (bool causal : {false, true}) {
    moh::ForwardOptions o;
    o.causal = causal ? moh::Causal::On : moh::Causal::Off;
    const moh::Tensor3<float> x = moh_test::random_tensor<float>(2, 19, config.embed_dim, 5);
    const moh::Tensor3<float> y = bf16(x, o), y_rounded = rounded(x, o), y_exact = exact(x, o);
    const double scale = moh_test::scale_of(moh_test::rows_of(y_rounded));
    EXPECT_LE(max_diff(y, y_rounded), 2e-5 * scale);
    if (same_routing) {
      EXPECT_LE(max_diff(y, y_exact), 2e-2 * scale);
      EXPECT_GT(max_diff(y, y_exact), 0.0);  // the weights really were rounded
    }
    o.pool = &pool;
    EXPECT_TRUE(BitEqual(bf16(x, o), y));  // thread count does not change bfloat16 results

    // Decoding through the cache, one token at a time, equals the full forward.
    if (!causal) continue;
    moh::KvCache<float> cache = bf16.make_cache(2, 19);
    moh::Tensor3<float> y_steps(2, 19, config.embed_dim);
    for (Index t = 0; t < 19; ++t) {
      const Eigen::array<Index, 3> off{0, t, 0}, ext{2, 1, config.embed_dim};
      const moh::Tensor3<float> xs = x.slice(off, ext);
      moh::Tensor3<float> ys(2, 1, config.embed_dim);
      bf16.forward_cached(xs, ys, cache, o);
      y_steps.slice(off, ext) = ys;
    }
    EXPECT_LE(max_diff(y_steps, y), 2e-5 * scale);
  }
}

TEST(BFloat16Layers, MultiHeadAttention) {
  // embed_dim 512: 512 x 512 query rows span several widened tiles.
  const moh::MHAConfig c = moh_test::mha_config(512, 8, /*kv_heads=*/2, /*head_dim=*/0,
                                                /*bias=*/true, /*rope=*/true);
  check_bf16_layer<moh::MultiHeadAttention<float>>(c, true, "MHA, GQA, RoPE");
}

TEST(BFloat16Layers, MoHLearnedRouter) {
  const moh::MoHConfig c = moh_test::moh_config(96, 8, /*shared=*/2, /*routed_k=*/3,
                                                moh::MoHRouterKind::Learned, /*kv_heads=*/0,
                                                /*head_dim=*/24);
  // The learned router's weights stay in float, so routing matches the float layer exactly.
  check_bf16_layer<moh::MoHAttention<float>>(c, true, "MoH learned");
}

TEST(BFloat16Layers, MoHQueryNormRouterWithGqaAndRope) {
  const moh::MoHConfig c = moh_test::moh_config(128, 8, /*shared=*/1, /*routed_k=*/4,
                                                moh::MoHRouterKind::QueryNorm, /*kv_heads=*/4,
                                                /*head_dim=*/0, /*bias=*/false, /*rope=*/true);
  // Rounded query weights may flip a near-tied routing decision: compare with `rounded` only.
  check_bf16_layer<moh::MoHAttention<float>>(c, false, "MoH query norm");
}

TEST(BFloat16Layers, MoAWithWideExpertBlocks) {
  // embed_dim 1100: an expert's [D, d] query block spans several depth blocks.
  moh::MoAConfig c = moh_test::moa_config(1100, /*head_dim=*/64, /*experts=*/6, /*top_k=*/2);
  check_bf16_layer<moh::MoAAttention<float>>(c, true, "MoA");
  // The dense reference path agrees with the sparse one on bfloat16 weights too.
  c.weight_storage = WeightStorage::BFloat16;
  const moh::MoAAttention<float> layer(c, 3);
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(1, 9, c.embed_dim, 8);
  moh::ForwardOptions dense;
  dense.mode = moh::ComputeMode::Dense;
  const moh::Tensor3<float> y = layer(x);
  EXPECT_LE(max_diff(layer(x, dense), y), 2e-5 * moh_test::scale_of(moh_test::rows_of(y)));
}

// ---- layers with a packed copy of their weights ---------------------------------------------

// A layer with WeightStorage::NativePacked computes the bits of the same layer with Native
// storage on every path: the sparse and the dense path, causal or not, on one thread or a pool,
// and decoding through a cache; it holds more weight bytes (the copy; MoA's [in, out] experts,
// which the copy does not serve, have none), and reports the storage.
template <class Layer, class Config>
void check_packed_layer(Config config, const char* what, moh::ForwardOptions base = {}) {
  SCOPED_TRACE(what);
  Config packed_config = config;
  config.weight_storage = WeightStorage::Native;
  packed_config.weight_storage = WeightStorage::NativePacked;
  const Layer native(config, 13), packed(packed_config, 13);
  EXPECT_GT(packed.weight_bytes(), native.weight_bytes());
  EXPECT_EQ(packed.config().weight_storage, WeightStorage::NativePacked);
  moh::ThreadPool pool(2);
  const Index T = base.grid_h > 0 ? base.grid_h * base.grid_w : 21;
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(2, T, config.embed_dim, 14);
  for (bool causal : {false, true})
    for (moh::ComputeMode mode : Layer::kHasModes
                                     ? std::vector<moh::ComputeMode>{moh::ComputeMode::Sparse,
                                                                     moh::ComputeMode::Dense}
                                     : std::vector<moh::ComputeMode>{moh::ComputeMode::Auto})
      for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool}) {
        if (causal && base.grid_h > 0) continue;  // MoH-ViT: image tokens, no causal order
        SCOPED_TRACE(testing::Message() << "causal=" << causal << " mode=" << static_cast<int>(mode)
                                        << " pool=" << (p != nullptr));
        moh::ForwardOptions o = base;
        o.causal = causal ? moh::Causal::On : moh::Causal::Off;
        o.mode = mode;
        o.pool = p;
        EXPECT_TRUE(BitEqual(packed(x, o), native(x, o)));
      }
  if (base.grid_h > 0) return;
  moh::ForwardOptions o;
  moh::KvCache<float> a = native.make_cache(2, T), b = packed.make_cache(2, T);
  for (Index t = 0; t < T; t += 5) {  // a prompt of 5 tokens, then chunks of 5
    const Index n = std::min<Index>(5, T - t);
    const Eigen::array<Index, 3> off{0, t, 0}, ext{2, n, config.embed_dim};
    const moh::Tensor3<float> xs = x.slice(off, ext);
    moh::Tensor3<float> ya(2, n, config.embed_dim), yb(2, n, config.embed_dim);
    native.forward_cached(xs, ya, a, o);
    packed.forward_cached(xs, yb, b, o);
    EXPECT_TRUE(BitEqual(yb, ya)) << "decode from token " << t;
  }
}

TEST(PackedLayers, MultiHeadAttention) {
  const moh::MHAConfig c = moh_test::mha_config(256, 8, /*kv_heads=*/2, /*head_dim=*/0,
                                                /*bias=*/true, /*rope=*/true);
  check_packed_layer<moh::MultiHeadAttention<float>>(c, "MHA, GQA, RoPE");
}

TEST(PackedLayers, MoHLearnedRouterWithHeadsOfOddOffsets) {
  // heads of 24 and 32: slices that start inside a packed panel of the copy
  for (Index d : {Index(24), Index(32)}) {
    const moh::MoHConfig c = moh_test::moh_config(8 * d, 8, /*shared=*/2, /*routed_k=*/3,
                                                  moh::MoHRouterKind::Learned, /*kv_heads=*/0,
                                                  /*head_dim=*/d);
    check_packed_layer<moh::MoHAttention<float>>(c, d == 24 ? "MoH d=24" : "MoH d=32");
  }
}

TEST(PackedLayers, MoHQueryNormRouter) {
  const moh::MoHConfig c = moh_test::moh_config(128, 8, /*shared=*/1, /*routed_k=*/4,
                                                moh::MoHRouterKind::QueryNorm, /*kv_heads=*/4,
                                                /*head_dim=*/0, /*bias=*/false, /*rope=*/true);
  check_packed_layer<moh::MoHAttention<float>>(c, "MoH query norm");
}

TEST(PackedLayers, MoHViTCosineAttentionOnAGrid) {
  moh::ForwardOptions o;
  o.grid_h = o.grid_w = 7;
  check_packed_layer<moh::MoHAttention<float>>(moh::MoHConfig::vit(192, 6, 2, 2, 7, 7), "MoH-ViT",
                                               o);
}

TEST(PackedLayers, MoAAndJetMoE) {
  check_packed_layer<moh::MoAAttention<float>>(
      moh_test::moa_config(96, /*head_dim=*/32, /*experts=*/6, /*top_k=*/2), "MoA");
  check_packed_layer<moh::MoAAttention<float>>(moh::MoAConfig::jetmoe(128, 2, 4, 2, 32),
                                               "JetMoE");
}

}  // namespace
