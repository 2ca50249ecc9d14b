// Compiled (not run) by the header_kernels_* tests for vector targets other than the build
// machine's (tests/CMakeLists.txt): -fsyntax-only still instantiates the templates these calls
// use and checks their bodies, so the decode and prefill kernels whose code differs by target
// (value panels, heads in pairs, even/odd widening, row tiles) compile, static asserts included,
// for AVX2, AVX-512, plain SSE2 and with Eigen's vectorization off, whatever machine builds. The
// header_* tests alone parse the headers without instantiating them.
#include "moh/moh.hpp"

namespace kernel_instantiation {

template <class T>
using In = moh::ConstTensorMap3<T>;
template <class T>
using Out = moh::TensorMap3<T>;

template <class Layer, class T>
void use(const Layer& layer, const In<T>& x, Out<T> y, moh::KvCache<T>& cache) {
  layer.forward(x, y);
  layer.forward_cached(x, y, cache);
}

template void use(const moh::MultiHeadAttention<float>&, const In<float>&, Out<float>,
                  moh::KvCache<float>&);
template void use(const moh::MoHAttention<float>&, const In<float>&, Out<float>,
                  moh::KvCache<float>&);
template void use(const moh::MoAAttention<float>&, const In<float>&, Out<float>,
                  moh::KvCache<float>&);
template void use(const moh::MultiHeadAttention<double>&, const In<double>&, Out<double>,
                  moh::KvCache<double>&);

}  // namespace kernel_instantiation

int main() { return 0; }
