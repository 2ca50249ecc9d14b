// Encoder block: a ViT-style pre-norm transformer encoder written in user code around
// moh::MoHAttention, with LayerNorm and the MLP written here with Eigen and moh::linear:
//
//   x = x + MoH(LayerNorm(x))
//   x = x + fc2(GELU(fc1(LayerNorm(x))))
//
// Four blocks run on ViT-S-sized random data (2 images x 197 tokens, D = 384, 6 heads: 1 shared +
// the top 2 of 5 routed, so each token uses half of the heads) on a moh::ThreadPool with every
// hardware thread. Prints each block's head usage and the norm of its output.
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target encoder_block
//   ./build/examples/encoder_block
#include <moh/moh.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <random>
#include <thread>
#include <vector>

using moh::Index;
using Matrix = moh::Matrix<float>;  // row-major [rows, cols]
using Vector = moh::Vector<float>;


// out [N, D]: each row of x [N, D] shifted to zero mean and scaled to unit variance, then
// multiplied by gamma [D] and shifted by beta [D].
void layer_norm(const Eigen::Ref<const Matrix>& x, const Vector& gamma, const Vector& beta,
                Matrix& out) {
  out = x.colwise() - x.rowwise().mean();
  const Vector inv_std =
      ((out.rowwise().squaredNorm() / static_cast<float>(x.cols())).array() + 1e-6f).rsqrt();
  out.array().colwise() *= inv_std.array();
  out.array().rowwise() *= gamma.transpose().array();
  out.rowwise() += beta.transpose();
}

void gelu(Matrix& m) {  // exact (erf) GELU, in place
  m = m.unaryExpr([](float v) { return 0.5f * v * (1.0f + std::erf(v / std::sqrt(2.0f))); });
}

struct EncoderBlock {
  EncoderBlock(const moh::MoHConfig& config, Index hidden, std::uint64_t seed)
      : attn(config, seed) {
    const Index D = config.embed_dim;
    std::srand(static_cast<unsigned>(seed));  // Eigen's Random draws from std::rand
    norm1_weight = norm2_weight = Vector::Ones(D);
    norm1_bias = norm2_bias = Vector::Zero(D);
    const float bound1 = 1.0f / std::sqrt(static_cast<float>(D));
    const float bound2 = 1.0f / std::sqrt(static_cast<float>(hidden));
    fc1_weight = bound1 * Matrix::Random(hidden, D);
    fc1_bias = bound1 * Vector::Random(hidden);
    fc2_weight = bound2 * Matrix::Random(D, hidden);
    fc2_bias = bound2 * Vector::Random(D);
  }

  moh::MoHAttention<float> attn;
  Vector norm1_weight, norm1_bias, norm2_weight, norm2_bias;  // [D]
  Matrix fc1_weight;                                          // [hidden, D]
  Vector fc1_bias;                                            // [hidden]
  Matrix fc2_weight;                                          // [D, hidden]
  Vector fc2_bias;                                            // [D]
};

struct Scratch {  // reused by every block
  Matrix normed, update, hidden;  // [N, D], [N, D], [N, hidden]
};

// x: [B, T, D], updated in place; `routing` receives the heads each token used.
void run_block(const EncoderBlock& block, moh::Tensor3<float>& x, const moh::ForwardOptions& opts,
               Scratch& s, moh::MoHRouting<float>& routing) {
  const Index B = x.dimension(0), T = x.dimension(1), D = x.dimension(2), N = B * T;
  moh::MatrixMap<float> rows(x.data(), N, D);  // the same memory as [B*T, D] rows
  s.normed.resize(N, D);
  s.update.resize(N, D);
  s.hidden.resize(N, block.fc1_weight.rows());

  layer_norm(rows, block.norm1_weight, block.norm1_bias, s.normed);
  block.attn.forward(moh::ConstTensorMap3<float>(s.normed.data(), B, T, D),
                     moh::TensorMap3<float>(s.update.data(), B, T, D), opts, &routing);
  rows += s.update;

  layer_norm(rows, block.norm2_weight, block.norm2_bias, s.normed);
  moh::linear<float>(s.normed, block.fc1_weight, block.fc1_bias, s.hidden, opts.pool, opts.workspace);
  gelu(s.hidden);
  moh::linear<float>(s.hidden, block.fc2_weight, block.fc2_bias, s.update, opts.pool, opts.workspace);
  rows += s.update;
}

int main() {
  const Index batch = 2, tokens = 197, D = 384, hidden = 4 * D, depth = 4;
  moh::MoHConfig config;
  config.embed_dim = D;
  config.num_heads = 6;
  config.shared_heads = 1;
  config.active_routed_heads = 2;  // of 5 routed heads

  std::vector<EncoderBlock> blocks;
  for (Index i = 0; i < depth; ++i) blocks.emplace_back(config, hidden, 100 + i);

  moh::Tensor3<float> x(batch, tokens, D);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);

  moh::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  moh::Workspace workspace;  // scratch for every thread of the pool, reused by every block
  moh::ForwardOptions opts;
  opts.pool = &pool;
  opts.workspace = &workspace;
  Scratch scratch;
  moh::MoHRouting<float> routing;

  std::cout << depth << " blocks, " << batch << " x " << tokens << " tokens, D = " << D
            << ", heads: " << config.shared_heads << " shared + top "
            << config.active_routed_heads << " of " << config.routed_heads() << " routed, "
            << pool.size() << " threads\n"
            << std::fixed << std::setprecision(1);
  const auto start = std::chrono::steady_clock::now();
  for (Index i = 0; i < depth; ++i) {
    run_block(blocks[i], x, opts, scratch, routing);
    std::cout << "block " << i << ": heads used " << 100 * routing.active_fraction()
              << "%, load-balance loss " << std::setprecision(3) << routing.load_balance_loss
              << std::setprecision(1) << ", |x| = "
              << moh::MatrixMap<float>(x.data(), batch * tokens, D).norm()
              << "\n  tokens per head:";
    for (Index h = 0; h < config.num_heads; ++h)
      std::cout << ' ' << 100.0 * routing.head_counts[h] / (batch * tokens) << '%'
                << (h < config.shared_heads ? " (shared)" : "");
    std::cout << '\n';
  }
  const std::chrono::duration<double, std::milli> elapsed =
      std::chrono::steady_clock::now() - start;
  std::cout << "output [" << x.dimension(0) << ", " << x.dimension(1) << ", " << x.dimension(2)
            << "], Frobenius norm " << moh::MatrixMap<float>(x.data(), batch * tokens, D).norm()
            << ", " << elapsed.count() << " ms for " << depth << " blocks\n";
  return 0;
}
