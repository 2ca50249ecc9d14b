// moh_memory [mha|moh|moa] [tokens]: runs one long prefill (batch 1, D = 1024, H = 16, default
// 8192 tokens) and prints the process's peak resident memory, to check that the tiled kernel
// never holds a [tokens x keys] score matrix. Run one layer per process so peaks do not mix.
// Bad arguments, and any moh::Error, print a message and exit 1.
#include <sys/resource.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "moh/moh.hpp"

namespace {

constexpr long kMaxTokens = 1L << 20;  // x and y alone take 4 GiB each at this size

double peak_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

/// Parses `text` as a token count in 1..kMaxTokens; throws moh::Error naming what it got.
moh::Index parse_tokens(const char* text) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || v < 1 || v > kMaxTokens) {
    throw moh::Error(moh::detail::concat("moh: moh_memory: tokens: expected an integer in 1..",
                                         kMaxTokens, ", got '", text, "'"));
  }
  return static_cast<moh::Index>(v);
}

int run(int argc, char** argv) {
  if (argc > 3) {
    throw moh::Error(moh::detail::concat(
        "moh: moh_memory: expected at most 2 arguments ([mha|moh|moa] [tokens]), got ", argc - 1));
  }
  const std::string layer = argc > 1 ? argv[1] : "mha";
  if (layer != "mha" && layer != "moh" && layer != "moa") {
    throw moh::Error(moh::detail::concat("moh: moh_memory: layer: expected mha, moh or moa, got '",
                                         layer, "'"));
  }
  const moh::Index tokens = argc > 2 ? parse_tokens(argv[2]) : 8192, D = 1024, H = 16;
  moh::Tensor3<float> x(1, tokens, D), y(1, tokens, D);
  x.setRandom();
  moh::Workspace workspace;  // the call's scratch, reported below
  moh::ForwardOptions opts;
  opts.workspace = &workspace;
  const double before = peak_mib();
  const auto start = std::chrono::steady_clock::now();
  if (layer == "mha") {
    moh::MHAConfig c;
    c.embed_dim = D;
    c.num_heads = H;
    moh::MultiHeadAttention<float>(c, 1).forward(x, y, opts);
  } else if (layer == "moh") {
    moh::MoHConfig c;
    c.embed_dim = D;
    c.num_heads = H;
    c.shared_heads = 4;
    c.active_routed_heads = 4;  // 50% of the heads
    moh::MoHAttention<float>(c, 1).forward(x, y, opts);
  } else {
    moh::MoAConfig c;
    c.embed_dim = D;
    c.head_dim = 64;
    c.num_experts = 16;
    c.top_k = 2;
    moh::MoAAttention<float>(c, 1).forward(x, y, opts);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double score_matrix_mib = static_cast<double>(tokens) * tokens * H * 4 / (1 << 20);
  std::printf("%s prefill: batch 1, tokens %ld, D %ld, H %ld: %.1f s, peak RSS %.0f MiB "
              "(%.0f MiB before the layer ran; workspace %.0f MiB; the scores of all heads would "
              "need %.0f MiB)\n",
              layer.c_str(), static_cast<long>(tokens), static_cast<long>(D),
              static_cast<long>(H), seconds, peak_mib(), before,
              static_cast<double>(workspace.bytes()) / (1 << 20), score_matrix_mib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // moh::Error for bad arguments; bad_alloc and the like too
    std::fprintf(stderr, "moh_memory: %s\n", e.what());
    std::fprintf(stderr, "usage: moh_memory [mha|moh|moa] [tokens]\n");
    return 1;
  }
}
