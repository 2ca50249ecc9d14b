// What every attention layer's config and weights have in common.
//
// AttentionConfig holds the fields all three configs share. Each config lists its fields once,
// in a static fields(config, visitor) that calls visitor(name, field) for each: that one list
// is what saving and loading a config (io/checkpoint.hpp) and reading a golden case's metadata
// (io/golden_case.hpp) walk, so a new field is added in one place. Enum fields are saved by the
// names in their EnumNames.
//
// WeightInfo names one tensor of a layer as the authors' PyTorch modules name it, with its
// PyTorch shape and the other layouts the same tensor is published in (LLaMA-style q_proj,
// k_proj, v_proj rows instead of one fused qkv, o_proj instead of proj). Each layer lists its
// tensors (weight_infos(config)), and every layer gets and sets them by name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moh/ops/weight_storage.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Fields every attention layer's config has.
struct AttentionConfig {
  Index embed_dim = 0;     // D
  Index head_dim = 0;      // d; 0 = embed_dim / num_heads for the layers that have num_heads
  bool rope = false;       // rotary position embedding on queries and keys (docs/semantics.md §4)
  double rope_theta = 10000.0;
  WeightStorage weight_storage = WeightStorage::Native;  // projections in T, bfloat16, T + packed

  /// Calls v(name, field) for each field, in the order a saved config lists them.
  template <class Self, class Visitor>
  static void fields(Self& c, Visitor&& v) {
    v("embed_dim", c.embed_dim);
    v("head_dim", c.head_dim);
    v("rope", c.rope);
    v("rope_theta", c.rope_theta);
    v("weight_storage", c.weight_storage);
  }
};

/// Fields of the layers with H query heads of their own (MultiHeadAttention, MoHAttention).
struct HeadsConfig : AttentionConfig {
  Index num_heads = 0;     // H
  Index num_kv_heads = 0;  // H_kv, dividing H; 0 = num_heads

  template <class Self, class Visitor>
  static void fields(Self& c, Visitor&& v) {
    AttentionConfig::fields(c, v);
    v("num_heads", c.num_heads);
    v("num_kv_heads", c.num_kv_heads);
  }
};

/// One tensor of a layer under its PyTorch name.
struct WeightInfo {
  std::string name;                  // e.g. "qkv.weight"
  std::vector<std::int64_t> shape;   // PyTorch shape, e.g. [3 H d, D]
  std::vector<WeightInfo> parts;     // or these tensors, stacked along the first axis
  std::vector<std::string> aliases;  // or the same tensor under one of these names

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    return n;
  }
};

/// A tensor that a checkpoint for another module (or another configuration) has and this layer
/// does not: load_weights() refuses a source that has it, naming what it belongs to, rather than
/// computing without it.
struct ForeignWeight {
  std::string name;     // e.g. "sr.weight"
  std::string meaning;  // e.g. "TransNeXt's aggregated attention (...), which moh does not have"
};

/// Tag of the constructors that build a layer with all weights zero (an explicit choice: a layer
/// built from its config alone has no weights, and forward() refuses to run until they are set).
struct ZeroWeights {};
inline constexpr ZeroWeights zero_weights{};

}  // namespace moh
