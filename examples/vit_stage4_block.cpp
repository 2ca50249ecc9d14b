// MoH-ViT stage-4 block: the last stage of MoH-ViT (TransNeXt), whose attention is MoH over
// cosine attention with a continuous position bias (docs/semantics.md §8), written in user code
// on a 7x7 token grid (a 224 x 224 image at stride 32):
//
//   x = x + MoH(LayerNorm(x))                   12 heads of 32: 3 shared + top 6 of 9 routed
//   x = x + fc2(GELU(fc1(LayerNorm(x))))        hidden = 4 D
//
// TransNeXt's own block has a convolutional GLU MLP; a plain GELU MLP stands in for it here.
// Four images (4 x 49 tokens, D = 384) on a moh::ThreadPool with every hardware thread and one
// moh::Workspace. Prints the block's output norm and time, each head's share of tokens and mean
// gate, the attention layer's sparse path against ComputeMode::Dense (time and the largest
// difference), and one query's attention probabilities for one head as a 7x7 map.
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target vit_stage4_block
//   ./build/examples/vit_stage4_block
#include <moh/moh.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "timing.hpp"

using example_timing::median;
using example_timing::milliseconds;
using moh::Index;
using Matrix = moh::Matrix<float>;  // row-major [rows, cols]
using Vector = moh::Vector<float>;

constexpr float kNormEps = 1e-6f;  // MoH-ViT's LayerNorm(eps = 1e-6)

void gelu(Matrix& m) {  // exact (erf) GELU, in place
  m = m.unaryExpr([](float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678f)); });
}

// Seeded weights stand in for a checkpoint. With <moh/io.hpp>, the attention of a real MoH-ViT
// comes from its safetensors export (TransNeXt names stage 4's blocks block4.<j>):
//   moh::load_weights(block.attn, moh::SafeTensors::open(path), "block4.0.attn.");
// which reads qkv, proj, wg, wg_0, wg_1, temperature, query_embedding, cpb_fc1 and cpb_fc2.
struct Stage4Block {
  Stage4Block(const moh::MoHConfig& config, Index hidden, std::uint64_t seed)
      : attn(config, seed),
        norm1_weight(Vector::Ones(config.embed_dim)),
        norm1_bias(Vector::Zero(config.embed_dim)),
        norm2_weight(Vector::Ones(config.embed_dim)),
        norm2_bias(Vector::Zero(config.embed_dim)) {
    const Index D = config.embed_dim;
    std::mt19937 rng(static_cast<std::uint32_t>(seed));
    auto uniform = [&rng](Index rows, Index cols, Index fan_in) {  // torch.nn.Linear's init
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
      Matrix m(rows, cols);
      for (Index i = 0; i < m.size(); ++i) m.data()[i] = bound * u(rng);
      return m;
    };
    fc1_weight = uniform(hidden, D, D);
    fc1_bias = uniform(hidden, 1, D);
    fc2_weight = uniform(D, hidden, hidden);
    fc2_bias = uniform(D, 1, hidden);
  }

  moh::MoHAttention<float> attn;
  Vector norm1_weight, norm1_bias, norm2_weight, norm2_bias;  // [D]
  Matrix fc1_weight;                                          // [hidden, D]
  Vector fc1_bias;                                            // [hidden]
  Matrix fc2_weight;                                          // [D, hidden]
  Vector fc2_bias;                                            // [D]
};

struct Scratch {                  // reused by every call
  Matrix normed, update, hidden;  // [N, D], [N, D], [N, hidden]
};

// x: [B, T, D] with T = opts.grid_h * opts.grid_w, updated in place; `routing` receives the heads
// each token used.
void run_block(const Stage4Block& block, moh::Tensor3<float>& x, const moh::ForwardOptions& opts,
               Scratch& s, moh::MoHRouting<float>& routing) {
  const Index B = x.dimension(0), T = x.dimension(1), D = x.dimension(2), N = B * T;
  moh::MatrixMap<float> rows(x.data(), N, D);  // the same memory as [B*T, D] rows
  s.normed.resize(N, D);
  s.update.resize(N, D);
  s.hidden.resize(N, block.fc1_weight.rows());

  moh::layer_norm<float>(rows, block.norm1_weight, block.norm1_bias, s.normed, kNormEps);
  block.attn.forward(moh::ConstTensorMap3<float>(s.normed.data(), B, T, D),
                     moh::TensorMap3<float>(s.update.data(), B, T, D), opts, &routing);
  rows += s.update;

  moh::layer_norm<float>(rows, block.norm2_weight, block.norm2_bias, s.normed, kNormEps);
  moh::linear<float>(s.normed, block.fc1_weight, block.fc1_bias, s.hidden, opts.pool,
                     opts.workspace);
  gelu(s.hidden);
  moh::linear<float>(s.hidden, block.fc2_weight, block.fc2_bias, s.update, opts.pool,
                     opts.workspace);
  rows += s.update;
}

int main() {
  const Index grid = 7, batch = 4, tokens = grid * grid, D = 384, H = 12, hidden = 4 * D;
  // 3 shared heads + the top 6 of 9 routed heads: 9 of 12 heads (75%) per token.
  const moh::MoHConfig config = moh::MoHConfig::vit(D, H, /*shared=*/3, /*top K=*/6, grid, grid);
  const Stage4Block block(config, hidden, 2024);

  moh::Tensor3<float> x(batch, tokens, D);  // [B, T, D], T = 7 * 7 tokens in row-major grid order
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);

  moh::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  moh::Workspace workspace;  // scratch for every thread of the pool, reused by every call
  moh::ForwardOptions opts;
  opts.pool = &pool;
  opts.workspace = &workspace;
  opts.grid_h = opts.grid_w = grid;  // the position bias of this grid (computed once, then kept)
  Scratch scratch;
  moh::MoHRouting<float> routing;

  std::printf("MoH-ViT stage-4 block: %ld images x %ldx%ld tokens, D = %ld, %ld heads of %ld: "
              "%ld shared + top %ld of %ld routed, %d threads\n",
              long(batch), long(grid), long(grid), long(D), long(H), long(D / H),
              long(config.shared_heads), long(config.active_routed_heads),
              long(config.routed_heads()), pool.size());

  // LayerNorm(x) of the input, kept for the attention-only measurements below.
  Matrix normed(batch * tokens, D);
  moh::layer_norm<float>(moh::MatrixMap<float>(x.data(), batch * tokens, D), block.norm1_weight,
                         block.norm1_bias, normed, kNormEps);
  const moh::ConstTensorMap3<float> attn_in(normed.data(), batch, tokens, D);

  const double block_ms = milliseconds([&] { run_block(block, x, opts, scratch, routing); });
  std::printf("block output [%ld, %ld, %ld], Frobenius norm %.1f, %.2f ms (first call, position "
              "bias included)\n",
              long(batch), long(tokens), long(D),
              moh::MatrixMap<float>(x.data(), batch * tokens, D).norm(), block_ms);

  // Head usage: the share of tokens that used each head, and its mean gate where used.
  std::printf("heads used: %.0f%% of (token, head) pairs, load-balance loss %.3f (balanced: %ld)\n",
              100 * routing.active_fraction(), routing.load_balance_loss,
              long(config.active_routed_heads));
  std::printf("  head         ");
  for (Index h = 0; h < H; ++h)
    std::printf("%s%5ld", h == config.shared_heads ? " |" : "", long(h));
  std::printf("\n  tokens %%     ");
  for (Index h = 0; h < H; ++h)
    std::printf("%s%5.0f", h == config.shared_heads ? " |" : "",
                100.0 * routing.head_counts[h] / (batch * tokens));
  std::printf("\n  mean gate    ");
  for (Index h = 0; h < H; ++h) {
    const Index used = routing.head_counts[h];
    const double gate_sum = routing.gates.col(h).cast<double>().sum();
    std::printf("%s%5.2f", h == config.shared_heads ? " |" : "", used ? gate_sum / used : 0.0);
  }
  std::printf("\n  (heads 0-%ld shared, the rest routed)\n", long(config.shared_heads - 1));

  // The attention layer alone: the sparse path against the dense reference.
  moh::Tensor3<float> y_sparse(batch, tokens, D), y_dense(batch, tokens, D);
  moh::ForwardOptions dense_opts = opts;
  dense_opts.mode = moh::ComputeMode::Dense;
  auto sparse = [&] { block.attn.forward(attn_in, y_sparse, opts); };
  auto dense = [&] { block.attn.forward(attn_in, y_dense, dense_opts); };
  sparse();  // warm-up: the workspace grows to its high-water size
  dense();
  std::vector<double> sparse_runs, dense_runs;
  for (int i = 0; i < 25; ++i) {  // interleaved, so that a busy machine slows both alike
    sparse_runs.push_back(milliseconds(sparse));
    dense_runs.push_back(milliseconds(dense));
  }
  const double sparse_ms = median(sparse_runs), dense_ms = median(dense_runs);
  const float diff = (moh::MatrixMap<float>(y_sparse.data(), batch * tokens, D) -
                      moh::MatrixMap<float>(y_dense.data(), batch * tokens, D))
                         .cwiseAbs()
                         .maxCoeff();
  std::printf("attention: sparse %.3f ms, dense %.3f ms (median of 25; dense / sparse = %.2f), "
              "max |sparse - dense| = %.2e\n",
              sparse_ms, dense_ms, dense_ms / sparse_ms, diff);

  // Attention probabilities [B, H, T, T] of the centre token of image 0, for the first routed
  // head it uses (rows of heads a token does not use are zero). With seeded weights the map has
  // no spatial pattern; a trained head's position bias gives it one.
  moh::Tensor4<float> probs(batch, H, tokens, tokens);
  moh::ForwardOptions probs_opts = opts;
  probs_opts.attention_weights = probs;
  block.attn.forward(attn_in, y_sparse, probs_opts, &routing);
  const Index query = (grid / 2) * grid + grid / 2;
  Index head = 0;
  for (Index h : routing.heads_of(0, query))
    if (h >= config.shared_heads) {
      head = h;
      break;
    }
  std::printf("attention of token (%ld, %ld) in image 0, head %ld (routed, gate %.2f), %%:\n",
              long(grid / 2), long(grid / 2), long(head), routing.gates(query, head));
  float total = 0;
  for (Index r = 0; r < grid; ++r) {
    std::printf("  ");
    for (Index c = 0; c < grid; ++c) {
      const float p = probs(0, head, query, r * grid + c);
      total += p;
      std::printf(r * grid + c == query ? " [%4.1f]" : "  %4.1f ", 100 * p);
    }
    std::printf("\n");
  }
  std::printf("  (sum %.4f; [ ] = the query)\n", total);
  return 0;
}
