// Golden cases: a safetensors file that carries a layer's weights, an input and the expected
// outputs (format "moh-case/1", the golden-case format of ../shared/spec/FIXTURES.md), so that a
// model checks itself.
//
// run_case() builds the layer the metadata names ("mha", "moh", "moa", "moh_llama", "moh_vit",
// "jetmoe"): its config comes from the metadata keys that are fields of the config (the same
// fields() list that saving and loading a config walks), over the defaults of the layer kind;
// then it loads the weights, runs the layer on `x` (with `key_padding_mask`, `attn_bias`,
// `query_padding_mask`, `causal` and the token grid `grid_h` x `grid_w`; with `memory`, as
// cross-attention; with `decode_from` = P, the first P tokens go as one prompt call and every
// later token through the KV cache one at a time), and compares every expected tensor e with the
// computed c: max|c - e| <= 1e-4 * max(1, max|e|), and every 0 of `gates` / `head_mask` must be
// exactly 0. Malformed files throw moh::Error.
//
// Not part of <moh/io.hpp>: include this header where cases are run (tools, tests).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "moh/io/checkpoint.hpp"

namespace moh {

/// One expected tensor compared with the computed one.
struct CaseCheck {
  std::string name;
  double max_error = 0;       // max |computed - expected|
  double tolerance = 0;       // 1e-4 * max(1, max |expected|)
  bool zeros_exact = true;    // for gates / head_mask: expected zeros computed as exact zeros
  bool passed() const { return max_error <= tolerance && zeros_exact; }
};

struct CaseResult {
  std::string layer;
  std::vector<CaseCheck> checks;
  bool passed() const {
    return !checks.empty() &&
           std::all_of(checks.begin(), checks.end(), [](const CaseCheck& c) { return c.passed(); });
  }
};

namespace detail {

inline Index metadata_int(const TensorSource& st, const std::string& key) {
  const std::string& text = st.metadata_value(key);
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    fail("metadata '", key, "' in ", st.source(), ": expected an integer, got '", text, "'");
  // Sizes and counts only: bounded so that products of a few of them cannot overflow.
  constexpr long long kMax = 1LL << 31;
  if (v < 0 || v > kMax)
    fail("metadata '", key, "' in ", st.source(), ": expected an integer in [0, ", kMax, "], got ",
         v);
  return static_cast<Index>(v);
}

inline double metadata_double(const TensorSource& st, const std::string& key) {
  const std::string& text = st.metadata_value(key);
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(v))
    fail("metadata '", key, "' in ", st.source(), ": expected a number, got '", text, "'");
  return v;
}

inline bool metadata_flag(const TensorSource& st, const std::string& key) {
  const Index v = metadata_int(st, key);
  require(v == 0 || v == 1, "metadata '", key, "' in ", st.source(), ": expected 0 or 1, got ", v);
  return v == 1;
}

/// Visits a config's fields() and reads each one the case's metadata has (strings).
struct MetadataFields {
  const TensorSource& st;
  void operator()(const char* key, Index& out) const {
    if (st.has_metadata(key)) out = metadata_int(st, key);
  }
  void operator()(const char* key, bool& out) const {
    if (st.has_metadata(key)) out = metadata_flag(st, key);
  }
  void operator()(const char* key, double& out) const {
    if (st.has_metadata(key)) out = metadata_double(st, key);
  }
  template <class Enum, std::enable_if_t<std::is_enum<Enum>::value, int> = 0>
  void operator()(const char* key, Enum& out) const {
    if (st.has_metadata(key) && !parse_enum(st.metadata_value(key), out))
      fail("metadata '", key, "' in ", st.source(), ": expected one of ", enum_list<Enum>(),
           ", got '", st.metadata_value(key), "'");
  }
};

/// `c` (the layer kind's defaults) with the fields the metadata sets, validated. The keys FIXTURES.md
/// lists for the layer kind (`required`) must be there.
template <class Config>
Config case_config(const TensorSource& st, Config c, std::vector<std::string> required) {
  required.insert(required.end(), {"embed_dim", "head_dim", "causal"});
  for (const std::string& key : required)
    require(st.has_metadata(key), "case ", st.source(), ": metadata '", key, "' missing: expected ",
            "it for a ", st.metadata_value("layer"), " case");
  Config::fields(c, MetadataFields{st});
  c.validate();
  return c;
}

/// Throws unless the file holds at least as many values as the layer's weights: metadata that
/// describes a layer larger than the file is an error before any allocation.
inline void require_weights_fit(const TensorSource& st, const std::vector<WeightInfo>& weights,
                                const std::string& layer) {
  double needed = 0, held = 0;
  for (const WeightInfo& w : weights) needed += static_cast<double>(w.numel());
  for (const std::string& name : st.names()) held += static_cast<double>(st.info(name).numel());
  if (needed > held)
    fail("case ", st.source(), ": metadata describes a ", layer, " layer with ", needed,
         " weights: expected at most the ", held, " values the file holds");
}

template <class T>
CaseCheck compare(const TensorSource& st, const std::string& name, const T* computed,
                  std::size_t count, bool exact_zeros) {
  const std::vector<double> expected = st.values<double>(name);
  require(expected.size() == count, "case ", st.source(), ": tensor '", name, "': expected ",
          count, " values for this layer, got ", expected.size());
  CaseCheck c;
  c.name = name;
  double scale = 1.0;
  for (std::size_t i = 0; i < count; ++i) {
    const double got = static_cast<double>(computed[i]);
    if (std::isfinite(expected[i])) scale = std::max(scale, std::abs(expected[i]));
    // A NaN or infinity on either side is a failure, never a silently ignored comparison.
    const double err = std::isfinite(got) && std::isfinite(expected[i])
                           ? std::abs(got - expected[i])
                           : std::numeric_limits<double>::infinity();
    c.max_error = std::max(c.max_error, err);
    if (exact_zeros && expected[i] == 0.0 && got != 0.0) c.zeros_exact = false;
  }
  c.tolerance = 1e-4 * scale;
  return c;
}

template <class T>
CaseCheck compare(const TensorSource& st, const std::string& name, const std::vector<T>& v,
                  bool exact_zeros = false) {
  return compare(st, name, v.data(), v.size(), exact_zeros);
}

template <class T>
Tensor3<T> slice_tokens(const Tensor3<T>& x, Index first, Index count) {
  const Eigen::array<Index, 3> offsets{0, first, 0}, extents{x.dimension(0), count, x.dimension(2)};
  return x.slice(offsets, extents);
}

/// What running a case's layer produced: y [B, T, D] and the routing of each call with the
/// tokens it covered (one call, or the prompt and then one per decoded token).
template <class T, class Routing>
struct CaseRun {
  Tensor3<T> y;
  struct Call {
    Index first = 0, tokens = 0;
    Routing routing;
  };
  std::vector<Call> calls;
};

/// Throws unless every tensor of the case is a weight of the layer, an input the runner feeds
/// or one of the layer kind's `outputs`, and every metadata key is a field of the config or one
/// the runner reads: a case that asks for something this runner does not do fails loudly
/// instead of passing or failing on numbers computed without it.
template <class Config>
void require_known_contents(const TensorSource& st, const std::vector<WeightInfo>& weights,
                            const Config& c, const std::vector<std::string>& outputs) {
  std::set<std::string> known = {"x", "key_padding_mask", "memory", "attn_bias",
                                 "query_padding_mask"};
  known.insert(outputs.begin(), outputs.end());
  for (const WeightInfo& w : weights) {
    known.insert(w.name);
    known.insert(w.aliases.begin(), w.aliases.end());
    for (const WeightInfo& part : w.parts) known.insert(part.name);
  }
  std::string listed;
  for (const std::string& name : known) listed += (listed.empty() ? "" : ", ") + name;
  for (const std::string& name : st.names())
    if (!known.count(name))
      fail("case ", st.source(), ": tensor '", name, "' is not something this ",
           st.metadata_value("layer"), " case runner uses: expected only [", listed, "]");
  std::set<std::string> keys = {"format", "layer", "causal", "decode_from", "grid_h", "grid_w"};
  Config::fields(c, [&](const char* key, const auto&) { keys.insert(key); });
  listed.clear();
  for (const std::string& key : keys) listed += (listed.empty() ? "" : ", ") + key;
  for (const auto& entry : st.metadata())
    if (!keys.count(entry.first))
      fail("case ", st.source(), ": metadata '", entry.first, "' is not something this ",
           st.metadata_value("layer"), " case runner reads: expected only [", listed, "]");
}

/// Builds `Layer` from `c`, loads its weights from the case and runs it as the case says.
template <class Layer>
CaseRun<typename Layer::Scalar, typename Layer::RoutingRecord> run_layer(
    const SafeTensors& st, const typename Layer::Config& c, const std::vector<std::string>& outputs) {
  using T = typename Layer::Scalar;
  const std::vector<WeightInfo> weights = Layer::weight_infos(c);
  require_known_contents(st, weights, c, outputs);
  require_weights_fit(st, weights, st.metadata_value("layer"));
  Layer layer(c);
  load_weights(layer, st);
  const Tensor3<T> x = st.tensor3<T>("x");
  require_shape3(std::string("case ") + st.source() + ": x", x, -1, -1, c.embed_dim);
  const Index B = x.dimension(0), Tn = x.dimension(1), D = c.embed_dim;
  const Mask padding = st.contains("key_padding_mask") ? st.mask("key_padding_mask") : Mask();
  ForwardOptions opts;
  opts.causal = metadata_flag(st, "causal") ? Causal::On : Causal::Off;
  if (st.has_metadata("grid_h")) opts.grid_h = metadata_int(st, "grid_h");
  if (st.has_metadata("grid_w")) opts.grid_w = metadata_int(st, "grid_w");
  const Mask query_padding =
      st.contains("query_padding_mask") ? st.mask("query_padding_mask") : Mask();
  if (st.contains("query_padding_mask")) opts.query_padding_mask = map_mask(query_padding);
  const Tensor4<T> bias = st.contains("attn_bias") ? st.tensor4<T>("attn_bias") : Tensor4<T>();
  CaseRun<T, typename Layer::RoutingRecord> run;
  run.y = Tensor3<T>(B, Tn, D);

  if (!st.has_metadata("decode_from")) {
    if (st.contains("attn_bias")) opts.attn_bias = bias;
    if (st.contains("key_padding_mask")) opts.key_padding_mask = map_mask(padding);
    run.calls.resize(1);
    run.calls[0].tokens = Tn;
    if (st.contains("memory")) {
      const Tensor3<T> memory = st.tensor3<T>("memory");
      layer.forward_cross(x, memory, run.y, opts, &run.calls[0].routing);
    } else {
      layer.forward(x, run.y, opts, &run.calls[0].routing);
    }
    return run;
  }
  const Index P = metadata_int(st, "decode_from");
  require(P >= 0 && P <= Tn, "case ", st.source(), ": decode_from: expected 0..", Tn, ", got ", P);
  require(!st.contains("memory") && !st.contains("query_padding_mask"), "case ", st.source(),
          ": decode_from: expected a self-attention case without query_padding_mask, got ",
          st.contains("memory") ? "a memory" : "a query_padding_mask");
  KvCache<T> cache = layer.make_cache(B, std::max<Index>(Tn, 1));
  for (Index t0 = 0; t0 < Tn;) {
    const Index n = (t0 == 0 && P > 0) ? P : 1;
    const Tensor3<T> xs = slice_tokens(x, t0, n);
    Tensor3<T> ys(B, n, D);
    Mask chunk;
    ForwardOptions o = opts;
    if (st.contains("key_padding_mask")) {
      const Eigen::array<Index, 2> off{0, t0}, ext{B, n};
      chunk = padding.slice(off, ext);
      o.new_token_padding_mask = map_mask(chunk);
    }
    Tensor4<T> bias_rows;  // this call's queries over the keys cached so far
    if (st.contains("attn_bias")) {
      require(bias.dimension(2) == Tn && bias.dimension(3) == Tn, "case ", st.source(),
              ": attn_bias: expected [B|1, H|1, ", Tn, ", ", Tn, "] with decode_from, got [",
              bias.dimension(0), ", ", bias.dimension(1), ", ", bias.dimension(2), ", ",
              bias.dimension(3), "]");
      const Eigen::array<Index, 4> off{0, 0, t0, 0},
          ext{bias.dimension(0), bias.dimension(1), n, t0 + n};
      bias_rows = bias.slice(off, ext);
      o.attn_bias = bias_rows;
    }
    run.calls.emplace_back();
    run.calls.back().first = t0;
    run.calls.back().tokens = n;
    layer.forward_cached(xs, ys, cache, o, &run.calls.back().routing);
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < n; ++t)
        for (Index j = 0; j < D; ++j) run.y(b, t0 + t, j) = ys(b, t, j);
    t0 += n;
  }
  return run;
}

template <class T>
std::vector<T> values_of(const Tensor3<T>& y) {
  return std::vector<T>(y.data(), y.data() + y.size());
}

/// A MoH run's gates as [B, T, H], whatever calls produced them.
template <class T>
std::vector<T> gates_of(const CaseRun<T, MoHRouting<T>>& run) {
  const Index B = run.y.dimension(0), Tn = run.y.dimension(1);
  const Index H = run.calls.empty() ? 0 : run.calls[0].routing.num_heads;
  std::vector<T> out(static_cast<std::size_t>(B * Tn * H), T(0));
  for (const auto& call : run.calls)
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < call.tokens; ++t)
        for (Index h = 0; h < H; ++h)
          out[static_cast<std::size_t>((b * Tn + call.first + t) * H + h)] =
              call.routing.gates(b * call.tokens + t, h);
  return out;
}

}  // namespace detail

/// Runs the case in `st` in scalar type T (float is what the format's tolerance is for).
template <class T = float>
CaseResult run_case(const SafeTensors& st) {
  using namespace detail;
  const std::string& format = st.metadata_value("format");
  require(format == "moh-case/1", "case ", st.source(), ": format: expected moh-case/1, got '",
          format, "'");
  CaseResult result;
  result.layer = st.metadata_value("layer");
  auto check = [&](const std::string& name, const auto& values, bool exact_zeros = false) {
    result.checks.push_back(compare(st, name, values, exact_zeros));
  };

  if (result.layer == "mha") {
    MHAConfig c;
    c.bias = st.contains("in_proj_bias");
    const auto run =
        run_layer<MultiHeadAttention<T>>(st, case_config(st, c, {"num_heads"}), {"y"});
    check("y", values_of(run.y));
  } else if (result.layer == "moh" || result.layer == "moh_llama" || result.layer == "moh_vit") {
    const bool llama = result.layer == "moh_llama", vit = result.layer == "moh_vit";
    MoHConfig c;
    std::vector<std::string> keys = {"num_heads", "shared_heads", "active_routed_heads"};
    if (llama) {  // LLaMA attention with the query-norm router
      c.router = MoHRouterKind::QueryNorm;
      c.qkv_bias = c.proj_bias = false;
      c.rope = true;
      keys.insert(keys.end(), {"num_kv_heads", "rope_theta"});
    } else {  // the ViT/DiT modules: qkv.bias unless qkv_bias = 0; proj.bias always
      c.qkv_bias = st.has_metadata("qkv_bias") || st.contains("qkv.bias");
    }
    if (vit) {
      c.scores = MoHScores::Cosine;
      if (st.contains("cpb_fc1.bias")) c.cpb_hidden = st.info("cpb_fc1.bias").numel();
      keys.insert(keys.end(), {"grid_h", "grid_w", "pretrain_h", "pretrain_w", "train_tokens"});
    }
    const auto run = run_layer<MoHAttention<T>>(
        st, case_config(st, c, keys),
        llama ? std::vector<std::string>{"y", "head_mask"}
              : std::vector<std::string>{"y", "gates", "aux_loss"});
    check("y", values_of(run.y));
    if (!llama) {
      check("gates", gates_of(run), true);
      check("aux_loss", std::vector<T>{run.calls[0].routing.load_balance_loss});
    } else {
      check("head_mask", gates_of(run), true);
    }
  } else if (result.layer == "moa") {
    const auto run = run_layer<MoAAttention<T>>(
        st, case_config(st, MoAConfig(), {"num_experts", "top_k"}),
        {"y", "expert_counts", "switch_loss", "z_loss", "cv_loss"});
    const MoARouting<T>& r = run.calls[0].routing;
    check("y", values_of(run.y));
    check("expert_counts", std::vector<T>(r.expert_counts.begin(), r.expert_counts.end()));
    check("switch_loss", std::vector<T>{r.switch_loss});
    check("z_loss", std::vector<T>{r.z_loss});
    if (st.contains("cv_loss")) check("cv_loss", std::vector<T>{r.cv_loss});
  } else if (result.layer == "jetmoe") {
    MoAConfig c = MoAConfig::jetmoe(0, 0, 0, 0, 0);
    const auto run = run_layer<MoAAttention<T>>(
        st, case_config(st, c, {"num_experts", "top_k", "num_kv_heads", "rope_theta"}),
        {"y", "expert_counts", "switch_loss", "z_loss"});
    check("y", values_of(run.y));
    std::vector<T> counts(static_cast<std::size_t>(run.calls[0].routing.num_experts), T(0));
    for (const auto& call : run.calls)  // the total over every call
      for (std::size_t e = 0; e < counts.size(); ++e)
        counts[e] += static_cast<T>(call.routing.expert_counts[e]);
    check("expert_counts", counts);
    const MoARouting<T>& r = run.calls[0].routing;
    if (st.contains("switch_loss")) check("switch_loss", std::vector<T>{r.switch_loss});
    if (st.contains("z_loss")) check("z_loss", std::vector<T>{r.z_loss});
  } else {
    fail("case ", st.source(), ": layer: expected mha, moh, moa, moh_llama, moh_vit or jetmoe, ",
         "got '", result.layer, "'");
  }
  return result;
}

}  // namespace moh
