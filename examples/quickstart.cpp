// Quick start: a dense MultiHeadAttention, a Mixture-of-Head attention (MoH) that uses half of its
// heads per token, and a Mixture of Attention heads (MoA) layer, all with seeded random weights,
// run on the same input; prints output shapes, routing statistics and a moh::Error message.
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target quickstart
//   ./build/examples/quickstart
#include <moh/moh.hpp>

#include <iostream>
#include <random>

template <class Container>
void print_counts(const char* label, const Container& counts) {
  std::cout << "  " << label << ":";
  for (moh::Index c : counts) std::cout << ' ' << c;
  std::cout << '\n';
}

int main() {
  moh::Tensor3<float> x(2, 16, 256);  // [batch, tokens, embed_dim]
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (moh::Index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);

  moh::MhaConfig mha_config;
  mha_config.embed_dim = 256;
  mha_config.num_heads = 8;
  moh::MultiHeadAttention<float> mha(mha_config, /*seed=*/1);

  moh::MoHConfig moh_config;  // 2 shared heads + the top 2 of 6 routed heads = 4 of 8 heads
  moh_config.embed_dim = 256;
  moh_config.num_heads = 8;
  moh_config.shared_heads = 2;
  moh_config.active_routed_heads = 2;
  moh::MoHAttention<float> moh_layer(moh_config, /*seed=*/2);

  moh::MoAConfig moa_config;  // 8 experts of size 32, each token uses 2 of them
  moa_config.embed_dim = 256;
  moa_config.head_dim = 32;
  moa_config.num_experts = 8;
  moa_config.top_k = 2;
  moh::MoAAttention<float> moa(moa_config, /*seed=*/3);

  const moh::Tensor3<float> y_mha = mha(x);
  moh::MoHRouting<float> moh_routing;
  const moh::Tensor3<float> y_moh = moh_layer(x, {}, &moh_routing);
  moh::MoARouting<float> moa_routing;
  const moh::Tensor3<float> y_moa = moa(x, {}, &moa_routing);

  const char* names[] = {"MHA", "MoH", "MoA"};
  const moh::Tensor3<float>* outputs[] = {&y_mha, &y_moh, &y_moa};
  for (int i = 0; i < 3; ++i)
    std::cout << names[i] << " output: [" << outputs[i]->dimension(0) << ", "
              << outputs[i]->dimension(1) << ", " << outputs[i]->dimension(2) << "]\n";

  std::cout << "MoH: active fraction " << moh_routing.active_fraction()
            << ", load-balance loss " << moh_routing.load_balance_loss << '\n';
  print_counts("tokens per head (heads 0-1 shared)", moh_routing.head_counts);
  std::cout << "MoA: switch loss " << moa_routing.switch_loss << ", z-loss " << moa_routing.z_loss
            << ", cv loss " << moa_routing.cv_loss << '\n';
  print_counts("(token, slot) pairs per expert", moa_routing.expert_counts);

  try {
    moh::Tensor3<float> wrong(2, 16, 128);  // embed_dim 128, but the layer expects 256
    mha(wrong);
  } catch (const moh::Error& e) {
    std::cout << "caught moh::Error: " << e.what() << '\n';
  }
  return 0;
}
