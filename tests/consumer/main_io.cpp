// The checkpoint side of a downstream project: <moh/io.hpp> through moh::io (moh::moh plus
// nlohmann-json). Saves a layer with its config, rebuilds it from the file alone, and checks
// that both compute the same bits.
#include <moh/io.hpp>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  const std::string path = std::string(argc > 1 ? argv[1] : ".") + "/moh_consumer_io.safetensors";
  moh::MHAConfig config;
  config.embed_dim = 16;
  config.num_heads = 2;
  const moh::MultiHeadAttention<float> layer(config, /*seed=*/3);
  moh::SafeTensorsWriter writer;
  moh::save_weights(writer, layer, "attn.");
  writer.write(path);
  const auto again =
      moh::load_layer<moh::MultiHeadAttention<float>>(moh::SafeTensors::open(path), "attn.");
  std::remove(path.c_str());

  moh::Tensor3<float> x(1, 4, 16);
  x.setRandom();
  const moh::Tensor3<float> a = layer(x), b = again(x);
  if (std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) != 0) {
    std::cerr << "FAIL: the reloaded layer computes other numbers\n";
    return 1;
  }
  std::cout << "OK saved and reloaded " << layer.weight_infos().size() << " tensors\n";
  return 0;
}
