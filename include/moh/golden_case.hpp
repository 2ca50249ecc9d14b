// Golden cases: a safetensors file that carries a layer's weights, an input and the expected
// outputs (format "moh-case/1", see the project's FIXTURES.md), so that a model checks itself.
//
// run_case() builds the layer the metadata names ("mha", "moh", "moa", "moh_llama"), loads its
// weights, runs it on `x` (with `key_padding_mask` and `causal`; with `decode_from` = P the first
// P tokens go as one prompt call and every later token through the KV cache one at a time), and
// compares every expected tensor e with the computed c: max|c - e| <= 1e-4 * max(1, max|e|), and
// every 0 of `gates` / `head_mask` must be exactly 0. Malformed files throw moh::Error.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "moh/checkpoint.hpp"

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

inline Index metadata_int(const SafeTensors& st, const std::string& key) {
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

/// Throws unless the file holds at least `weights` values: metadata that describes a layer
/// larger than the file is an error before any allocation.
inline void require_weights_fit(const SafeTensors& st, double weights, const char* layer) {
  double held = 0;
  for (const std::string& name : st.names()) held += static_cast<double>(st.info(name).numel());
  if (weights > held)
    fail("case ", st.source(), ": metadata describes a ", layer, " layer with ", weights,
         " weights: expected at most the ", held, " values the file holds");
}

inline double metadata_double(const SafeTensors& st, const std::string& key) {
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

inline bool metadata_flag(const SafeTensors& st, const std::string& key) {
  const Index v = metadata_int(st, key);
  require(v == 0 || v == 1, "metadata '", key, "' in ", st.source(), ": expected 0 or 1, got ", v);
  return v == 1;
}

template <class T>
CaseCheck compare(const SafeTensors& st, const std::string& name, const T* computed,
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
CaseCheck compare(const SafeTensors& st, const std::string& name, const std::vector<T>& v,
                  bool exact_zeros = false) {
  return compare(st, name, v.data(), v.size(), exact_zeros);
}

inline ForwardOptions case_options(const SafeTensors& st, const Mask& padding) {
  ForwardOptions o;
  o.causal = metadata_flag(st, "causal");
  if (st.contains("key_padding_mask")) o.key_padding_mask = map_mask(padding);
  return o;
}

template <class T>
Tensor3<T> input_of(const SafeTensors& st, Index embed_dim) {
  Tensor3<T> x = st.tensor3<T>("x");
  require_shape3(std::string("case ") + st.source() + ": x", x, -1, -1, embed_dim);
  return x;
}

template <class T>
Tensor3<T> slice_tokens(const Tensor3<T>& x, Index first, Index count) {
  const Eigen::array<Index, 3> offsets{0, first, 0}, extents{x.dimension(0), count, x.dimension(2)};
  return x.slice(offsets, extents);
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
  const Mask padding = st.contains("key_padding_mask") ? st.mask("key_padding_mask") : Mask();
  const ForwardOptions opts = case_options(st, padding);
  const Index D = metadata_int(st, "embed_dim");
  auto y_values = [](const Tensor3<T>& y) { return std::vector<T>(y.data(), y.data() + y.size()); };

  if (result.layer == "mha") {
    MhaConfig c;
    c.embed_dim = D;
    c.num_heads = metadata_int(st, "num_heads");
    c.head_dim = metadata_int(st, "head_dim");
    c.bias = st.contains("in_proj_bias");
    c.validate();
    require_weights_fit(st, 4.0 * c.num_heads * c.head_size() * D, "mha");
    MultiHeadAttention<T> layer(c);
    load_weights(layer, st);
    const Tensor3<T> x = input_of<T>(st, D);
    result.checks.push_back(compare(st, "y", y_values(layer(x, opts))));
  } else if (result.layer == "moh") {
    MoHConfig c;
    c.embed_dim = D;
    c.num_heads = metadata_int(st, "num_heads");
    c.head_dim = metadata_int(st, "head_dim");
    c.shared_heads = metadata_int(st, "shared_heads");
    c.active_routed_heads = metadata_int(st, "active_routed_heads");
    c.bias = st.contains("qkv.bias");
    c.validate();
    require_weights_fit(st, 4.0 * c.num_heads * c.head_size() * D, "moh");
    MoHAttention<T> layer(c);
    load_weights(layer, st);
    const Tensor3<T> x = input_of<T>(st, D);
    MoHRouting<T> r;
    const Tensor3<T> y = layer(x, opts, &r);
    result.checks.push_back(compare(st, "y", y_values(y)));
    result.checks.push_back(compare(st, "gates", r.gates.data(), r.gates.size(), true));
    result.checks.push_back(compare(st, "aux_loss", std::vector<T>{r.load_balance_loss}));
  } else if (result.layer == "moa") {
    MoAConfig c;
    c.embed_dim = D;
    c.head_dim = metadata_int(st, "head_dim");
    c.num_experts = metadata_int(st, "num_experts");
    c.top_k = metadata_int(st, "top_k");
    c.validate();
    require_weights_fit(st, (2.0 * c.num_experts + 2.0) * c.head_dim * D, "moa");
    MoAAttention<T> layer(c);
    load_weights(layer, st);
    const Tensor3<T> x = input_of<T>(st, D);
    MoARouting<T> r;
    const Tensor3<T> y = layer(x, opts, &r);
    result.checks.push_back(compare(st, "y", y_values(y)));
    result.checks.push_back(compare(st, "expert_counts",
                                    std::vector<T>(r.expert_counts.begin(), r.expert_counts.end())));
    result.checks.push_back(compare(st, "switch_loss", std::vector<T>{r.switch_loss}));
    result.checks.push_back(compare(st, "z_loss", std::vector<T>{r.z_loss}));
  } else if (result.layer == "moh_llama") {
    MoHConfig c;
    c.embed_dim = D;
    c.num_heads = metadata_int(st, "num_heads");
    c.head_dim = metadata_int(st, "head_dim");
    c.num_kv_heads = metadata_int(st, "num_kv_heads");
    c.shared_heads = metadata_int(st, "shared_heads");
    c.active_routed_heads = metadata_int(st, "active_routed_heads");
    c.router = MoHRouter::QueryNorm;
    c.bias = false;
    c.rope = true;
    c.rope_base = metadata_double(st, "rope_theta");
    c.validate();
    require_weights_fit(st, (2.0 * c.num_heads + 2.0 * c.num_kv_heads) * c.head_size() * D,
                        "moh_llama");
    MoHAttention<T> layer(c);
    load_weights(layer, st);
    const Tensor3<T> x = input_of<T>(st, D);
    const Index B = x.dimension(0), Tn = x.dimension(1), H = c.num_heads;
    Tensor3<T> y(B, Tn, D);
    std::vector<T> mask(static_cast<std::size_t>(B * Tn * H), T(0));
    if (!st.has_metadata("decode_from")) {
      MoHRouting<T> r;
      y = layer(x, opts, &r);
      std::copy(r.gates.data(), r.gates.data() + r.gates.size(), mask.begin());
    } else {
      const Index P = metadata_int(st, "decode_from");
      require(P >= 0 && P <= Tn, "case ", st.source(), ": decode_from: expected 0..", Tn, ", got ",
              P);
      KvCache<T> cache = layer.make_cache(B, std::max<Index>(Tn, 1));
      for (Index t0 = 0; t0 < Tn;) {
        const Index n = (t0 == 0 && P > 0) ? P : 1;
        const Tensor3<T> xs = slice_tokens(x, t0, n);
        Tensor3<T> ys(B, n, D);
        Mask pad_chunk;
        ForwardOptions o = opts;
        if (opts.key_padding_mask) {
          const Eigen::array<Index, 2> off{0, t0}, ext{B, n};
          pad_chunk = padding.slice(off, ext);
          o.key_padding_mask = map_mask(pad_chunk);
        }
        MoHRouting<T> r;
        layer.forward_cached(xs, ys, cache, o, &r);
        for (Index b = 0; b < B; ++b)
          for (Index t = 0; t < n; ++t) {
            for (Index j = 0; j < D; ++j) y(b, t0 + t, j) = ys(b, t, j);
            for (Index h = 0; h < H; ++h)
              mask[static_cast<std::size_t>(((b * Tn) + t0 + t) * H + h)] = r.gates(b * n + t, h);
          }
        t0 += n;
      }
    }
    result.checks.push_back(compare(st, "y", y_values(y)));
    result.checks.push_back(compare(st, "head_mask", mask, true));
  } else {
    fail("case ", st.source(), ": layer: expected mha, moh, moa or moh_llama, got '",
         result.layer, "'");
  }
  return result;
}

}  // namespace moh
