// Dropout's random numbers: one counter-based Philox4x32-10 generator (Salmon et al., "Parallel
// random numbers: as easy as 1, 2, 3", SC'11), written once for the CPU engine, the reference
// and the CUDA kernels. A counter-based generator has no state to carry: the random number of
// an element is a pure function of where it is, so the forward and the backward (and every
// backend, tile shape and thread count) see exactly the same dropout mask without storing it.
//
// The keep bit of element (b, h, i, j) of a call with (seed, offset, p):
//   key     = first two words of Philox4x32-10(counter = (lo(offset), hi(offset), 0, 0),
//                                               key = (lo(seed), hi(seed)))
//   counter = (j / 4, i, h, b)       b: batch (sequence) index, h: query head,
//                                    i: query row and j: key column within sequence b
//   r       = word (j % 4) of Philox4x32-10(counter, key)
//   keep    = r < threshold,  threshold = min(round((1 - p) * 2^32), 2^32 - 1)
// So one Philox call gives the bits of 4 consecutive columns (a 64-key tile row costs 16
// calls), and every (b, h, i, j) of a call has its own counter with no packing limit (each
// index is below 2^31 by validation). The offset enters through the key rather than the
// counter because the counter's 128 bits are already taken by the four indices; two (seed,
// offset) pairs share a key only by a 2^-64 chance. A kept element is scaled by 1 / (1 - p).
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace flashattn::detail {

struct Philox4x32 {
  uint32_t x[4];
};

FA_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// Philox4x32 with 10 rounds, exactly as Random123's philox4x32_R(10, counter, key).
FA_HOST_DEVICE Philox4x32 philox4x32_10(Philox4x32 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;    // round multipliers
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    const uint32_t hi0 = mulhi32(kMul0, c.x[0]), lo0 = kMul0 * c.x[0];
    const uint32_t hi1 = mulhi32(kMul1, c.x[2]), lo1 = kMul1 * c.x[2];
    c = Philox4x32{{hi1 ^ c.x[1] ^ k0, lo1, hi0 ^ c.x[3] ^ k1, lo0}};
  }
  return c;
}

// What a call needs to draw keep bits: built once per call from (seed, offset, p).
struct DropoutRng {
  uint32_t key0 = 0, key1 = 0;
  uint32_t threshold = 0;  // keep iff the 32-bit random number < threshold
  float scale = 1.0f;      // 1 / (1 - p), applied to kept probabilities

  // The four keep bits of columns 4g .. 4g+3 of row i of (b, h): bit n is column 4g + n.
  FA_HOST_DEVICE uint32_t keep_bits4(uint32_t b, uint32_t h, uint32_t i, uint32_t g) const {
    const Philox4x32 r = philox4x32_10(Philox4x32{{g, i, h, b}}, key0, key1);
    return uint32_t{r.x[0] < threshold} | uint32_t{r.x[1] < threshold} << 1 |
           uint32_t{r.x[2] < threshold} << 2 | uint32_t{r.x[3] < threshold} << 3;
  }
  FA_HOST_DEVICE bool keep(uint32_t b, uint32_t h, uint32_t i, uint32_t j) const {
    return (keep_bits4(b, h, i, j / 4) >> (j % 4)) & 1u;
  }
  // The keep bits of columns j (bit 0) and j + 1 (bit 1) of row i: one Philox call, or two
  // where the pair straddles groups of 4 columns (j % 4 == 3).
  FA_HOST_DEVICE uint32_t keep_bits2(uint32_t b, uint32_t h, uint32_t i, uint32_t j) const {
    uint32_t bits = keep_bits4(b, h, i, j / 4) >> (j % 4);
    if (j % 4 == 3) bits = (bits & 1u) | (keep_bits4(b, h, i, j / 4 + 1) & 1u) << 1;
    return bits;
  }
};

// p in (0, 1); p = 0 means no dropout and no generator at all.
FA_HOST_DEVICE DropoutRng make_dropout_rng(uint64_t seed, uint64_t offset, float p) {
  DropoutRng rng;
  const Philox4x32 key =
      philox4x32_10(Philox4x32{{static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                                0u, 0u}},
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  rng.key0 = key.x[0];
  rng.key1 = key.x[1];
  // (1 - p) * 2^32 to the nearest integer; it reaches 2^32 only when p < 2^-33, where clamping
  // changes the keep probability by less than 2^-32.
  const double keep = (1.0 - static_cast<double>(p)) * 4294967296.0 + 0.5;
  rng.threshold = keep >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(keep);
  rng.scale = 1.0f / (1.0f - p);
  return rng;
}

// The keep bit as a pure function of everything it depends on (SPEC.md step 6).
FA_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, uint32_t b, uint32_t h,
                                 uint32_t i, uint32_t j, float p) {
  return make_dropout_rng(seed, offset, p).keep(b, h, i, j);
}

}  // namespace flashattn::detail
