"""A GPT built on flashattn.modules.MHA: pre-norm blocks (RMSNorm), SwiGLU MLPs, rotary
embeddings, GQA, a byte-level vocabulary. `attention=` swaps flashattn for PyTorch's
scaled_dot_product_attention (cuDNN, FlashAttention-2 or math backend) with the same weights,
so that a comparison changes one variable.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from flashattn.modules import MHA, InferenceParams

ATTENTIONS = ("flashattn", "sdpa-cudnn", "sdpa-flash", "sdpa-math")


@dataclasses.dataclass
class Config:
    layers: int = 4
    dim: int = 128
    heads: int = 4
    kv_heads: int = 2
    mlp_hidden: int = 352  # SwiGLU's hidden width (about 8/3 dim, a multiple of 32)
    vocab: int = 256       # bytes
    max_seqlen: int = 256
    rotary_fraction: float = 1.0  # of the head dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def parameters(self) -> int:
        """Weights, embeddings included (the lm head is tied to them)."""
        attn = self.dim * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.dim
        return self.vocab * self.dim + self.layers * (attn + 3 * self.dim * self.mlp_hidden + 2 * self.dim) + self.dim

    def flops_per_token(self, seqlen: int) -> float:
        """Training FLOPs per token: 6 per weight (forward and backward of the matrix
        products) plus causal attention's 6 L S d (QK^T and PV, half the square)."""
        return 6 * self.parameters() + 6 * self.layers * seqlen * self.dim


# Named sizes: a test-sized one, and the two of the end-to-end benchmark.
SIZES = {
    "tiny": Config(layers=2, dim=64, heads=4, kv_heads=2, mlp_hidden=160, max_seqlen=128),
    "small": Config(),
    "125m": Config(layers=12, dim=768, heads=12, kv_heads=4, mlp_hidden=2048, max_seqlen=8192),
    "1.3b": Config(layers=24, dim=2048, heads=16, kv_heads=4, mlp_hidden=5632, max_seqlen=8192),
}


def sdpa_backend(attention: str):
    """The context that pins SDPA to one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
               "sdpa-math": SDPBackend.MATH}[attention]
    return sdpa_kernel(backend)


class SdpaMHA(MHA):
    """MHA with SDPA doing the attention (causal, no other masks): the same parameters, the
    same rotary; a cache of its own for generation (appended, then attended to through SDPA)."""

    def __init__(self, *args, attention: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.attention = attention

    def _attend(self, q, k, v, causal):
        with sdpa_backend(self.attention):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=self.num_heads != self.num_heads_kv)
        return self.out_proj(out.transpose(1, 2).flatten(-2))

    def forward(self, x, inference_params: InferenceParams | None = None, **unused):
        q, k, v = self._split(self.Wqkv(x))
        offset = inference_params.seqlen_offset if inference_params is not None else 0
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, k, seqlen_offset=offset)
        if inference_params is None:
            return self._attend(q, k, v, causal=True)
        k_cache, v_cache = self._cache(inference_params, x)
        b, s = x.shape[:2]
        k_cache[:b, offset:offset + s] = k
        v_cache[:b, offset:offset + s] = v
        # A prefill is square (the causal mask as SDPA aligns it); a step sees every position.
        return self._attend(q, k_cache[:b, :offset + s], v_cache[:b, :offset + s], causal=offset == 0)


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: Config, layer_idx: int, attention: str):
        super().__init__()
        rotary = int(cfg.head_dim * cfg.rotary_fraction) // 2 * 2
        kwargs = dict(num_heads=cfg.heads, num_heads_kv=cfg.kv_heads, qkv_proj_bias=False, out_proj_bias=False,
                      causal=True, rotary_emb_dim=rotary, layer_idx=layer_idx)
        self.attn = (MHA(cfg.dim, **kwargs) if attention == "flashattn"
                     else SdpaMHA(cfg.dim, attention=attention, **kwargs))
        self.norm1, self.norm2 = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp_hidden)

    def forward(self, x, inference_params=None):
        x = x + self.attn(self.norm1(x), inference_params=inference_params)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, attention: str = "flashattn"):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {', '.join(ATTENTIONS)}, given {attention!r}")
        self.cfg, self.attention = cfg, attention
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i, attention) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens, inference_params=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, inference_params)
        return F.linear(self.norm(x), self.embed.weight)  # the lm head tied to the embedding

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 generator: torch.Generator | None = None, cuda_graph: bool = False) -> torch.Tensor:
        """prompt (B, S) bytes -> (B, S + new_tokens): one prefill, then one token a step
        through the layers' caches. cuda_graph=True replays each step from one CUDA graph
        (flashattn only: the step reads its cache lengths from a device tensor)."""
        if cuda_graph:
            return self._generate_graphed(prompt, new_tokens, temperature, top_k, generator)
        b, s = prompt.shape
        params = InferenceParams(max_seqlen=s + new_tokens, max_batch_size=b)
        logits = self(prompt, params)[:, -1]
        params.seqlen_offset = s
        tokens = [prompt]
        for t in range(new_tokens):
            tokens.append(sample(logits, temperature, top_k, generator))
            if t + 1 < new_tokens:
                logits = self(tokens[-1], params)[:, -1]
                params.seqlen_offset += 1
        return torch.cat(tokens, dim=1)

    def _generate_graphed(self, prompt, new_tokens, temperature, top_k, generator):
        if self.attention != "flashattn" or prompt.device.type != "cuda":
            raise ValueError(f"cuda_graph: expected attention 'flashattn' on a CUDA device, given "
                             f"{self.attention!r} on {prompt.device} (SDPA's cache here is sliced to "
                             f"its length, which changes every step)")
        b, s = prompt.shape
        # The cache lengths live in a device tensor that the captured step advances itself, so
        # one graph serves every step; the prefill runs eagerly with lengths 0.
        lengths = torch.zeros(b, dtype=torch.int32, device=prompt.device)
        params = InferenceParams(max_seqlen=s + new_tokens, max_batch_size=b, lengths_per_sample=lengths)
        logits = self(prompt, params)[:, -1]
        lengths.fill_(s)
        token = sample(logits, temperature, top_k, generator)
        tokens = [prompt, token]
        if new_tokens == 1:
            return torch.cat(tokens, dim=1)
        step_input = token.clone()

        def step():
            out = self(step_input, params)[:, -1]
            lengths.add_(1)
            return out

        # autocast's cache of cast weights would be freed under a captured graph: capture
        # without it, in the caller's autocast dtype.
        cast = (torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
                if torch.is_autocast_enabled("cuda") else nullcontext())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), cast:
            for _ in range(2):  # warm-up before capture; it writes rows the real steps overwrite
                step()
        torch.cuda.current_stream().wait_stream(side)
        lengths.fill_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), cast:
            step_logits = step()
        lengths.fill_(s)  # capture does not run the step
        for _ in range(new_tokens - 1):
            step_input.copy_(tokens[-1])
            graph.replay()
            tokens.append(sample(step_logits, temperature, top_k, generator))
        return torch.cat(tokens, dim=1)


def sample(logits, temperature, top_k, generator):
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def autocast(device: str, dtype: torch.dtype):
    """bf16/fp16 mixed precision (fp32 weights and optimizer); nothing for fp32."""
    return torch.autocast(device_type=device, dtype=dtype) if dtype != torch.float32 else nullcontext()
