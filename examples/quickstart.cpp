// Quick start: a Mixture-of-Head attention layer that uses 4 of its 8 heads per token, run on a
// batch; the heads each token used; and a moh::Error for a wrong input. Build and run:
//   cmake -S . -B build && cmake --build build --target quickstart && ./build/examples/quickstart
#include <moh/moh.hpp>

#include <iostream>

int main() {
  moh::MoHConfig config;  // 2 shared heads + the top 2 of 6 routed heads = 4 of 8 per token
  config.embed_dim = 256;
  config.num_heads = 8;
  config.shared_heads = 2;
  config.active_routed_heads = 2;
  const moh::MoHAttention<float> layer(config, /*seed=*/2);  // or moh::load_weights (moh/io.hpp)

  moh::Tensor3<float> x(2, 16, 256);  // [batch, tokens, embed_dim], row-major like a torch tensor
  x.setRandom();
  moh::Workspace workspace;           // scratch kept between calls: warm calls allocate nothing
  moh::ForwardOptions options;
  options.workspace = &workspace;
  moh::MoHRouting<float> routing;     // gates [B*T, H], the heads each token used, counts, loss
  const moh::Tensor3<float> y = layer(x, options, &routing);

  std::cout << "y: [" << y.dimension(0) << ", " << y.dimension(1) << ", " << y.dimension(2)
            << "], heads used: " << 100 * routing.active_fraction() << "%, token 0 used heads";
  for (moh::Index h : routing.heads_of(0, 0)) std::cout << ' ' << h;
  std::cout << ", load-balance loss " << routing.load_balance_loss << '\n';

  try {
    layer(moh::Tensor3<float>(2, 16, 128));  // embed_dim 128, but the layer expects 256
  } catch (const moh::Error& e) {
    std::cout << e.what() << '\n';
  }
}
