// FP8 v given row-major to the Hopper kernel: the kernel that reads v as the P V product's
// operand ((d, seqlen)-major: docs/SPEC.md, "FP8 inputs") needs no transposing warps and runs
// at 1.04-1.49x the transposing one at head dim 128 and 1.27-2.19x at 256 (H100, 2026-12-07,
// docs/PERFORMANCE.md "FP8"). Where a call reads each key often enough (queries per key/value
// head), a (d, seqlen)-major copy of v made first, one pass over v in global memory, costs a
// few per cent of that: the call then runs on the copy. Dense calls only (the kernel takes no
// varlen call with such a v), and head dims of whole 16-byte chunks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/params.hpp"

namespace flashattn::detail::cuda {

// Whether the call runs on a (d, seqlen)-major copy of its v.
bool copies_values_seqlen_major(const ForwardParams& p);
// The copy's bytes: (B, Hk, head_dim_v, keys), keys = seqlen_k rounded up to 16 (so that each
// column starts at a 16-byte multiple, as the kernel's TMA boxes need).
size_t seqlen_major_values_bytes(const ForwardParams& p);
// Launches the copy into `copy` (seqlen_major_values_bytes of device memory) on p's stream and
// returns p with v pointed at it.
ForwardParams with_seqlen_major_values(const ForwardParams& p, void* copy);

}  // namespace flashattn::detail::cuda
