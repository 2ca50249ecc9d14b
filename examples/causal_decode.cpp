// Causal decoding: a small LLaMA-style decoder written in user code (decode_loop.hpp) around
// moh::MoHAttention as MoH-LLaMA3 has it (MoHConfig::moh_llama3): the parameter-free query-norm
// router, RoPE, grouped-query heads (8 query heads over 2 key/value heads), no bias, and one
// moh::KvCache per layer. Each layer is
//
//   h = h + MoH(RMSNorm(h))                                 4 shared + top 2 of 4 routed heads
//   h = h + down(SiLU(gate(RMSNorm(h))) * up(RMSNorm(h)))   SwiGLU MLP
//
// followed by a final RMSNorm and an LM head tied to the token embedding (logits = h E^T).
// Greedy generation: the 8-token prompt goes through as one forward_cached call, then each new
// token one call at a time. Prints the generated ids, tokens/s and which heads each layer used.
// MoH-LLaMA3-8B's own attention is MoHConfig::moh_llama3_8b() (D 4096, 32 heads over 8).
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target causal_decode
//   ./build/examples/causal_decode [new_tokens=32] [weights.safetensors]
//
// With a safetensors file, layer i's attention is loaded from "layers.<i>.self_attn.q_proj.weight"
// [256, 256], k_proj / v_proj [64, 256] and o_proj [256, 256]; everything else stays random.
#include <moh/io.hpp>  // moh.hpp plus SafeTensors and load_weights

#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include "decode_loop.hpp"

using decode_example::Index;
using Attn = moh::MoHAttention<float>;

int main(int argc, char** argv) {
  const int new_tokens = argc > 1 ? std::stoi(argv[1]) : 32;
  if (new_tokens < 1) {
    std::cerr << "new_tokens must be >= 1, got " << new_tokens << '\n';
    return 1;
  }
  const std::vector<Index> prompt = {1, 17, 230, 42, 999, 5, 64, 311};
  const Index vocab = 1024, D = 256, ffn = 688, num_layers = 4;
  const Index max_tokens = static_cast<Index>(prompt.size()) + new_tokens;

  // MoH-LLaMA3's attention at a small size, split as the released model splits its 32 heads:
  // 8 query heads over 2 key/value heads, heads 0-3 shared, the top 2 of heads 4-7 routed by
  // query norm, RoPE, no bias.
  const moh::MoHConfig config = moh::MoHConfig::moh_llama3(D, /*num_heads=*/8, /*num_kv_heads=*/2);
  decode_example::Decoder<Attn> model(config, vocab, ffn, /*gated=*/true, num_layers, max_tokens);

  try {
    if (argc > 2) {
      const moh::SafeTensors weights = moh::SafeTensors::open(argv[2]);
      for (Index i = 0; i < num_layers; ++i)
        moh::load_weights(model.layers[i].attn, weights,
                          "layers." + std::to_string(i) + ".self_attn.");
      std::cout << "attention weights loaded from " << argv[2] << '\n';
    }
  } catch (const moh::Error& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }

  const decode_example::Generation g = decode_example::generate(model, prompt, new_tokens);
  const std::vector<Index> generated(g.sequence.begin() + prompt.size(), g.sequence.end());

  std::cout << "prompt:   ";
  for (Index id : prompt) std::cout << ' ' << id;
  std::cout << "\ngenerated:";
  for (Index id : generated) std::cout << ' ' << id;
  std::cout << std::fixed << std::setprecision(1) << "\nprompt: " << prompt.size() << " tokens in "
            << 1e3 * g.prefill_s << " ms; decode: " << new_tokens << " tokens in "
            << 1e3 * g.decode_s << " ms = " << new_tokens / g.decode_s
            << " tokens/s (1 thread)\n";

  std::cout << "heads used per decoded token (heads 0-3 shared, 4-7 routed by query norm):\n";
  for (Index i = 0; i < num_layers; ++i) {
    const decode_example::DecoderLayer<Attn>& layer = model.layers[i];
    Index used = 0;
    for (Index c : layer.used) used += c;
    std::cout << "  layer " << i << ": " << 100.0 * used / (layer.calls * config.num_heads)
              << "% of heads; tokens per head:";
    for (Index c : layer.used) std::cout << ' ' << c;
    std::cout << '\n';
  }
  return 0;
}
