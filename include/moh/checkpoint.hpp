// Loading layer weights from safetensors files, under the names the authors' PyTorch modules use.
//
//   torch nn.MultiheadAttention   in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias
//   LLaMA-style attention         q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight
//   MoH ViT/DiT attention         qkv.weight, qkv.bias, proj.weight, proj.bias,
//                                 wg.weight (K > 0), wg_0.weight (S_h > 0 and K > 0),
//                                 wg_1.weight (S_h > 1)
//   MoA fairseq attention         q_proj.experts.w [E, D, d], q_proj.output_experts.w [E, d, D],
//                                 q_proj.w_gate [D, E], k_proj.weight [d, D], v_proj.weight [d, D]
// Every name may carry a prefix such as "blocks.3.attn."; every shape is checked against the
// layer's config, and F16, BF16, F64 weights are converted to the layer's scalar type. A source is
// a SafeTensors file or a ShardedSafeTensors checkpoint (Hugging Face index plus shards).
//
// save_weights() writes a layer under the same names (fused layouts) plus its config as JSON in
// the metadata key "<prefix>moh.config", so load_layer() rebuilds it from the file alone.
// save_routing() / load_routing() store MoH and MoA routing records.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moh/moa_attention.hpp"
#include "moh/moh_attention.hpp"
#include "moh/multi_head_attention.hpp"
#include "moh/safetensors.hpp"
#include "moh/safetensors_writer.hpp"
#include "moh/sharded_safetensors.hpp"

namespace moh {
namespace detail {

/// [(H + 2 H_kv) d, D] from LLaMA-style separate q/k/v projections.
template <class T, class Source>
Matrix<T> stacked_qkv(const Source& st, const std::string& prefix, const Geometry& g) {
  Matrix<T> w(g.in_rows(), g.D);
  w.topRows(g.q_width()) = st.template matrix<T>(prefix + "q_proj.weight", g.q_width(), g.D);
  w.middleRows(g.q_width(), g.Hkv * g.d) = st.template matrix<T>(prefix + "k_proj.weight", g.Hkv * g.d, g.D);
  w.bottomRows(g.Hkv * g.d) = st.template matrix<T>(prefix + "v_proj.weight", g.Hkv * g.d, g.D);
  return w;
}

template <class T, class Source>
Vector<T> stacked_qkv_bias(const Source& st, const std::string& prefix, const Geometry& g) {
  Vector<T> b(g.in_rows());
  b.head(g.q_width()) = st.template vector<T>(prefix + "q_proj.bias", g.q_width());
  b.segment(g.q_width(), g.Hkv * g.d) = st.template vector<T>(prefix + "k_proj.bias", g.Hkv * g.d);
  b.tail(g.Hkv * g.d) = st.template vector<T>(prefix + "v_proj.bias", g.Hkv * g.d);
  return b;
}

/// Loads in/out projections stored either fused (`fused_in`, `fused_out` names) or LLaMA-style.
template <class T, class Layer, class Source>
void load_projections(Layer& layer, const Source& st, const std::string& prefix,
                      const Geometry& g, const std::string& fused_in, const std::string& in_bias,
                      const std::string& out, const std::string& out_bias) {
  const bool llama = !st.contains(prefix + fused_in) && st.contains(prefix + "q_proj.weight");
  if (!llama && !st.contains(prefix + fused_in))
    fail("tensor '", prefix, fused_in, "' (fused) or '", prefix,
         "q_proj.weight' (LLaMA-style q/k/v/o_proj) missing in ", st.source(),
         ": expected one of the two layouts");
  if (llama) {
    layer.set_in_weight_(stacked_qkv<T>(st, prefix, g));
    if (g.bias) layer.set_in_bias_(stacked_qkv_bias<T>(st, prefix, g));
    layer.set_out_weight_(st.template matrix<T>(prefix + "o_proj.weight", g.D, g.q_width()));
    if (g.bias) layer.set_out_bias_(st.template vector<T>(prefix + "o_proj.bias", g.D));
    return;
  }
  layer.set_in_weight_(st.template matrix<T>(prefix + fused_in, g.in_rows(), g.D));
  if (g.bias) layer.set_in_bias_(st.template vector<T>(prefix + in_bias, g.in_rows()));
  layer.set_out_weight_(st.template matrix<T>(prefix + out, g.D, g.q_width()));
  if (g.bias) layer.set_out_bias_(st.template vector<T>(prefix + out_bias, g.D));
}

template <class Layer>
struct ProjectionSetter {
  Layer& layer;
  template <class M> void set_in_weight_(const M& m) { layer.set_in_proj_weight(m); }
  template <class M> void set_in_bias_(const M& m) { layer.set_in_proj_bias(m); }
  template <class M> void set_out_weight_(const M& m) { layer.set_out_proj_weight(m); }
  template <class M> void set_out_bias_(const M& m) { layer.set_out_proj_bias(m); }
};

template <class Layer>
struct MoHProjectionSetter {
  Layer& layer;
  template <class M> void set_in_weight_(const M& m) { layer.set_qkv_weight(m); }
  template <class M> void set_in_bias_(const M& m) { layer.set_qkv_bias(m); }
  template <class M> void set_out_weight_(const M& m) { layer.set_proj_weight(m); }
  template <class M> void set_out_bias_(const M& m) { layer.set_proj_bias(m); }
};

}  // namespace detail

/// Loads a MultiHeadAttention from torch nn.MultiheadAttention names (or LLaMA-style
/// q_proj/k_proj/v_proj/o_proj when in_proj_weight is absent) under `prefix`.
template <class T, class Source>
void load_weights(MultiHeadAttention<T>& layer, const Source& st, const std::string& prefix = "") {
  const detail::Geometry g = detail::make_geometry(layer.config(), "MultiHeadAttention");
  detail::ProjectionSetter<MultiHeadAttention<T>> set{layer};
  detail::load_projections<T>(set, st, prefix, g, "in_proj_weight", "in_proj_bias",
                              "out_proj.weight", "out_proj.bias");
}

/// Loads a MoHAttention from the MoH ViT/DiT names (or LLaMA-style names for MoH-LLaMA3).
template <class T, class Source>
void load_weights(MoHAttention<T>& layer, const Source& st, const std::string& prefix = "") {
  const MoHConfig& c = layer.config();
  const detail::Geometry g = detail::make_geometry(c, "MoHAttention");
  detail::MoHProjectionSetter<MoHAttention<T>> set{layer};
  detail::load_projections<T>(set, st, prefix, g, "qkv.weight", "qkv.bias", "proj.weight",
                              "proj.bias");
  if (c.router != MoHRouter::Learned) return;
  const Index E = c.routed_heads(), S = c.shared_heads, K = c.active_routed_heads;
  if (K > 0) layer.set_router_routed_weight(st.template matrix<T>(prefix + "wg.weight", E, c.embed_dim));
  if (S > 0 && K > 0) layer.set_router_mix_weight(st.template matrix<T>(prefix + "wg_0.weight", 2, c.embed_dim));
  if (S > 1) layer.set_router_shared_weight(st.template matrix<T>(prefix + "wg_1.weight", S, c.embed_dim));
}

/// Loads a MoAAttention from the MoA fairseq names.
template <class T, class Source>
void load_weights(MoAAttention<T>& layer, const Source& st, const std::string& prefix = "") {
  const MoAConfig& c = layer.config();
  const std::int64_t E = c.num_experts, D = c.embed_dim, d = c.head_dim;
  auto stacked = [&](const std::string& name, std::int64_t a, std::int64_t b) {
    const std::vector<T> v = st.template values<T>(prefix + name, {E, a, b});
    return Matrix<T>(ConstMatrixMap<T>(v.data(), E * a, b));
  };
  layer.set_query_experts(stacked("q_proj.experts.w", D, d));
  layer.set_output_experts(stacked("q_proj.output_experts.w", d, D));
  layer.set_gate_weight(st.template matrix<T>(prefix + "q_proj.w_gate", D, E));
  layer.set_key_weight(st.template matrix<T>(prefix + "k_proj.weight", d, D));
  layer.set_value_weight(st.template matrix<T>(prefix + "v_proj.weight", d, D));
}

// ---- saving --------------------------------------------------------------------------------------

namespace detail {

inline nlohmann::json config_json(const MhaConfig& c) {
  return {{"layer", "MultiHeadAttention"}, {"embed_dim", c.embed_dim}, {"num_heads", c.num_heads},
          {"head_dim", c.head_dim}, {"num_kv_heads", c.num_kv_heads}, {"bias", c.bias},
          {"rope", c.rope}, {"rope_base", c.rope_base},
          {"weight_storage", weight_storage_name(c.weight_storage)}};
}
inline nlohmann::json config_json(const MoHConfig& c) {
  return {{"layer", "MoHAttention"}, {"embed_dim", c.embed_dim}, {"num_heads", c.num_heads},
          {"head_dim", c.head_dim}, {"num_kv_heads", c.num_kv_heads},
          {"shared_heads", c.shared_heads}, {"active_routed_heads", c.active_routed_heads},
          {"router", c.router == MoHRouter::QueryNorm ? "query_norm" : "learned"},
          {"bias", c.bias}, {"rope", c.rope}, {"rope_base", c.rope_base},
          {"weight_storage", weight_storage_name(c.weight_storage)}};
}
inline nlohmann::json config_json(const MoAConfig& c) {
  return {{"layer", "MoAAttention"}, {"embed_dim", c.embed_dim}, {"head_dim", c.head_dim},
          {"num_experts", c.num_experts}, {"top_k", c.top_k},
          {"gating", c.gating == MoAGating::TopKSoftmax ? "top_k_softmax" : "softmax"},
          {"weight_storage", weight_storage_name(c.weight_storage)}};
}

/// Reads a config JSON object field by field: every key known, every type checked.
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {}

  void read(const char* key, Index& out) {
    const nlohmann::json* v = field(key);
    if (!v) return;
    if (!v->is_number_integer())
      fail(where_, ": '", key, "': expected an integer, got ", describe_json(*v));
    const std::int64_t x = v->get<std::int64_t>();
    if (x < 0 || x > (std::int64_t(1) << 31))
      fail(where_, ": '", key, "': expected an integer in [0, 2^31], got ", x);
    out = static_cast<Index>(x);
  }
  void read(const char* key, bool& out) {
    const nlohmann::json* v = field(key);
    if (!v) return;
    if (!v->is_boolean()) fail(where_, ": '", key, "': expected true or false, got ", describe_json(*v));
    out = v->get<bool>();
  }
  void read(const char* key, double& out) {
    const nlohmann::json* v = field(key);
    if (!v) return;
    if (!v->is_number()) fail(where_, ": '", key, "': expected a number, got ", describe_json(*v));
    out = v->get<double>();
  }
  /// A string that must be one of `names`; returns its index.
  template <class Enum, std::size_t N>
  void read(const char* key, Enum& out, const char* const (&names)[N]) {
    const nlohmann::json* v = field(key);
    if (!v) return;
    std::string list;
    for (std::size_t i = 0; i < N; ++i) {
      if (v->is_string() && v->get<std::string>() == names[i]) {
        out = static_cast<Enum>(i);
        return;
      }
      list += (i ? ", " : "") + std::string(names[i]);
    }
    fail(where_, ": '", key, "': expected one of ", list, ", got ", describe_json(*v));
  }
  /// Throws if the object holds a key no read() asked for (a typo or a newer format).
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (it.key() != "layer" && !seen_.count(it.key()))
        fail(where_, ": unknown key '", it.key(), "'");
  }

 private:
  const nlohmann::json* field(const char* key) {
    seen_.insert(key);
    const auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  const nlohmann::json& j_;
  std::string where_;
  std::set<std::string> seen_;
};

inline const char* const kStorageNames[] = {"native", "bfloat16"};

inline void read_config(ConfigReader& r, MhaConfig& c) {
  r.read("embed_dim", c.embed_dim);
  r.read("num_heads", c.num_heads);
  r.read("head_dim", c.head_dim);
  r.read("num_kv_heads", c.num_kv_heads);
  r.read("bias", c.bias);
  r.read("rope", c.rope);
  r.read("rope_base", c.rope_base);
  r.read("weight_storage", c.weight_storage, kStorageNames);
}
inline void read_config(ConfigReader& r, MoHConfig& c) {
  static const char* const kRouters[] = {"learned", "query_norm"};
  r.read("embed_dim", c.embed_dim);
  r.read("num_heads", c.num_heads);
  r.read("head_dim", c.head_dim);
  r.read("num_kv_heads", c.num_kv_heads);
  r.read("shared_heads", c.shared_heads);
  r.read("active_routed_heads", c.active_routed_heads);
  r.read("router", c.router, kRouters);
  r.read("bias", c.bias);
  r.read("rope", c.rope);
  r.read("rope_base", c.rope_base);
  r.read("weight_storage", c.weight_storage, kStorageNames);
}
inline void read_config(ConfigReader& r, MoAConfig& c) {
  static const char* const kGatings[] = {"softmax", "top_k_softmax"};
  r.read("embed_dim", c.embed_dim);
  r.read("head_dim", c.head_dim);
  r.read("num_experts", c.num_experts);
  r.read("top_k", c.top_k);
  r.read("gating", c.gating, kGatings);
  r.read("weight_storage", c.weight_storage, kStorageNames);
}

inline const char* layer_name(const MhaConfig&) { return "MultiHeadAttention"; }
inline const char* layer_name(const MoHConfig&) { return "MoHAttention"; }
inline const char* layer_name(const MoAConfig&) { return "MoAAttention"; }

template <class T>
std::vector<std::int64_t> dims(std::initializer_list<T> d) {
  return std::vector<std::int64_t>(d.begin(), d.end());
}

}  // namespace detail

/// Metadata key under which save_weights() stores a layer's config.
inline std::string config_key(const std::string& prefix) { return prefix + "moh.config"; }

/// The config save_weights() stored under `prefix`, validated. Missing fields keep their
/// defaults; unknown fields, wrong types, another layer kind or impossible settings throw.
template <class Config, class Source>
Config load_config(const Source& st, const std::string& prefix = "") {
  const std::string key = config_key(prefix);
  const std::string where = "metadata '" + key + "' in " + st.source();
  const std::string& text = st.metadata_value(key);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(text.data());
  if (detail::json_nesting_exceeds(bytes, text.size(), detail::kMaxJsonDepth))
    detail::fail(where, ": expected a flat JSON object, got nesting deeper than ",
                 detail::kMaxJsonDepth);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    detail::fail(where, ": expected a JSON object, got invalid JSON: ", e.what());
  }
  if (!j.is_object()) detail::fail(where, ": expected a JSON object, got ", detail::describe_json(j));
  Config c;
  const auto layer = j.find("layer");
  if (layer == j.end() || !layer->is_string() || layer->get<std::string>() != detail::layer_name(c))
    detail::fail(where, ": 'layer': expected \"", detail::layer_name(c), "\", got ",
                 layer == j.end() ? std::string("nothing") : detail::describe_json(*layer));
  detail::ConfigReader reader(j, where);
  detail::read_config(reader, c);
  reader.finish();
  c.validate();
  return c;
}

/// Builds a layer (MultiHeadAttention<T>, MoHAttention<T>, MoAAttention<T>) from the config and
/// weights save_weights() wrote under `prefix`.
template <class Layer, class Source>
Layer load_layer(const Source& st, const std::string& prefix = "") {
  using Config = std::decay_t<decltype(std::declval<const Layer&>().config())>;
  Layer layer(load_config<Config>(st, prefix));
  load_weights(layer, st, prefix);
  return layer;
}

/// Writes a MultiHeadAttention under torch nn.MultiheadAttention names, weights as `dtype`.
template <class T>
void save_weights(SafeTensorsWriter& w, const MultiHeadAttention<T>& layer,
                  const std::string& prefix = "", DType dtype = DType::F32) {
  w.add(prefix + "in_proj_weight", layer.in_proj_weight(), dtype);
  w.add(prefix + "out_proj.weight", layer.out_proj_weight(), dtype);
  if (layer.config().bias) {
    w.add(prefix + "in_proj_bias", layer.in_proj_bias(), dtype);
    w.add(prefix + "out_proj.bias", layer.out_proj_bias(), dtype);
  }
  w.set_metadata(config_key(prefix), detail::config_json(layer.config()).dump());
}

/// Writes a MoHAttention under the MoH ViT/DiT names (router weights for the learned router).
template <class T>
void save_weights(SafeTensorsWriter& w, const MoHAttention<T>& layer,
                  const std::string& prefix = "", DType dtype = DType::F32) {
  const MoHConfig& c = layer.config();
  w.add(prefix + "qkv.weight", layer.qkv_weight(), dtype);
  w.add(prefix + "proj.weight", layer.proj_weight(), dtype);
  if (c.bias) {
    w.add(prefix + "qkv.bias", layer.qkv_bias(), dtype);
    w.add(prefix + "proj.bias", layer.proj_bias(), dtype);
  }
  if (c.router == MoHRouter::Learned) {
    const Index S = c.shared_heads, K = c.active_routed_heads;
    if (K > 0) w.add(prefix + "wg.weight", layer.router().routed_weight(), dtype);
    if (S > 0 && K > 0) w.add(prefix + "wg_0.weight", layer.router().mix_weight(), dtype);
    if (S > 1) w.add(prefix + "wg_1.weight", layer.router().shared_weight(), dtype);
  }
  w.set_metadata(config_key(prefix), detail::config_json(c).dump());
}

/// Writes a MoAAttention under the MoA fairseq names.
template <class T>
void save_weights(SafeTensorsWriter& w, const MoAAttention<T>& layer,
                  const std::string& prefix = "", DType dtype = DType::F32) {
  const MoAConfig& c = layer.config();
  const std::int64_t E = c.num_experts, D = c.embed_dim, d = c.head_dim;
  w.add(prefix + "q_proj.experts.w", layer.query_experts().data(), {E, D, d}, dtype);
  w.add(prefix + "q_proj.output_experts.w", layer.output_experts().data(), {E, d, D}, dtype);
  w.add(prefix + "q_proj.w_gate", layer.gate_weight(), dtype);
  w.add(prefix + "k_proj.weight", layer.key_weight(), dtype);
  w.add(prefix + "v_proj.weight", layer.value_weight(), dtype);
  w.set_metadata(config_key(prefix), detail::config_json(c).dump());
}

// ---- routing records -----------------------------------------------------------------------------

/// Writes a MoH routing record: gates, active [B, T, H], routed_probs [B, T, H - S_h],
/// head_counts [H] (I64), load_balance_loss [1]; the head split in metadata.
template <class T>
void save_routing(SafeTensorsWriter& w, const MoHRouting<T>& r, const std::string& prefix = "") {
  const std::int64_t B = r.batch, Tn = r.tokens, H = r.num_heads;
  w.add(prefix + "gates", r.gates.data(), {B, Tn, H}, DType::F32);
  w.add(prefix + "active", r.active.data(), {B, Tn, H}, DType::BOOL);
  w.add(prefix + "routed_probs", r.routed_probs.data(),
        {B, Tn, static_cast<std::int64_t>(r.routed_probs.cols())}, DType::F32);
  w.add(prefix + "head_counts", r.head_counts, {H}, DType::I64);
  w.add(prefix + "load_balance_loss", &r.load_balance_loss, {1}, DType::F32);
  w.set_metadata(prefix + "moh.routing", nlohmann::json{{"kind", "moh"},
                                                        {"shared_heads", r.shared_heads},
                                                        {"active_routed_heads", r.active_routed_heads}}
                                             .dump());
}

/// Writes a MoA routing record: logits, probs, gates [B, T, E], selected [B, T, k] (I64),
/// expert_counts [E] (I64), switch_loss, z_loss, cv_loss [1].
template <class T>
void save_routing(SafeTensorsWriter& w, const MoARouting<T>& r, const std::string& prefix = "") {
  const std::int64_t B = r.batch, Tn = r.tokens, E = r.num_experts, k = r.top_k;
  w.add(prefix + "logits", r.logits.data(), {B, Tn, E}, DType::F32);
  w.add(prefix + "probs", r.probs.data(), {B, Tn, E}, DType::F32);
  w.add(prefix + "gates", r.gates.data(), {B, Tn, E}, DType::F32);
  w.add(prefix + "selected", r.selected.data(), {B, Tn, k}, DType::I64);
  w.add(prefix + "expert_counts", r.expert_counts, {E}, DType::I64);
  w.add(prefix + "switch_loss", &r.switch_loss, {1}, DType::F32);
  w.add(prefix + "z_loss", &r.z_loss, {1}, DType::F32);
  w.add(prefix + "cv_loss", &r.cv_loss, {1}, DType::F32);
  w.set_metadata(prefix + "moh.routing", nlohmann::json{{"kind", "moa"}}.dump());
}

namespace detail {
template <class Source>
std::vector<std::int64_t> rank3_shape(const Source& st, const std::string& name) {
  const std::vector<std::int64_t>& s = st.info(name).shape;
  if (s.size() != 3)
    fail("tensor '", name, "' in ", st.source(), ": expected a rank-3 shape [B, T, *], got ",
         shape_string(s));
  return s;
}
template <class Source>
nlohmann::json routing_meta(const Source& st, const std::string& prefix, const char* kind) {
  const std::string key = prefix + "moh.routing";
  const std::string& text = st.metadata_value(key);
  nlohmann::json j;
  if (text.size() <= 256) j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("kind") || j["kind"] != kind)
    fail("metadata '", key, "' in ", st.source(), ": expected a ", kind,
         " routing record, got '", text.substr(0, 64), "'");
  return j;
}
}  // namespace detail

/// Reads a MoH routing record written by save_routing(); shapes must agree with each other.
template <class T, class Source>
void load_routing(const Source& st, MoHRouting<T>& r, const std::string& prefix = "") {
  const nlohmann::json meta = detail::routing_meta(st, prefix, "moh");
  detail::ConfigReader reader(meta, "metadata '" + prefix + "moh.routing' in " + st.source());
  MoHRouting<T> out;
  reader.read("shared_heads", out.shared_heads);
  reader.read("active_routed_heads", out.active_routed_heads);
  const std::vector<std::int64_t> g = detail::rank3_shape(st, prefix + "gates");
  out.batch = g[0];
  out.tokens = g[1];
  out.num_heads = g[2];
  const Index N = out.batch * out.tokens, H = out.num_heads;
  detail::require(out.shared_heads + out.active_routed_heads <= H, "metadata '", prefix,
                  "moh.routing' in ", st.source(), ": expected shared_heads + active_routed_heads <= ",
                  H, " (gates' heads), got ", out.shared_heads, " + ", out.active_routed_heads);
  const std::vector<T> gates = st.template values<T>(prefix + "gates");
  out.gates = ConstMatrixMap<T>(gates.data(), N, H);
  const std::vector<bool> active = st.template values<bool>(prefix + "active", g);
  out.active.resize(N, H);
  for (Index i = 0; i < N * H; ++i) out.active.data()[i] = active[static_cast<std::size_t>(i)];
  const Index E = H - out.shared_heads;
  const std::vector<T> probs = st.template values<T>(prefix + "routed_probs", {g[0], g[1], E});
  out.routed_probs = ConstMatrixMap<T>(probs.data(), N, E);
  const std::vector<std::int64_t> counts = st.template values<std::int64_t>(prefix + "head_counts", {H});
  out.head_counts.assign(counts.begin(), counts.end());
  out.load_balance_loss = st.template values<T>(prefix + "load_balance_loss", {1})[0];
  r = std::move(out);
}

/// Reads a MoA routing record written by save_routing().
template <class T, class Source>
void load_routing(const Source& st, MoARouting<T>& r, const std::string& prefix = "") {
  detail::routing_meta(st, prefix, "moa");
  MoARouting<T> out;
  const std::vector<std::int64_t> g = detail::rank3_shape(st, prefix + "gates");
  out.batch = g[0];
  out.tokens = g[1];
  out.num_experts = g[2];
  const std::vector<std::int64_t> sel = detail::rank3_shape(st, prefix + "selected");
  out.top_k = sel[2];
  const Index N = out.batch * out.tokens, E = out.num_experts, k = out.top_k;
  detail::require(sel[0] == g[0] && sel[1] == g[1] && k <= E, "tensor '", prefix, "selected' in ",
                  st.source(), ": expected shape [", g[0], ", ", g[1], ", k <= ", E, "], got ",
                  detail::shape_string(sel));
  auto matrix = [&](const char* name) {
    const std::vector<T> v = st.template values<T>(prefix + name, g);
    return Matrix<T>(ConstMatrixMap<T>(v.data(), N, E));
  };
  out.logits = matrix("logits");
  out.probs = matrix("probs");
  out.gates = matrix("gates");
  const std::vector<std::int64_t> s = st.template values<std::int64_t>(prefix + "selected");
  out.selected.resize(N, k);
  for (Index i = 0; i < N * k; ++i) {
    const std::int64_t e = s[static_cast<std::size_t>(i)];
    detail::require(e >= 0 && e < E, "tensor '", prefix, "selected' in ", st.source(),
                    ": element ", i, ": expected an expert index in [0, ", E, "), got ", e);
    out.selected.data()[i] = static_cast<Index>(e);
  }
  const std::vector<std::int64_t> counts = st.template values<std::int64_t>(prefix + "expert_counts", {E});
  out.expert_counts.assign(counts.begin(), counts.end());
  out.switch_loss = st.template values<T>(prefix + "switch_loss", {1})[0];
  out.z_loss = st.template values<T>(prefix + "z_loss", {1})[0];
  out.cv_loss = st.template values<T>(prefix + "cv_loss", {1})[0];
  r = std::move(out);
}

}  // namespace moh
