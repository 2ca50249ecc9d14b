// JetMoE-style decoding: a small decoder written in user code (decode_loop.hpp) around
// moh::MoAAttention with multi-head experts (MoAConfig::jetmoe, docs/semantics.md §9): 8
// attention experts, each token routed to its top 2, every expert with 4 query heads of 64 over 4
// shared key/value heads, RoPE, and one moh::KvCache per layer. Each layer is
//
//   h = h + MoA(RMSNorm(h))                  y = sum of the 2 chosen experts' outputs, gated
//   h = h + down(SiLU(up(RMSNorm(h))))       a plain MLP (JetMoE's own is a mixture of MLPs)
//
// followed by a final RMSNorm and an LM head tied to the token embedding (logits = h E^T).
// Greedy generation: the 8-token prompt goes through as one forward_cached call, then each new
// token one call at a time. Prints the generated ids, tokens/s, how often each layer picked each
// expert while decoding, and a check that layer 0 decoding the sequence token by token matches
// one causal forward over all of it.
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target jetmoe_decode
//   ./build/examples/jetmoe_decode [new_tokens=32]
//
// The weights are seeded. A JetMoE checkpoint's attention loads with <moh/io.hpp> as
//   moh::load_weights(layer.attn, weights, "model.layers.<i>.self_attention.");
// (experts.input_linear, experts.output_linear, experts.router.layer, experts.bias, kv_proj).
#include <moh/moh.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "decode_loop.hpp"

using decode_example::Index;
using decode_example::Matrix;
using Attn = moh::MoAAttention<float>;

int main(int argc, char** argv) {
  const int new_tokens = argc > 1 ? std::stoi(argv[1]) : 32;
  if (new_tokens < 1) {
    std::fprintf(stderr, "new_tokens must be >= 1, got %d\n", new_tokens);
    return 1;
  }
  const std::vector<Index> prompt = {1, 17, 230, 42, 999, 5, 64, 311};
  const Index vocab = 1024, D = 256, ffn = 4 * D, num_layers = 4;
  const Index P = static_cast<Index>(prompt.size()), max_tokens = P + new_tokens;
  // 4 key/value heads of 64; 8 experts of 4 query heads each, top 2 per token; RoPE base 10000.
  const moh::MoAConfig config = moh::MoAConfig::jetmoe(D, /*kv_heads=*/4, /*experts=*/8,
                                                       /*top_k=*/2, /*head_dim=*/64, 10000.0);

  decode_example::Decoder<Attn> model(config, vocab, ffn, /*gated=*/false, num_layers,
                                      max_tokens);
  const decode_example::Generation g = decode_example::generate(model, prompt, new_tokens);
  const std::vector<Index>& sequence = g.sequence;  // every token fed to the model

  std::printf("%ld layers, D = %ld, MoA: %ld experts (top %ld) of %ld heads of %ld over %ld kv "
              "heads, RoPE\nprompt:   ",
              long(num_layers), long(D), long(config.num_experts), long(config.top_k),
              long(config.kv_heads()), long(config.head_dim), long(config.kv_heads()));
  for (Index t = 0; t < P; ++t) std::printf(" %ld", long(sequence[t]));
  std::printf("\ngenerated:");
  for (Index t = P; t < max_tokens; ++t) std::printf(" %ld", long(sequence[t]));
  std::printf("\nprompt: %ld tokens in %.2f ms; decode: %d tokens in %.2f ms = %.0f tokens/s "
              "(1 thread)\n",
              long(P), 1e3 * g.prefill_s, new_tokens, 1e3 * g.decode_s, new_tokens / g.decode_s);

  std::printf("expert picks while decoding (%d tokens x top %ld per layer):\n", new_tokens,
              long(config.top_k));
  std::printf("  expert: ");
  for (Index e = 0; e < config.num_experts; ++e) std::printf(" %3ld", long(e));
  std::printf("\n");
  for (Index i = 0; i < num_layers; ++i) {
    std::printf("  layer %ld:", long(i));
    for (Index c : model.layers[i].used) std::printf(" %3ld", long(c));
    std::printf("\n");
  }

  // Check: layer 0 over the whole sequence, as decoding feeds it (the prompt in one cached call,
  // then one token per call through a fresh cache), against one causal forward over all of it.
  const Index L = static_cast<Index>(sequence.size());
  const decode_example::DecoderLayer<Attn>& layer = model.layers[0];
  Matrix tokens(L, D), x(L, D), stepwise(L, D), full(L, D);  // [L, D]
  for (Index t = 0; t < L; ++t) tokens.row(t) = model.embedding.row(sequence[t]);
  decode_example::rms_norm(tokens, layer.attn_norm, x);
  moh::KvCache<float> cache = layer.attn.make_cache(1, L);
  moh::ForwardOptions opts;
  opts.workspace = &model.workspace;
  for (Index t = 0, n = P; t < L; t += n, n = 1) {
    layer.attn.forward_cached(moh::ConstTensorMap3<float>(x.data() + t * D, 1, n, D),
                              moh::TensorMap3<float>(stepwise.data() + t * D, 1, n, D), cache,
                              opts);
  }
  opts.causal = moh::Causal::On;  // forward is not causal by default
  layer.attn.forward(moh::ConstTensorMap3<float>(x.data(), 1, L, D),
                     moh::TensorMap3<float>(full.data(), 1, L, D), opts);
  std::printf("layer 0, %ld tokens: max |cached decoding - one causal forward| = %.2e "
              "(output scale %.2f)\n",
              long(L), (stepwise - full).cwiseAbs().maxCoeff(), full.cwiseAbs().maxCoeff());
  return 0;
}
