// Division by a number fixed for a whole kernel launch, as one multiply and one shift.
//
// A GPU has no integer divider: `n / d` with a runtime d compiles to a reciprocal on the MUFU
// unit and a dozen dependent integer instructions (in 64 bits, a call). The sm90 forward's
// consumers split a tile index into batch element, head and query block at the start of every
// tile, with both tensor-core consumers waiting on that arithmetic; a multiply by a magic
// number made on the host once takes two instructions instead.
//
// For d >= 1, with l = ceil(log2 d) and p = 31 + l, magic = ceil(2^p / d) fits in 32 bits, and
// floor(n magic / 2^p) = floor(n / d) for every n < 2^31: magic d = 2^p + e with 0 <= e < d,
// so n magic / 2^p = n / d + n e / (d 2^p), and n e < 2^31 2^l = 2^p keeps the excess below
// 1 / d, too little to reach the next integer.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace flashattn::detail {

struct Divisor {
  uint32_t divisor = 1;
  uint32_t magic = 1u << 31;
  uint32_t shift = 31;

  // d in [1, 2^31).
  static Divisor of(uint32_t d) {
    uint32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    Divisor r;
    r.divisor = d;
    r.shift = 31 + l;
    r.magic = static_cast<uint32_t>(((uint64_t{1} << r.shift) + d - 1) / d);
    return r;
  }

  // n < 2^31.
  FA_HOST_DEVICE uint32_t quotient(uint32_t n) const {
    return static_cast<uint32_t>((uint64_t{n} * magic) >> shift);
  }
  FA_HOST_DEVICE uint32_t remainder(uint32_t n, uint32_t q) const { return n - q * divisor; }
};

}  // namespace flashattn::detail
