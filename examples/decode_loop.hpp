// The small decoder that the decoding examples (causal_decode, jetmoe_decode) write in user code
// around a moh attention layer `Attn` (moh::MoHAttention or moh::MoAAttention), with one
// moh::KvCache per layer. Each layer is
//
//   h = h + Attn(RMSNorm(h))
//   h = h + down(SiLU(gate(RMSNorm(h))) * up(RMSNorm(h)))   SwiGLU MLP (gated = true)
//   h = h + down(SiLU(up(RMSNorm(h))))                      plain MLP  (gated = false)
//
// followed by a final RMSNorm and an LM head tied to the token embedding (logits = h E^T).
// generate() runs greedy generation: the prompt as one forward_cached call, then each new token
// one call at a time. Weights are seeded normal values.
#pragma once

#include <moh/moh.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace decode_example {

using moh::Index;
using Matrix = moh::Matrix<float>;  // row-major [rows, cols]
using Vector = moh::Vector<float>;

/// out [T, D]: each row of x [T, D] divided by its root mean square, times weight [D].
inline void rms_norm(const Matrix& x, const Vector& weight, Matrix& out) {
  const Vector inv_rms =
      ((x.rowwise().squaredNorm() / static_cast<float>(x.cols())).array() + 1e-6f).rsqrt();
  out = inv_rms.asDiagonal() * x;
  out.array().rowwise() *= weight.transpose().array();
}

/// [rows, cols] of normal values with standard deviation `stddev` from `rng`.
inline Matrix random_matrix(Index rows, Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Matrix m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// What a single-token call's routing used: tokens per head (MoH) or per expert (MoA).
template <class T>
const std::vector<Index>& used_counts(const moh::MoHRouting<T>& r) { return r.head_counts; }
template <class T>
const std::vector<Index>& used_counts(const moh::MoARouting<T>& r) { return r.expert_counts; }

template <class Attn>
struct DecoderLayer {
  /// Seeded attention and MLP of hidden width `ffn`, a cache of `max_tokens` tokens.
  DecoderLayer(const typename Attn::Config& config, Index ffn, bool gated, Index max_tokens,
               std::uint64_t seed)
      : attn(config, seed),
        cache(attn.make_cache(/*batch=*/1, max_tokens)),
        attn_norm(Vector::Ones(config.embed_dim)),
        mlp_norm(Vector::Ones(config.embed_dim)) {
    std::mt19937 rng(static_cast<std::uint32_t>(seed));
    const Index D = config.embed_dim;
    const float in_scale = 1.0f / std::sqrt(static_cast<float>(D));
    if (gated) gate_proj = random_matrix(ffn, D, in_scale, rng);
    up_proj = random_matrix(ffn, D, in_scale, rng);
    down_proj = random_matrix(D, ffn, 1.0f / std::sqrt(static_cast<float>(ffn)), rng);
  }

  Attn attn;
  moh::KvCache<float> cache;             // this layer's keys/values [1, kv_heads, max_tokens, d]
  Vector attn_norm, mlp_norm;            // RMSNorm weights [D]
  Matrix gate_proj, up_proj, down_proj;  // [ffn, D] (empty: plain MLP), [ffn, D], [D, ffn]
  std::vector<Index> used;  // heads (MoH) or experts (MoA): single-token calls that used each
  Index calls = 0;          // single-token calls counted in `used`
};

template <class Attn>
struct Decoder {
  Matrix embedding;   // [vocab, D], also the LM head
  Vector final_norm;  // [D]
  std::vector<DecoderLayer<Attn>> layers;
  moh::Workspace workspace;  // scratch of every call: warm decode steps allocate nothing

  /// `num_layers` seeded layers (seeds 10, 11, ...) over a seeded [vocab, D] embedding.
  Decoder(const typename Attn::Config& config, Index vocab, Index ffn, bool gated,
          Index num_layers, Index max_tokens) {
    std::mt19937 rng(0);
    embedding = random_matrix(vocab, config.embed_dim, 0.02f, rng);
    final_norm = Vector::Ones(config.embed_dim);
    layers.reserve(static_cast<std::size_t>(num_layers));
    for (Index i = 0; i < num_layers; ++i)
      layers.emplace_back(config, ffn, gated, max_tokens, 10 + static_cast<std::uint64_t>(i));
  }

  /// Runs the next tokens `ids` (after those already cached) and returns the logits [vocab] of
  /// the last one. Single-token calls add their routing to each layer's `used`.
  Vector forward(const std::vector<Index>& ids) {
    const Index T = static_cast<Index>(ids.size()), D = embedding.cols();
    Matrix h(T, D), normed(T, D), update(T, D);  // [T, D]
    for (Index t = 0; t < T; ++t) h.row(t) = embedding.row(ids[t]);
    moh::ForwardOptions opts;  // forward_cached is causal by default
    opts.workspace = &workspace;
    typename Attn::RoutingRecord routing;
    for (DecoderLayer<Attn>& layer : layers) {
      rms_norm(h, layer.attn_norm, normed);
      layer.attn.forward_cached(moh::ConstTensorMap3<float>(normed.data(), 1, T, D),
                                moh::TensorMap3<float>(update.data(), 1, T, D), layer.cache,
                                opts, &routing);
      h += update;
      if (T == 1) {
        const std::vector<Index>& counts = used_counts(routing);
        layer.used.resize(counts.size(), 0);
        for (std::size_t i = 0; i < counts.size(); ++i) layer.used[i] += counts[i];
        ++layer.calls;
      }

      rms_norm(h, layer.mlp_norm, normed);
      Matrix hidden(T, layer.up_proj.rows());  // [T, ffn]
      moh::linear<float>(normed, layer.up_proj, hidden, nullptr, &workspace);
      if (layer.gate_proj.size() != 0) {
        Matrix gate(T, layer.gate_proj.rows());  // [T, ffn]
        moh::linear<float>(normed, layer.gate_proj, gate, nullptr, &workspace);
        hidden.array() *= gate.array() / (1.0f + (-gate.array()).exp());  // SiLU(g) * u
      } else {
        hidden.array() = hidden.array() / (1.0f + (-hidden.array()).exp());  // SiLU(u)
      }
      moh::linear<float>(hidden, layer.down_proj, update, nullptr, &workspace);
      h += update;
    }
    rms_norm(h, final_norm, normed);
    return embedding * normed.row(T - 1).transpose();  // tied LM head
  }
};

/// What generate() returns: every token fed to the model (the prompt, then the generated ones)
/// and the seconds the prompt and the generated tokens took.
struct Generation {
  std::vector<Index> sequence;
  double prefill_s = 0, decode_s = 0;
};

/// Greedy generation of `new_tokens` tokens after `prompt` (the prompt in one call).
template <class Attn>
Generation generate(Decoder<Attn>& model, const std::vector<Index>& prompt, int new_tokens) {
  using Clock = std::chrono::steady_clock;
  Generation g;
  g.sequence = prompt;
  const Clock::time_point start = Clock::now();
  Vector logits = model.forward(prompt);
  const Clock::time_point prompt_done = Clock::now();
  for (int i = 0; i < new_tokens; ++i) {
    Index next = 0;
    logits.maxCoeff(&next);  // greedy
    g.sequence.push_back(next);
    logits = model.forward({next});  // one new token per call
  }
  g.prefill_s = std::chrono::duration<double>(prompt_done - start).count();
  g.decode_s = std::chrono::duration<double>(Clock::now() - prompt_done).count();
  return g;
}

}  // namespace decode_example
