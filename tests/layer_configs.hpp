// The layer configs that the tests and the benchmarks (bench/) both build, from their sizes:
// one builder per layer, every other field at its default. Defaults here: bias on, no RoPE,
// kv_heads 0 (= num_heads), head_dim 0 (= embed_dim / num_heads), the learned MoH router.
#pragma once

#include "moh/moh.hpp"

namespace moh_test {

using moh::Index;

/// A config with the fields every layer has (AttentionConfig): D = embed_dim, head_dim, RoPE.
template <class Config>
Config attention_config(Index D, Index head_dim, bool rope) {
  Config c;
  c.embed_dim = D;
  c.head_dim = head_dim;
  c.rope = rope;
  return c;
}

/// A config of the layers with heads (MHAConfig, MoHConfig): H query heads over `kv_heads`
/// key/value heads of `head_dim`.
template <class Config>
Config heads_config(Index D, Index H, Index kv_heads, Index head_dim, bool rope) {
  Config c = attention_config<Config>(D, head_dim, rope);
  c.num_heads = H;
  c.num_kv_heads = kv_heads;
  return c;
}

/// MHA, with or without the projections' biases.
inline moh::MHAConfig mha_config(Index D, Index H, Index kv_heads = 0, Index head_dim = 0,
                                 bool bias = true, bool rope = false) {
  moh::MHAConfig c = heads_config<moh::MHAConfig>(D, H, kv_heads, head_dim, rope);
  c.bias = bias;
  return c;
}
/// MoH: `shared` heads always on and the top `routed_k` of the other H - shared per token.
inline moh::MoHConfig moh_config(Index D, Index H, Index shared, Index routed_k,
                                 moh::MoHRouterKind router = moh::MoHRouterKind::Learned,
                                 Index kv_heads = 0, Index head_dim = 0, bool bias = true,
                                 bool rope = false) {
  moh::MoHConfig c = heads_config<moh::MoHConfig>(D, H, kv_heads, head_dim, rope);
  c.shared_heads = shared;
  c.active_routed_heads = routed_k;
  c.router = router;
  c.qkv_bias = c.proj_bias = bias;
  return c;
}
/// MoA: `experts` heads of `head_dim` over one shared key/value head, top_k per token.
inline moh::MoAConfig moa_config(Index D, Index head_dim, Index experts, Index top_k,
                                 moh::MoAGating gating = moh::MoAGating::Softmax) {
  moh::MoAConfig c = attention_config<moh::MoAConfig>(D, head_dim, /*rope=*/false);
  c.num_experts = experts;
  c.top_k = top_k;
  c.gating = gating;
  return c;
}

}  // namespace moh_test
