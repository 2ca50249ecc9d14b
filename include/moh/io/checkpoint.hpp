// Loading and saving layers under the names the authors' PyTorch modules use.
//
//   torch nn.MultiheadAttention   in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias
//   LLaMA-style attention         q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight
//   MoH ViT/DiT attention         qkv.weight, qkv.bias, proj.weight, proj.bias,
//                                 wg.weight (K > 0), wg_0.weight (S_h > 0 and K > 0),
//                                 wg_1.weight (S_h > 1)
//   MoA fairseq attention         q_proj.experts.w [E, D, d], q_proj.output_experts.w [E, d, D],
//                                 q_proj.w_gate [D, E], k_proj.weight [d, D], v_proj.weight [d, D]
// Each layer lists its tensors (weight_infos(): names, shapes and the other layouts a tensor is
// published in), so one load_weights() and one save_weights() serve every layer. Every name may
// carry a prefix such as "blocks.3.attn."; every shape is checked against the layer's config,
// and F16, BF16, F64 weights are converted to the layer's scalar type. A source is a SafeTensors
// file or a ShardedSafeTensors checkpoint (Hugging Face index plus shards).
//
// save_weights() writes a layer under its names (fused layouts) plus its config as JSON in the
// metadata key "<prefix>moh.config", so load_layer() rebuilds it from the file alone; the config
// JSON lists the fields of the config's fields(). save_routing() / load_routing() store MoH and
// MoA routing records.
#pragma once

#include <nlohmann/json.hpp>
#include <algorithm>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moh/io/json.hpp"
#include "moh/io/safetensors.hpp"
#include "moh/io/safetensors_writer.hpp"
#include "moh/io/sharded_safetensors.hpp"
#include "moh/io/tensor_source.hpp"
#include "moh/layers/moa_attention.hpp"
#include "moh/layers/moh_attention.hpp"
#include "moh/layers/multi_head_attention.hpp"

namespace moh {
namespace detail {

/// Parses `text` as one of Enum's names.
template <class Enum>
bool parse_enum(const std::string& text, Enum& out) {
  const auto& names = EnumNames<Enum>::names;
  for (std::size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i)
    if (text == names[i]) {
      out = static_cast<Enum>(i);
      return true;
    }
  return false;
}
/// "a, b, c": Enum's names, for messages.
template <class Enum>
std::string enum_list() {
  std::string list;
  for (const char* name : EnumNames<Enum>::names) list += (list.empty() ? "" : ", ") + std::string(name);
  return list;
}

/// The values of tensor `w` (a layer's, under `prefix`) from `src`: under its name, one of its
/// aliases, or stacked from its parts (LLaMA-style q/k/v_proj), in that order of preference.
template <class T>
std::vector<T> read_weight(const TensorSource& src, const std::string& prefix, const WeightInfo& w) {
  if (src.contains(prefix + w.name)) return src.values<T>(prefix + w.name, w.shape);
  for (const std::string& alias : w.aliases)
    if (src.contains(prefix + alias)) return src.values<T>(prefix + alias, w.shape);
  bool any_part = false;
  for (const WeightInfo& part : w.parts) any_part = any_part || src.contains(prefix + part.name);
  if (any_part) {  // a missing part throws the source's own "missing" message
    std::vector<T> out;
    out.reserve(static_cast<std::size_t>(w.numel()));
    for (const WeightInfo& part : w.parts) {
      const std::vector<T> v = src.values<T>(prefix + part.name, part.shape);
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
  std::string other;
  for (const std::string& alias : w.aliases) other += ", or '" + prefix + alias + "'";
  if (!w.parts.empty()) {
    other += ", or its rows split over";
    for (const WeightInfo& part : w.parts) other += " '" + prefix + part.name + "'";
  }
  fail("tensor '", prefix, w.name, "' missing in ", src.source(), ": expected it", other);
}

/// The values of every tensor in `infos`, read and shape-checked against `src`.
template <class T>
std::vector<std::vector<T>> read_weights(const TensorSource& src, const std::string& prefix,
                                         const std::vector<WeightInfo>& infos) {
  std::vector<std::vector<T>> values;
  for (const WeightInfo& w : infos) values.push_back(read_weight<T>(src, prefix, w));
  return values;
}

inline std::string names_of(const std::vector<WeightInfo>& infos) {
  std::string out;
  for (const WeightInfo& w : infos) out += (out.empty() ? "" : ", ") + w.name;
  return out;
}

template <class Layer, class T>
void set_weights(Layer& layer, const std::vector<std::vector<T>>& values) {
  std::size_t i = 0;
  for (const WeightInfo& w : layer.weight_infos()) {
    layer.set_weight(w.name, values[i].data(), static_cast<Index>(values[i].size()));
    ++i;
  }
}

}  // namespace detail

/// Loads every tensor of `layer` (MultiHeadAttention, MoHAttention, MoAAttention) from `src`
/// under `prefix`. All tensors are read and checked before any is set, so on error the layer is
/// unchanged.
namespace detail {

/// Throws if `src` holds, under `prefix`, a tensor another module (or configuration) has and a
/// layer with config `c` would ignore: computing without it would be wrong, not just different.
template <class Layer>
void refuse_foreign_weights(const typename Layer::Config& c, const TensorSource& src,
                            const std::string& prefix) {
  for (const ForeignWeight& f : Layer::foreign_weights(c))
    if (src.contains(prefix + f.name))
      fail(Layer::kName, ": ", src.source(), " has tensor '", prefix, f.name, "': ", f.meaning,
           "; expected only the tensors of this layer (", names_of(Layer::weight_infos(c)), ")");
}

}  // namespace detail

template <class Layer>
void load_weights(Layer& layer, const TensorSource& src, const std::string& prefix = "") {
  detail::refuse_foreign_weights<Layer>(layer.config(), src, prefix);
  detail::set_weights(
      layer, detail::read_weights<typename Layer::Scalar>(src, prefix, layer.weight_infos()));
}

namespace detail {

/// A config as JSON: {"layer": ..., then every field of its fields() list}.
template <class Config>
nlohmann::json config_json(const Config& c) {
  nlohmann::json j = {{"layer", Config::kLayer}};
  Config::fields(c, [&](const char* key, const auto& value) {
    using V = std::decay_t<decltype(value)>;
    if constexpr (std::is_enum<V>::value)
      j[key] = enum_name(value);
    else
      j[key] = value;
  });
  return j;
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
  /// An enum, by one of the names in its EnumNames.
  template <class Enum, std::enable_if_t<std::is_enum<Enum>::value, int> = 0>
  void read(const char* key, Enum& out) {
    const nlohmann::json* v = field(key);
    if (!v) return;
    if (!v->is_string() || !parse_enum(v->get<std::string>(), out))
      fail(where_, ": '", key, "': expected one of ", enum_list<Enum>(), ", got ",
           describe_json(*v));
  }
  /// The visitor of a config's fields() list.
  template <class Field>
  void operator()(const char* key, Field& out) {
    read(key, out);
  }
  /// Throws if the object holds a key no read() asked for (a typo or a newer format).
  void finish() const {
    std::string known;
    for (const std::string& key : seen_) known += (known.empty() ? "" : ", ") + key;
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (it.key() != "layer" && !seen_.count(it.key()))
        fail(where_, ": unknown key '", it.key(), "': expected one of layer, ", known);
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

}  // namespace detail

/// Metadata key under which save_weights() stores a layer's config.
inline std::string config_key(const std::string& prefix) { return prefix + "moh.config"; }

/// The config save_weights() stored under `prefix`, validated. Missing fields keep their
/// defaults; unknown fields, wrong types, another layer kind or impossible settings throw.
template <class Config>
Config load_config(const TensorSource& st, const std::string& prefix = "") {
  const std::string key = config_key(prefix);
  const std::string where = "metadata '" + key + "' in " + st.source();
  const std::string& text = st.metadata_value(key);
  const nlohmann::json j = detail::parse_json_strictly(
      reinterpret_cast<const std::uint8_t*>(text.data()), text.size(), where + ": ", "config");
  const auto layer = j.find("layer");
  if (layer == j.end() || !layer->is_string() || layer->get<std::string>() != Config::kLayer)
    detail::fail(where, ": 'layer': expected \"", Config::kLayer, "\", got ",
                 layer == j.end() ? std::string("nothing") : detail::describe_json(*layer));
  Config c;
  nlohmann::json fields = j;
  if constexpr (std::is_same<Config, MoHConfig>::value) {
    // Saved before qkv_bias and proj_bias were apart: "bias" set both.
    const auto legacy = fields.find("bias");
    if (legacy != fields.end() && !fields.contains("qkv_bias") && !fields.contains("proj_bias")) {
      fields["qkv_bias"] = *legacy;
      fields["proj_bias"] = *legacy;
      fields.erase("bias");
    }
  }
  if constexpr (std::is_same<Config, MoAConfig>::value) {
    // Saved before the field was named for what it is: MoA's "bias" was its output bias.
    const auto legacy = fields.find("bias");
    if (legacy != fields.end() && !fields.contains("out_bias")) {
      fields["out_bias"] = *legacy;
      fields.erase("bias");
    }
    // Saved when MoA's num_kv_heads = 0 meant 1.
    const auto kv = fields.find("num_kv_heads");
    if (kv != fields.end() && kv->is_number_integer() && kv->get<long long>() == 0) *kv = 1;
  }
  detail::ConfigReader reader(fields, where);
  Config::fields(c, reader);
  reader.finish();
  c.validate();
  return c;
}

/// Builds a layer (MultiHeadAttention<T>, MoHAttention<T>, MoAAttention<T>) from the config and
/// weights save_weights() wrote under `prefix`. The weights are read (and checked against the
/// config's shapes) before the layer is built, so a config that describes a layer larger than
/// the file is an error, not an allocation of that size.
template <class Layer>
Layer load_layer(const TensorSource& st, const std::string& prefix = "") {
  const typename Layer::Config config = load_config<typename Layer::Config>(st, prefix);
  detail::refuse_foreign_weights<Layer>(config, st, prefix);
  const auto values =
      detail::read_weights<typename Layer::Scalar>(st, prefix, Layer::weight_infos(config));
  Layer layer(config);
  detail::set_weights(layer, values);
  return layer;
}

/// Writes every tensor of `layer` under `prefix` (its fused names), as `dtype`, and its config.
template <class Layer>
void save_weights(SafeTensorsWriter& w, const Layer& layer, const std::string& prefix = "",
                  DType dtype = DType::F32) {
  for (const WeightInfo& info : layer.weight_infos())
    w.add(prefix + info.name, layer.weight(info.name).data(), info.shape, dtype);
  w.set_metadata(config_key(prefix), detail::config_json(layer.config()).dump());
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
inline std::vector<std::int64_t> rank3_shape(const TensorSource& st, const std::string& name) {
  const std::vector<std::int64_t>& s = st.info(name).shape;
  if (s.size() != 3)
    fail("tensor '", name, "' in ", st.source(), ": expected a rank-3 shape [B, T, *], got ",
         shape_string(s));
  return s;
}
inline nlohmann::json routing_meta(const TensorSource& st, const std::string& prefix, const char* kind) {
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
template <class T>
void load_routing(const TensorSource& st, MoHRouting<T>& r, const std::string& prefix = "") {
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
  const std::vector<T> gates = st.values<T>(prefix + "gates");
  out.gates = ConstMatrixMap<T>(gates.data(), N, H);
  const std::vector<bool> active = st.values<bool>(prefix + "active", g);
  out.active.resize(N, H);
  for (Index i = 0; i < N * H; ++i) out.active.data()[i] = active[static_cast<std::size_t>(i)];
  const Index E = H - out.shared_heads;
  const std::vector<T> probs = st.values<T>(prefix + "routed_probs", {g[0], g[1], E});
  out.routed_probs = ConstMatrixMap<T>(probs.data(), N, E);
  const std::vector<std::int64_t> counts = st.values<std::int64_t>(prefix + "head_counts", {H});
  out.head_counts.assign(counts.begin(), counts.end());
  out.load_balance_loss = st.values<T>(prefix + "load_balance_loss", {1})[0];
  r = std::move(out);
}

/// Reads a MoA routing record written by save_routing().
template <class T>
void load_routing(const TensorSource& st, MoARouting<T>& r, const std::string& prefix = "") {
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
    const std::vector<T> v = st.values<T>(prefix + name, g);
    return Matrix<T>(ConstMatrixMap<T>(v.data(), N, E));
  };
  out.logits = matrix("logits");
  out.probs = matrix("probs");
  out.gates = matrix("gates");
  const std::vector<std::int64_t> s = st.values<std::int64_t>(prefix + "selected");
  out.selected.resize(N, k);
  for (Index i = 0; i < N * k; ++i) {
    const std::int64_t e = s[static_cast<std::size_t>(i)];
    // -1: a query padding token, routed to no expert in any slot, with no gate.
    const Index row = i / k;
    const auto slots = s.begin() + static_cast<std::ptrdiff_t>(row * k);
    const bool padded = e == -1 &&
                        std::all_of(slots, slots + static_cast<std::ptrdiff_t>(k),
                                    [](std::int64_t x) { return x == -1; }) &&
                        out.gates.row(row).cwiseAbs().maxCoeff() == T(0);
    detail::require((e >= 0 && e < E) || padded, "tensor '", prefix, "selected' in ",
                    st.source(), ": element ", i, ": expected an expert index in [0, ", E,
                    ") (or -1 in every slot of a padding token, whose gates are 0), got ", e);
    out.selected.data()[i] = static_cast<Index>(e);
  }
  const std::vector<std::int64_t> counts = st.values<std::int64_t>(prefix + "expert_counts", {E});
  out.expert_counts.assign(counts.begin(), counts.end());
  out.switch_loss = st.values<T>(prefix + "switch_loss", {1})[0];
  out.z_loss = st.values<T>(prefix + "z_loss", {1})[0];
  out.cv_loss = st.values<T>(prefix + "cv_loss", {1})[0];
  r = std::move(out);
}

}  // namespace moh
