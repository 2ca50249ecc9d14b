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
// layer's config, and F16, BF16, F64 weights are converted to the layer's scalar type.
#pragma once

#include <string>

#include "moh/moa_attention.hpp"
#include "moh/moh_attention.hpp"
#include "moh/multi_head_attention.hpp"
#include "moh/safetensors.hpp"

namespace moh {
namespace detail {

/// [(H + 2 H_kv) d, D] from LLaMA-style separate q/k/v projections.
template <class T>
Matrix<T> stacked_qkv(const SafeTensors& st, const std::string& prefix, const Geometry& g) {
  Matrix<T> w(g.in_rows(), g.D);
  w.topRows(g.q_width()) = st.matrix<T>(prefix + "q_proj.weight", g.q_width(), g.D);
  w.middleRows(g.q_width(), g.Hkv * g.d) = st.matrix<T>(prefix + "k_proj.weight", g.Hkv * g.d, g.D);
  w.bottomRows(g.Hkv * g.d) = st.matrix<T>(prefix + "v_proj.weight", g.Hkv * g.d, g.D);
  return w;
}

template <class T>
Vector<T> stacked_qkv_bias(const SafeTensors& st, const std::string& prefix, const Geometry& g) {
  Vector<T> b(g.in_rows());
  b.head(g.q_width()) = st.vector<T>(prefix + "q_proj.bias", g.q_width());
  b.segment(g.q_width(), g.Hkv * g.d) = st.vector<T>(prefix + "k_proj.bias", g.Hkv * g.d);
  b.tail(g.Hkv * g.d) = st.vector<T>(prefix + "v_proj.bias", g.Hkv * g.d);
  return b;
}

/// Loads in/out projections stored either fused (`fused_in`, `fused_out` names) or LLaMA-style.
template <class T, class Layer>
void load_projections(Layer& layer, const SafeTensors& st, const std::string& prefix,
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
    layer.set_out_weight_(st.matrix<T>(prefix + "o_proj.weight", g.D, g.q_width()));
    if (g.bias) layer.set_out_bias_(st.vector<T>(prefix + "o_proj.bias", g.D));
    return;
  }
  layer.set_in_weight_(st.matrix<T>(prefix + fused_in, g.in_rows(), g.D));
  if (g.bias) layer.set_in_bias_(st.vector<T>(prefix + in_bias, g.in_rows()));
  layer.set_out_weight_(st.matrix<T>(prefix + out, g.D, g.q_width()));
  if (g.bias) layer.set_out_bias_(st.vector<T>(prefix + out_bias, g.D));
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
template <class T>
void load_weights(MultiHeadAttention<T>& layer, const SafeTensors& st,
                  const std::string& prefix = "") {
  const detail::Geometry g = detail::make_geometry(layer.config(), "MultiHeadAttention");
  detail::ProjectionSetter<MultiHeadAttention<T>> set{layer};
  detail::load_projections<T>(set, st, prefix, g, "in_proj_weight", "in_proj_bias",
                              "out_proj.weight", "out_proj.bias");
}

/// Loads a MoHAttention from the MoH ViT/DiT names (or LLaMA-style names for MoH-LLaMA3).
template <class T>
void load_weights(MoHAttention<T>& layer, const SafeTensors& st, const std::string& prefix = "") {
  const MoHConfig& c = layer.config();
  const detail::Geometry g = detail::make_geometry(c, "MoHAttention");
  detail::MoHProjectionSetter<MoHAttention<T>> set{layer};
  detail::load_projections<T>(set, st, prefix, g, "qkv.weight", "qkv.bias", "proj.weight",
                              "proj.bias");
  if (c.router != MoHRouter::Learned) return;
  const Index E = c.routed_heads(), S = c.shared_heads, K = c.active_routed_heads;
  if (K > 0) layer.set_router_routed_weight(st.matrix<T>(prefix + "wg.weight", E, c.embed_dim));
  if (S > 0 && K > 0) layer.set_router_mix_weight(st.matrix<T>(prefix + "wg_0.weight", 2, c.embed_dim));
  if (S > 1) layer.set_router_shared_weight(st.matrix<T>(prefix + "wg_1.weight", S, c.embed_dim));
}

/// Loads a MoAAttention from the MoA fairseq names.
template <class T>
void load_weights(MoAAttention<T>& layer, const SafeTensors& st, const std::string& prefix = "") {
  const MoAConfig& c = layer.config();
  const std::int64_t E = c.num_experts, D = c.embed_dim, d = c.head_dim;
  auto stacked = [&](const std::string& name, std::int64_t a, std::int64_t b) {
    const std::vector<T> v = st.values<T>(prefix + name, {E, a, b});
    return Matrix<T>(ConstMatrixMap<T>(v.data(), E * a, b));
  };
  layer.set_query_experts(stacked("q_proj.experts.w", D, d));
  layer.set_output_experts(stacked("q_proj.output_experts.w", d, D));
  layer.set_gate_weight(st.matrix<T>(prefix + "q_proj.w_gate", D, E));
  layer.set_key_weight(st.matrix<T>(prefix + "k_proj.weight", d, D));
  layer.set_value_weight(st.matrix<T>(prefix + "v_proj.weight", d, D));
}

}  // namespace moh
