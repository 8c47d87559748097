// Linked into the CPU suites that CTest runs a second time with FLASHATTN_CPU_AMX=0 (the
// fp32 products on processors with AMX tiles or AVX512-BF16, src/cpu/amx.hpp). Where the
// processor has neither, that run would repeat the default one exactly: it skips every test
// instead, saying why (GoogleTest counts tests skipped by the environment as passed; CTest
// reports them skipped by the message, tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "cpu/amx.hpp"

namespace {

class SkipWithoutAmx : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* set = std::getenv("FLASHATTN_CPU_AMX");
    if (set != nullptr && std::strcmp(set, "0") == 0 && !flashattn::detail::cpu::amx::supported())
      GTEST_SKIP() << "FLASHATTN_CPU_AMX=0 on a processor without AMX tiles or AVX512-BF16 runs "
                      "what the default run of this suite ran: skipped";
  }
};

const ::testing::Environment* const registered =
    ::testing::AddGlobalTestEnvironment(new SkipWithoutAmx);

}  // namespace
