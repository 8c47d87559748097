#!/usr/bin/env python3
"""Decoding through the installed package, as a serving loop calls it: one new query token
per sequence against a key/value cache,

    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    out = flashattn.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths,
                                            block_table=table)           # paged

q (B, 1, H, D); a dense cache (B, S, Hk, D), or a paged one: pages of --page-size rows in
random order in a pool, addressed through block_table. Shapes (batch x cache length): 1x8k,
1x128k, 8x32k, 64x4k; 32 query heads, 8 key/value heads (GQA), hdim 128, bf16 by default.

Decoding is memory-bound: the figure is TB/s of K and V read (2 * B * S * Hk * D * element
size per call, the same numerator for every system), EAGER and KERNEL (bench/harness.py; a
serving engine replays decode graphs, so the kernel time is what it sees), and ours as a
share of the device copy bandwidth measured in the same run (a torch copy of --copy-mib:
read + write bytes over the time of a graph-replayed copy). Peers: SDPA forced to
FlashAttention-2 and cuDNN, q (B, H, 1, D) against (B, Hk, S, D) views of the dense cache with
enable_gqa=True (no copies); SDPA takes no paged cache, so the paged rows have ours alone.

--fp8 adds "ours-fp8": ours over fp8 e4m3 copies of the same caches (one factor per tensor, as
k_descale/v_descale (B, Hk)), its TB/s counting the same 16-bit bytes, so that its rate over
ours's is the tokens/s gained (fp8_speedup per row in the JSON).

Correctness before timing: ours's out and lse (on poisoned memory) against a float64
reference on two (batch, head) slices (through block_table for the paged cache) and against
the first peer on the dense cache. Writes decode.json, decode.md, decode.png in --out; prints
the table last. Exit status 1 when a check of ours failed.
"""
from __future__ import annotations

from dataclasses import dataclass

import harness as h

SHAPES = ((1, 8192), (1, 131072), (8, 32768), (64, 4096))
QUICK_SHAPES = ((1, 8192), (8, 4096))
CPU_SHAPES = ((1, 256), (2, 128))
CPU_QUICK_SHAPES = ((1, 128),)
HEADS, KV_HEADS, HDIM = 32, 8, 128
CPU_HEADS, CPU_KV_HEADS, CPU_HDIM = 4, 2, 64
DEFAULT_PAGE_SIZE, CPU_PAGE_SIZE = 256, 16
PAGED_PEERS = "SDPA takes no paged KV cache"


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    hdim: int
    paged: bool

    def label(self) -> str:
        return f"{self.batch}x{h.seqlen_label(self.seqlen)} " \
               f"{'paged' if self.paged else 'dense'}"

    def fields(self) -> dict:
        return {"label": self.label(), "batch": self.batch, "seqlen": self.seqlen,
                "heads": self.heads, "kv_heads": self.kv_heads, "hdim": self.hdim,
                "paged": self.paged}


def make_sets(shape: DecodeShape, args, page_size: int) -> list[dict]:
    """Input sets (q, the caches, lengths, block_table), together beyond --rotate-mib."""
    import torch
    dtype = h.torch_dtype(args.dtype)
    b, s, hk, d = shape.batch, shape.seqlen, shape.kv_heads, shape.hdim
    per_set = h.kv_bytes(b, s, hk, d, dtype.itemsize)
    gen = h.generator(args.device, args.seed)
    sets = []
    for _ in range(h.set_count(per_set, args.rotate_mib * h.MIB)):
        x = {"q": h.random_tensors([(b, 1, shape.heads, d)], dtype, args.device, gen)[0],
             "cache_seqlens": torch.full((b,), s, dtype=torch.int32, device=args.device),
             "block_table": None}
        if shape.paged:
            pages = -(-s // page_size)
            order = torch.randperm(b * pages, device=args.device, generator=gen)
            x["block_table"] = order.view(b, pages).to(torch.int32)
            dims = (b * pages, page_size, hk, d)
        else:
            dims = (b, s, hk, d)
        x["k_cache"], x["v_cache"] = h.random_tensors([dims] * 2, dtype, args.device, gen)
        sets.append(x)
    return sets


def dense_rows(x: dict, b: int, seqlen: int):
    """(k, v) of sequence b as (S, Hk, D), gathered through block_table when paged."""
    k, v = x["k_cache"], x["v_cache"]
    if x["block_table"] is None:
        return k[b, :seqlen], v[b, :seqlen]
    table = x["block_table"][b].long()
    return (t[table].reshape(-1, *t.shape[2:])[:seqlen] for t in (k, v))


def call_ours(x: dict):
    from flashattn import flash_attn_with_kvcache
    return lambda **extra: flash_attn_with_kvcache(
        x["q"], x["k_cache"], x["v_cache"], cache_seqlens=x["cache_seqlens"],
        block_table=x["block_table"], **extra)


def fp8_copy(x: dict) -> dict:
    """x with its caches in e4m3, each over one factor (its largest magnitude / 448)."""
    import torch
    y = dict(x)
    b, hk = x["q"].shape[0], x["k_cache"].shape[2]
    for name, factor in (("k_cache", "k_descale"), ("v_cache", "v_descale")):
        scale = x[name].abs().amax().float().clamp_min(1e-30) / 448
        y[name] = (x[name].float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        y[factor] = scale.expand(b, hk).contiguous()
    return y


def call_ours_fp8(x: dict):
    from flashattn import flash_attn_with_kvcache
    return lambda: flash_attn_with_kvcache(
        x["q"], x["k_cache"], x["v_cache"], cache_seqlens=x["cache_seqlens"],
        block_table=x["block_table"], k_descale=x["k_descale"], v_descale=x["v_descale"])


def call_peer(x: dict):
    return lambda: h.sdpa_call(x["q"], x["k_cache"], x["v_cache"], False, enable_gqa=True)


def check(shape: DecodeShape, sets: list[dict], args) -> dict:
    import torch
    x = sets[0]
    blocks = [(x["q"].shape, x["q"].dtype), ((shape.batch, shape.heads, 1), torch.float32)]
    with h.poisoned_allocations(args.device, blocks) as addresses:
        out, lse = call_ours(x)(return_softmax_lse=True)
    poisoned = out.data_ptr() in addresses and lse.data_ptr() in addresses
    peer, peer_out = (None, None) if shape.paged else h.first_working_peer(args, call_peer(x))
    group = shape.heads // shape.kv_heads

    def kv_of(b, hh):
        k, v = dense_rows(x, b, shape.seqlen)
        return k[:, hh // group], v[:, hh // group]

    pairs = sorted({(0, 0), (shape.batch - 1, shape.heads - 1)})
    return h.check_attention(out, lse, x["q"], kv_of, False, args.dtype, pairs, peer, peer_out,
                             poisoned)


def measure(shape: DecodeShape, args, page_size: int) -> dict:
    sets = make_sets(shape, args, page_size)
    row = shape.fields() | {"page_size": page_size if shape.paged else None,
                            "check": check(shape, sets, args)}
    systems = [h.System("ours", [call_ours(x) for x in sets])]
    if args.fp8:
        systems.append(h.System("ours-fp8", [call_ours_fp8(fp8_copy(x)) for x in sets]))
    if shape.paged:
        systems += [h.System(p, [], error=PAGED_PEERS) for p in args.peer_list]
    else:
        systems += h.peer_systems(args, lambda name: [call_peer(x) for x in sets])
    nbytes = h.kv_bytes(shape.batch, shape.seqlen, shape.kv_heads, shape.hdim,
                        h.torch_dtype(args.dtype).itemsize)
    row = h.time_row(row, systems, args, args.target_s, nbytes=nbytes)
    if args.fp8:
        ours, fp8 = row["results"].get("ours"), row["results"].get("ours-fp8")
        row["fp8_speedup"] = {m: (h.rate(fp8, m, "tbps") / h.rate(ours, m, "tbps")
                                  if h.rate(fp8, m, "tbps") and h.rate(ours, m, "tbps") else None)
                              for m in h.METHODS}
    return row


def copy_bandwidth(args) -> dict:
    """The device's copy rate: read + write bytes of a --copy-mib torch copy over its time
    (the faster of the eager and the graph-replayed time)."""
    import torch
    n = args.copy_mib * h.MIB
    src = torch.empty(n, dtype=torch.uint8, device=args.device).fill_(1)
    dst = torch.empty_like(src)
    row = {"bytes": 2 * n}
    h.time_row(row, [h.System("copy", [lambda: dst.copy_(src)])], args, args.target_s,
               nbytes=2 * n, with_peers=False)
    result = row["results"]["copy"]
    # The faster of the two: captured in a graph, the copy becomes a memcpy node that the copy
    # engines serve (H200, 2026-12-02: 2.71 TB/s replayed against 4.23 eager, where an SM
    # kernel does it), so the graph time is not the card's copy rate.
    timed = [m for m in ("eager", "kernel") if result[m]]
    method = max(timed, key=lambda m: result[m]["tbps"]) if timed else None
    row["tbps"] = result[method]["tbps"] if method else None
    row["method"] = method
    return row


def main() -> int:
    p = h.parser(__doc__)
    p.add_argument("--page-size", type=int, help=f"rows per page of the paged cache "
                   f"(default {DEFAULT_PAGE_SIZE}; {CPU_PAGE_SIZE} on the CPU)")
    p.add_argument("--copy-mib", type=int, default=1024,
                   help="MiB copied for the device copy bandwidth")
    p.add_argument("--dense-only", action="store_true", help="no paged rows")
    p.add_argument("--fp8", action="store_true",
                   help="also ours over fp8 e4m3 copies of the caches (ours-fp8)")
    args = h.finish_args(p.parse_args())
    cpu = args.device == "cpu"
    if cpu:
        args.copy_mib = min(args.copy_mib, 64)
        shapes = CPU_QUICK_SHAPES if args.quick else CPU_SHAPES
        heads, kv_heads, hdim = CPU_HEADS, CPU_KV_HEADS, CPU_HDIM
    else:
        shapes = QUICK_SHAPES if args.quick else SHAPES
        heads, kv_heads, hdim = HEADS, KV_HEADS, HDIM
    page_size = args.page_size or (CPU_PAGE_SIZE if cpu else DEFAULT_PAGE_SIZE)
    meta = h.run_metadata("flashattn decode (flash_attn_with_kvcache)", args)
    rows = []
    with h.on_side_stream(args.device):
        copy = copy_bandwidth(args)
        meta["copy_bandwidth"] = copy
        for batch, seqlen in shapes:
            for paged in (False,) if args.dense_only else (False, True):
                shape = DecodeShape(batch, seqlen, heads, kv_heads, hdim, paged)
                rows.append(h.measure_safely(measure, shape.fields(), args, shape, args,
                                             page_size))
                ours = rows[-1]["results"]["ours"]
                for method in h.METHODS:
                    tbps = h.rate(ours, method, "tbps")
                    ours[f"{method}_share_of_copy"] = \
                        tbps / copy["tbps"] if tbps and copy["tbps"] else None
                h.progress(rows[-1], "tbps")
    panels = {"TB/s of K+V read": [
        (f"{name} {method}", [r["label"] for r in rows],
         [h.rate(r["results"].get(name), method, "tbps") for r in rows])
        for name in (rows[0]["results"] if rows else []) for method in h.METHODS]}
    if args.fp8:
        for r in rows:
            speed = r.get("fp8_speedup") or {}
            print(f"{r['label']}: fp8 caches {' / '.join(h.fmt(speed.get(m), 2) for m in h.METHODS)}x "
                  f"the tokens/s of 16-bit caches ({' / '.join(h.METHODS)})")
    print(f"device copy bandwidth: {h.fmt(copy['tbps'], 2)} TB/s ({copy['method']} time of "
          f"a {args.copy_mib} MiB copy, read + write); ours's share of it per row in the JSON "
          "(eager_share_of_copy, kernel_share_of_copy)\n")
    return h.finish(args, "decode", meta, rows, "tbps", "TB/s", lambda r: r["label"], panels,
                    xlabel="batch x cache length")


if __name__ == "__main__":
    raise SystemExit(main())
