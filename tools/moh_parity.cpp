// moh_parity FILE...: runs golden cases (format moh-case/1) and prints one line per file,
// PASS or FAIL with the largest error. Exits 1 if any case fails or cannot be run.
#include <cstdio>
#include <exception>
#include <string>

#include "moh/moh.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: moh_parity FILE.safetensors...\n");
    return 2;
  }
  int failed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string path = argv[i];
    try {
      const moh::CaseResult r = moh::run_case<float>(moh::SafeTensors::open(path));
      std::string detail;
      for (const moh::CaseCheck& c : r.checks) {
        char buf[160];
        std::snprintf(buf, sizeof buf, " %s=%.3g/%.3g%s", c.name.c_str(), c.max_error,
                      c.tolerance, c.zeros_exact ? "" : "(nonzero where 0 expected)");
        detail += buf;
      }
      std::printf("%s %s [%s]%s\n", r.passed() ? "PASS" : "FAIL", path.c_str(), r.layer.c_str(),
                  detail.c_str());
      failed += r.passed() ? 0 : 1;
    } catch (const std::exception& e) {
      std::printf("FAIL %s: %s\n", path.c_str(), e.what());
      ++failed;
    }
  }
  std::printf("%d passed, %d failed\n", argc - 1 - failed, failed);
  return failed ? 1 : 0;
}
