// MoH demo: does attention get cheaper when each token uses fewer heads?
//
// Runs dense multi-head attention, Mixture-of-Head attention (MoH) with 25/50/75/100% of its 12
// heads active per token, and Mixture of Attention heads (MoA) with 8, 16 and 32 experts of size
// 64 (top 2), on one ViT-B-shaped input (1 image x 197 tokens, D = 768), single-threaded. Prints
// the median time of 7 runs after a warm-up run, the ratio to MHA, and for the routed layers the
// time of the dense reference path (ComputeMode::Dense) and the largest difference between its
// output and the sparse path's.
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target moh_demo
//   ./build/examples/moh_demo
#include <moh/moh.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "timing.hpp"

using example_timing::median;
using example_timing::milliseconds;
using moh::Index;

// One line of the table: a layer, bound to the input, that writes y with the given compute mode.
struct Row {
  std::string name;
  double heads_active;  // share of (token, head) pairs computed, or experts used per token
  bool routed;          // has a sparse and a dense path
  std::function<void(moh::Tensor3<float>& y, moh::ComputeMode mode)> forward;
  std::vector<double> sparse_ms = {}, dense_ms = {};
};

int main() {
  const Index tokens = 197, D = 768, H = 12;
  const int runs = 7;
  moh::Tensor3<float> x(1, tokens, D);  // [batch, tokens, D]
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);

  std::vector<Row> rows;
  moh::MHAConfig mha_config;
  mha_config.embed_dim = D;
  mha_config.num_heads = H;
  rows.push_back({"MHA", 1.0, false,
                  [layer = moh::MultiHeadAttention<float>(mha_config, 1), &x](
                      moh::Tensor3<float>& y, moh::ComputeMode) { layer.forward(x, y); }});

  for (const Index percent : {25, 50, 75, 100}) {
    moh::MoHConfig config;
    config.embed_dim = D;
    config.num_heads = H;
    config.shared_heads = percent == 25 ? 1 : H / 4;
    config.active_routed_heads = H * percent / 100 - config.shared_heads;
    rows.push_back({"MoH " + std::to_string(config.shared_heads) + " + " +
                        std::to_string(config.active_routed_heads) + " of " + std::to_string(H),
                    config.active_fraction(), true,
                    [layer = moh::MoHAttention<float>(config, 2), &x](moh::Tensor3<float>& y,
                                                                      moh::ComputeMode mode) {
                      moh::ForwardOptions opts;
                      opts.mode = mode;
                      layer.forward(x, y, opts);
                    }});
  }

  for (const Index experts : {8, 16, 32}) {
    moh::MoAConfig config;
    config.embed_dim = D;
    config.head_dim = 64;
    config.num_experts = experts;
    config.top_k = 2;
    rows.push_back({"MoA top 2 of " + std::to_string(experts),
                    static_cast<double>(config.top_k) / experts, true,
                    [layer = moh::MoAAttention<float>(config, 3), &x](moh::Tensor3<float>& y,
                                                                      moh::ComputeMode mode) {
                      moh::ForwardOptions opts;
                      opts.mode = mode;
                      layer.forward(x, y, opts);
                    }});
  }

  // Correctness first: the sparse path must match the dense reference.
  moh::Tensor3<float> y(x.dimensions()), reference(x.dimensions());
  std::vector<float> max_diff(rows.size(), 0.0f);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    if (!rows[r].routed) continue;
    rows[r].forward(y, moh::ComputeMode::Sparse);
    rows[r].forward(reference, moh::ComputeMode::Dense);
    for (Index i = 0; i < y.size(); ++i)
      max_diff[r] = std::max(max_diff[r], std::abs(y.data()[i] - reference.data()[i]));
  }

  for (Row& row : rows) {
    for (const moh::ComputeMode mode : {moh::ComputeMode::Sparse, moh::ComputeMode::Dense}) {
      if (mode == moh::ComputeMode::Dense && !row.routed) continue;
      for (int run = 0; run <= runs; ++run) {  // run 0 warms up
        const double ms = milliseconds([&] { row.forward(y, mode); });
        if (run == 0) continue;
        (mode == moh::ComputeMode::Sparse ? row.sparse_ms : row.dense_ms).push_back(ms);
      }
    }
  }

  std::printf("1 x %ld tokens, D = %ld, 1 thread, median of %d runs\n\n", static_cast<long>(tokens),
              static_cast<long>(D), runs);
  std::printf("%-18s %7s %8s %7s %9s %11s\n", "layer", "heads", "ms", "vs MHA", "dense ms",
              "max|diff|");
  const double mha_ms = median(rows[0].sparse_ms);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const double ms = median(rows[r].sparse_ms);
    std::printf("%-18s %6.1f%% %8.2f %6.2fx", rows[r].name.c_str(), 100 * rows[r].heads_active,
                ms, ms / mha_ms);
    if (rows[r].routed)
      std::printf(" %9.2f %11.1e", median(rows[r].dense_ms), static_cast<double>(max_diff[r]));
    std::printf("\n");
  }
  std::printf("\nheads: share of heads each token uses (MoA: experts used per token).\n"
              "max|diff|: sparse path vs the dense reference (ComputeMode::Dense).\n");
  return 0;
}
