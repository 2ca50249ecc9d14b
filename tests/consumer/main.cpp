// Smallest real moh user: the umbrella header compiles and links through moh::moh alone (Eigen
// and threads come with it; no nlohmann-json), a layer runs on two threads, and bad input is a
// catchable moh::Error derived from std::invalid_argument.
#include <moh/moh.hpp>

#include <cmath>
#include <iostream>
#include <stdexcept>

int main() {
  moh::MoHConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.shared_heads = 1;
  config.active_routed_heads = 1;
  const moh::MoHAttention<float> layer(config, /*seed=*/7);

  moh::Tensor3<float> x(2, 5, 32);
  x.setRandom();
  moh::ThreadPool pool(2);
  moh::ForwardOptions opts;
  opts.pool = &pool;
  moh::MoHRouting<float> routing;
  const moh::Tensor3<float> y = layer(x, opts, &routing);
  for (moh::Index i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y.data()[i])) {
      std::cerr << "FAIL: non-finite output\n";
      return 1;
    }
  }
  if (routing.active_fraction() != 0.5) {
    std::cerr << "FAIL: active fraction " << routing.active_fraction() << ", expected 0.5\n";
    return 1;
  }
  try {
    layer(moh::Tensor3<float>(2, 5, 16));
  } catch (const std::invalid_argument& error) {
    std::cout << "OK " << error.what() << '\n';
    return 0;
  }
  std::cerr << "FAIL: a wrong input shape did not throw\n";
  return 1;
}
