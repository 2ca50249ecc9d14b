// Smallest possible moh user: the umbrella header must compile and link through moh::moh, and the
// one exception type must be catchable and derive from std::invalid_argument.
#include <moh/moh.hpp>

#include <iostream>
#include <stdexcept>

int main() {
  try {
    throw moh::Error("moh: consumer check");
  } catch (const moh::Error& error) {
    const std::invalid_argument& base = error;
    std::cout << "OK " << base.what() << '\n';
    return 0;
  }
}
