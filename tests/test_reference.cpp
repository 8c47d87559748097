#include "support.hpp"
TEST(Placeholder, Empty) {}
