"""maskprior: attention with a learnable mask prior, the models built on it, and the mask patterns.

Reference implementation of "Mask-Based Priors Are More Persistent than Query-Key Initializations";
read top to bottom beside the paper:
  1. MaskedSelfAttention, softmax(Q K^T / sqrt(d) + log sigmoid(M)) V (Section 4.1), with fixed
     (Appendix A.2), Hadamard (Appendix B) and vanilla modes; M dense (heads, N, N), or relative,
     one logit per head and distance, which runs at any length.
  2. Models, one mask per layer (Principle 4): the GOTU encoder (Section 5.1, also the arithmetic
     model), the GPT (Appendix "Wiki-text and Tiny-stories"), the ViT (Section 5.3).
  3. Mask patterns (Section 4.2, Appendix "Design of Mask Pattern"): boolean_mask, the arithmetic
     masks, the GPT's relative distance (distance_mask: dense or relative), the ViT's impulse;
     edit_pattern, a seeded edit of a pattern (Appendix A.2); learned_mask, a prior learned from a
     trained model.
  4. QK baselines, the same patterns in W_Q / W_K (Sections 2.1, 5.1): structured SVD and Opt
     (Zheng et al.), mimetic (Trockman and Kolter).
  5. Measuring the prior (Section 6.1): attention maps, prior mass, drift: the persistence numbers.
  6. Appendix: add_mask_prior puts the prior into an existing model (torchvision's, timm's and
     transformers' attention); param_groups keeps M out of weight decay.
Beside Python's standard library this file imports torch only (timm and transformers never: a
model that holds their layers has imported them); MaskedSelfAttention needs nothing else from it
and pastes alone.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The paper's constants, each once; elsewhere they are named, not restated. Appendix "Experiment
# Details": "For mask initialization, we choose open positions = 10 and close positions = -10" (the
# Boolean tasks and the ViT): an open entry adds log sigmoid(10) = -4.5e-5 to its logit, a closed one
# log sigmoid(-10) = -10.00005. For any A, log sigmoid(A) - log sigmoid(-A) = A: an open key outweighs
# a closed one of equal content score by e^A (e^10 = 22026; arithmetic's e^5 = 148).
OPEN, CLOSE = 10.0, -10.0
ARITHMETIC_OPEN, ARITHMETIC_CLOSE = 5.0, -5.0    # Table "Arithmetic task setup": open 5, close -5
GPT_MASK_SCALE = 10.0   # Appendix "Wiki-text and Tiny-stories": the GPT prior is log sigmoid(10 M)
NORM_P = 18.0           # structured init's factor on the positions before its solve (norm_p,
                        # osiriszjq/structured_initialization; meant for positions drawn at 0.02)

# === 1. The attention block (Section 4.1) =========================================================
class MaskedSelfAttention(nn.Module):
    """Multi-head self-attention with a learnable additive logit bias per head (Section 4.1; forward
    writes the equation above the lines that compute it). M (heads, seq_len, seq_len) is the
    parameter `mask`, starting at the task's pattern (open and closed at the constants above),
    scaled by s = mask_scale (1; GPT_MASK_SCALE for the GPT prior). A row whose entries share one M
    (e.g. the zero mask of Appendix A.1) is vanilla attention; in a mixed row the open keys outweigh
    the closed ones (by e^A, the constants say).
    mode: "learnable" (the paper: M trains with the model), "fixed" (Appendix A.2: M never moves),
    "hadamard" (Appendix B, Proposition 1: sigma(s M) o softmax(Q K^T / sqrt(d)); forward says what
    it loses), "none" (vanilla attention, no M). causal: the hard causal mask on top (the GPT).
    Inputs shorter than seq_len use the top-left (n, n) block of M, and a dense M refuses longer ones.
    A relative M: mask_init (heads, K + 1) if causal, else (heads, 2K + 1), one logit per head and
    distance d = i - j (query minus key position): 0..K back, or -K..K; a distance past K reads the
    table's last logit, so any length runs (dense_mask). T5's learned relative bias without its log
    buckets; fixed, ALiBi's kind of prior. seq_len is then the length mask_biases pictures. Needs only
    math, torch, nn and F: pastes alone."""
    MODES = ("learnable", "fixed", "hadamard", "none")
    # forward computes one function by two paths, written out or in one fused kernel; path "auto"
    # lets writes_out choose, "fused" or "written" forces one (e.g. a backend without the float
    # mask's gradient).
    path = "auto"
    sdpa_cpu_min_tokens = 128   # the CPU's fused kernel wins from this sequence length on

    def __init__(self, dim, heads, seq_len, head_dim=None, mask_init=None, mode="learnable",
                 causal=False, mask_scale=1.0, dropout=0.0, qkv_bias=False):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.heads, self.head_dim, self.seq_len = heads, head_dim or dim // heads, seq_len
        self.mode, self.causal, self.mask_scale, self.dropout = mode, causal, mask_scale, dropout
        inner = heads * self.head_dim
        # W_Q, W_K, W_V of Eq. (1), all heads at once; no bias by default, as in Eq. (1) and the
        # GOTU code (a bias would add content-independent logits beside the mask).
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        self.proj = nn.Linear(inner, dim)      # W_O: concatenated heads back to the model width
        if mode == "none":
            if mask_init is not None:
                raise ValueError("mode='none' is vanilla attention and takes no mask_init")
            self.register_parameter("mask", None)
            return
        expected = (heads, seq_len, seq_len)
        relative = mask_init is not None and mask_init.dim() == 2 and len(mask_init) == heads and (
            causal or mask_init.shape[1] % 2 == 1)     # (H, K + 1) causal, (H, 2K + 1): -K..K
        if mask_init is None:
            mask_init = torch.zeros(expected)  # the neutral all-zero mask of Appendix A.1
        elif tuple(mask_init.shape) != expected and not relative:
            raise ValueError(f"mask_init must have shape (heads, seq_len, seq_len) = {expected}, or be relative, "
                             f"({heads}, K + 1) causal, ({heads}, 2K + 1) not; got {tuple(mask_init.shape)}")
        # fixed: still the Parameter `mask` (checkpoints and pictures treat all modes alike), frozen
        self.mask = nn.Parameter(mask_init.detach().clone().float(), requires_grad=(mode != "fixed"))

    @staticmethod
    def logit_bias(mask, n, scale=1.0, causal=False, dtype=None, device=None):
        """The additive bias of Section 4.1 on the first n positions, computed only here:
            log sigmoid(scale * M[:, :n, :n])        (H, n, n), from M (H, N, N)
            + (-inf where key j lies after query i)   if causal: the hard causal mask
        mask None: the causal mask alone, (n, n) of 0 and -inf, or None (vanilla attention).
        Why log sigmoid (Section 6.1, Theorem 1): with m = scale * M, dp_i/dm_j = p_i (delta_ij - p_j)
        sigma(-m_j), at most p_i whatever the sizes of q and k (Corollary 1), while the gradients of q
        and k grow with ||k|| and ||q||. An open entry (m = OPEN) learns through a factor sigma(-OPEN) =
        4.5e-5, a closed one through its near-zero p_j: both start almost still, so the prior persists
        until the content scores give the loss a reason to move it. tests/test_theory.py checks
        Theorem 1, Corollary 1 and Proposition 1 by autograd: on bare tensors (its part 1), on this
        module's mask gradient (part 2) and on its probabilities, hadamard mode included (part 3).
        dtype: cast to it (q's dtype under autocast); device: the causal mask's (default M's)."""
        if mask is None and not causal:
            return None
        if mask is None:
            bias = torch.zeros(n, n, dtype=dtype, device=device)                    # (n, n)
        else:
            bias = F.logsigmoid(scale * mask[..., :n, :n]).to(dtype or mask.dtype)  # (H, n, n)
        if causal:
            future = torch.ones(n, n, dtype=torch.bool, device=bias.device).triu(1)   # (n, n), j > i
            bias = bias.masked_fill(future, float("-inf"))
        return bias

    def dense_mask(self, n):
        """M on the first n positions, (H, n, n), what logit_bias reads: a dense M as it is (logit_bias
        takes its top-left block), a relative one gathered at each entry's distance d = i - j, clamped
        to the table (past K: the last logit; a causal table's future entries read d = 0, then -inf)."""
        if self.mask is None or self.mask.dim() == 3:
            return self.mask
        K = self.mask.shape[1] - 1 if self.causal else self.mask.shape[1] // 2
        i = torch.arange(n, device=self.mask.device)
        d = (i[:, None] - i[None, :]).clamp(0 if self.causal else -K, K)                  # (n, n)
        return self.mask[:, d if self.causal else d + K]                                   # (H, n, n)

    def writes_out(self, q, bias, dropout, return_attn):
        """Whether forward computes the attention step by step (else F.scaled_dot_product_attention
        computes the same function in one fused kernel). The probabilities (return_attn, mode
        "hadamard") exist only written out; path "written" / "fused" forces a path. On CUDA the
        kernel always wins; on the CPU (tests/bench_attention_paths.py, torch 2.14) only from
        sdpa_cpu_min_tokens positions on, without dropout and without a gradient into the bias."""
        if return_attn or self.mode == "hadamard":
            return True
        if self.path != "auto":
            return self.path != "fused"
        if q.device.type != "cpu":
            return False
        return dropout != 0 or q.shape[-2] < self.sdpa_cpu_min_tokens or (bias is not None and bias.requires_grad)

    def forward(self, x, return_attn=False):
        B, N, _ = x.shape
        if N > self.seq_len and self.mask is not None and self.mask.dim() == 3:
            raise ValueError(f"sequence of length {N} is longer than seq_len={self.seq_len}")
        # Q, K, V of every head from one projection, (B, H, N, hd) each. unbind(2) + transpose
        # rather than permute: the backward then writes the three gradients straight into the
        # (B, N, 3, H, hd) layout of the qkv output, one copy instead of two.
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, N, 3, self.heads, self.head_dim).unbind(2))
        dropout = self.dropout if self.training else 0.0
        # log sigmoid(s M) + the causal -inf: (H, N, N), (N, N) without M, None for vanilla
        # attention. Mode "hadamard" applies M after the softmax instead: its bias is causal only.
        hadamard, dense = self.mode == "hadamard", self.dense_mask(N)           # M (H, N, N)
        bias = self.logit_bias(None if hadamard else dense, N, self.mask_scale, self.causal, q.dtype, q.device)
        # Section 4.1: "Since log sigma(M) <= 0, this selectively down-weights undesired interactions
        # while preserving the standard attention mechanism."
        #     A = softmax(Q K^T / sqrt(d) + log sigmoid(s M)),    y = A V
        if self.writes_out(q, bias, dropout, return_attn):
            logits = (q @ k.transpose(-2, -1)).div_(math.sqrt(self.head_dim))      # (B, H, N, N)
            if bias is not None:
                logits.add_(bias)          # div_ and add_ in place: nothing needs what they overwrite
            attn = logits.softmax(dim=-1)                                          # (B, H, N, N)
            # Appendix B: "A natural question is whether a Hadamard-product mask, sigma(M) o softmax(
            # X W_Q W_K^T X^T / sqrt(d)), could achieve a similar effect." Proposition 1 says what it
            # loses: ||softmax(A)||_F >= 1 (each row sums to 1), but sigma(M) o softmax(A) is only >= 0,
            # rows collapse where sigma(M) is small, and its Jacobian's norm is at most softmax's.
            if hadamard:
                attn = self.logit_bias(dense, N, self.mask_scale).exp() * attn
            if dropout:      # F.dropout with p = 0 would still cost a pass
                attn = F.dropout(attn, dropout)
            y = attn @ v                                                           # (B, H, N, hd)
        else:
            # The same in one kernel: SDPA adds attn_mask to the scaled logits (and
            # back-propagates into it). is_causal alone lets CUDA take its flash kernel; a 4-D
            # mask keeps the CPU on its fused kernel (a 3-D one goes to the slower math kernel).
            causal_only = self.causal and self.mask is None
            mask = None if causal_only or bias is None else bias.expand(1, -1, -1, -1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal_only)
            attn = None
        y = self.proj(y.transpose(1, 2).reshape(B, N, self.heads * self.head_dim))  # (B, N, dim)
        return (y, attn) if return_attn else y

def attention_modules(model):
    """Every MaskedSelfAttention inside model, in model.modules() order (first layer to last)."""
    return [m for m in model.modules() if isinstance(m, MaskedSelfAttention)]

# === 2. Models on the block: the GOTU encoder (Section 5.1), the GPT, the ViT (Section 5.3) =======
# Three models share one block and differ only in how tokens go in and how the answer comes out:
#   Transformer  aryol/GOTU's TokenTransformer (Section 5.1, Table "Training setup for Boolean tasks"):
#                a token per bit, CLS first, one scalar read from CLS. Section 5.2's arithmetic uses it
#                too, without CLS and read at every position (the paper wrote its arithmetic code "from
#                scratch" and did not publish it: Table "Arithmetic task setup" is all it says of it).
#   GPT          nanoGPT's GPT-2, causal, for Appendix "Wiki-text and Tiny-stories".
#   ViT          timm's VisionTransformer (vit_tiny_patch16_224) for Section 5.3.
# Every model takes its masks as one (depth, heads, N, N) stack, a mask_init per layer: Principle (4),
# layer-wise composition, lets the pattern change with depth (boolean_mask's composed patterns do).
class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(LN(x)), then x + MLP(LN(x)), as aryol/GOTU (its PreNorm, taken from
    lucidrains/vit-pytorch), nanoGPT and timm all lay it out. The MLP is Linear -> GELU -> Linear, as in
    those three (Tiny-Stories-GPT, the paper's language code, uses ReLU). Dropout sits where nanoGPT
    puts it: on the attention weights (inside MaskedSelfAttention), after the attention's output
    projection and after the MLP; only the GPT sets it (Table "NLP task setup").
    drop_path: None, or a module on each residual branch (the ViT's StochasticDepth, built by train.py:
    this file imports torch only)."""
    def __init__(self, dim, heads, seq_len, mlp_dim, head_dim=None, mask_init=None, mode="learnable",
                 causal=False, mask_scale=1.0, dropout=0.0, qkv_bias=False, drop_path=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = MaskedSelfAttention(dim, heads, seq_len, head_dim, mask_init, mode, causal, mask_scale,
                                        dropout, qkv_bias)
        self.ln2 = nn.LayerNorm(dim)
        # the position-wise GELU MLP, its layers named fc and out (the names its state_dict keys carry)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc", nn.Linear(dim, mlp_dim))
        self.mlp.add_module("gelu", nn.GELU())
        self.mlp.add_module("out", nn.Linear(mlp_dim, dim))
        self.mlp.add_module("dropout", nn.Dropout(dropout))
        self.resid_dropout = nn.Dropout(dropout)
        self.drop_path = drop_path if drop_path is not None else nn.Identity()

    def forward(self, x, return_attn=False):
        """x (B, N, dim) -> (x, the block's attention (B, H, N, N) with return_attn, else None)."""
        # Section 4.1's attention on the normalised stream, added back to the stream; then the
        # position-wise MLP the same way. drop_path (stochastic depth, the vision tables' setting)
        # drops a whole branch for each sample with its probability, during training only.
        h = self.attn(self.ln1(x), return_attn=return_attn)
        h, attn = h if return_attn else (h, None)
        x = x + self.drop_path(self.resid_dropout(h))
        x = x + self.drop_path(self.mlp(self.ln2(x)))
        return x, attn

class _Model(nn.Module):
    """What the three models below share: their blocks, run in order, and timm's no_weight_decay."""
    def no_weight_decay(self):
        """The parameters weight decay leaves alone, by name, as timm's no_weight_decay: the positions
        and CLS (where the model has one), starts of the input rather than weights
        (maskprior.param_groups reads it). timm's ViT lists the same two (pos_embed, cls_token);
        nanoGPT decays its positions (wpe is a 2-D weight) and Tiny-Stories-GPT's AdamW every
        parameter: the GPT follows timm here. aryol/GOTU's coupled Adam decay (param_groups'
        decay_all) decays every parameter but M, these included."""
        return {"pos", "cls"}

    def run_blocks(self, x, return_attn=False):
        """x through every block; and each layer's attention, [(B, H, N, N)] with return_attn."""
        attns = []
        for block in self.blocks:
            x, attn = block(x, return_attn)
            attns.append(attn)                                     # (B, H, N, N), or None
        return x, attns

class Transformer(_Model):
    """Encoder over discrete tokens: embedding, optional CLS, learned positions, pre-LN blocks.
    masks: None, or (depth, heads, seq_len, seq_len), one mask_init per layer (Principle 4); seq_len
    counts every position, CLS included. readout: "cls" returns head(LN(x[:, 0])) (B, out_dim), as
    the GOTU code reads the CLS token; "tokens" returns head(LN(x)), (B, N, out_dim).
    The two token layouts, the positions the masks of section 3 index:
      Boolean (Section 5.1)     vocab 2 (bit -1 -> id 0, +1 -> id 1), N = 16: CLS at 0, bit x_i at 1 + i;
                                out_dim 1, the value f(x) itself, trained by MSE as in the GOTU code.
      arithmetic (Section 5.2)  vocab 11 (ten digits and a placeholder), N = 6 + K, no CLS; out_dim 10,
                                digit logits at every position, of which the K answer slots are scored.
    Embedding and linear layers keep torch's default starts (nn.Embedding N(0, 1), nn.Linear uniform on
    +-1 / sqrt(fan_in)), as in the GOTU code, which calls no init of its own."""
    def __init__(self, vocab_size, seq_len, dim, depth, heads, mlp_dim, out_dim, head_dim=None, masks=None,
                 mode="none", cls_token=True, readout="cls", dropout=0.0, pos_std=0.02, cls_std=0.0):
        super().__init__()
        if masks is not None and tuple(masks.shape[:2]) != (depth, heads):
            raise ValueError(f"masks must have shape (depth, heads, seq_len, seq_len) = "
                             f"{(depth, heads, seq_len, seq_len)}, got {tuple(masks.shape)}")
        if readout == "cls" and not cls_token:
            raise ValueError("readout='cls' needs cls_token=True")
        self.readout = readout
        self.embed = nn.Embedding(vocab_size, dim)
        # Positions N(0, pos_std^2), CLS N(0, cls_std^2): 0.02 and 0 by default (nanoGPT, timm);
        # aryol/GOTU (the paper's Boolean code) and `--preset paper` use N(0, 1), so attention
        # routes by position from the first steps. Drawn in the GOTU model's order (embedding,
        # positions, CLS, blocks): with cls_std = pos_std = 1 a seed gives its TokenTransformer's.
        self.pos = nn.Parameter(pos_std * torch.randn(1, seq_len, dim))
        self.cls = None
        if cls_token:
            self.cls = nn.Parameter(cls_std * torch.randn(1, 1, dim) if cls_std else torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList(
            Block(dim, heads, seq_len, mlp_dim, head_dim, None if masks is None else masks[layer], mode,
                  dropout=dropout) for layer in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, out_dim)

    def forward(self, tokens, return_attn=False):
        x = self.embed(tokens)                                     # (B, n, dim)
        # CLS goes first, so row and column 0 of every mask are CLS's (boolean_mask's layout)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)  # (B, N = n + 1, dim)
        x = x + self.pos[:, :x.shape[1]]
        x, attns = self.run_blocks(x, return_attn)
        # The GOTU code's mlp_head, LayerNorm then Linear: on CLS's final state (B, dim) for the Boolean
        # regression, on every position (B, N, dim) for the arithmetic digits.
        x = self.norm(x)
        out = self.head(x[:, 0] if self.readout == "cls" else x)
        return (out, attns) if return_attn else out

def _init_weights(model, truncated):
    """The GPT-2 / timm init: nn.Linear and nn.Embedding weights at std 0.02, nn.Linear biases zero;
    normal (GPT-2, nanoGPT) or truncated (timm's ViT; its cut at +-2 lies 100 std out). The layers
    come in registration order (that of model.apply too), which fixes the order of the random draws."""
    draw = nn.init.trunc_normal_ if truncated else nn.init.normal_
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            draw(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

class GPT(_Model):
    """nanoGPT's GPT (Appendix "Wiki-text and Tiny-stories") on MaskedSelfAttention(causal=True).
    mode "none" is the default GPT; "learnable" with masks (depth, heads, block_size, block_size)
    of relative_distance_mask per layer is the paper's mask init, its bias log sigmoid(mask_scale M).
    Table "NLP task setup" gives the shape (train.py's LM_PRESETS["paper"]); it has no positional
    row: the learned positions are Tiny-Stories-GPT's nn.Embedding(block_size, n_embd). The paper's
    code, PraveenRaja42/Tiny-Stories-GPT, has the table's shape (its 12 heads of 512 // 12 = 42
    channels make 504, as here), pre-LN blocks and N(0, 0.02) starts; this model adds what nanoGPT
    (GPT-2) has and that code lacks: GELU for its ReLU, an output layer without bias tied to the token
    embedding, dropout on the embeddings, residual projections started smaller."""
    def __init__(self, vocab_size, block_size, dim, depth, heads, dropout=0.0, mode="none", masks=None,
                 mask_scale=GPT_MASK_SCALE, positions=True):
        super().__init__()
        self.block_size = block_size
        self.embed = nn.Embedding(vocab_size, dim)
        # positions=False: no learned positions, as ALiBi trains; a relative M is then the only position
        # signal and the model runs past block_size (a dense M stops there, vanilla attention does not)
        self.pos = nn.Parameter(torch.zeros(1, block_size, dim)) if positions else None
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(dim, heads, block_size, 4 * dim, mask_init=None if masks is None else masks[layer], mode=mode,
                  causal=True, mask_scale=mask_scale, dropout=dropout) for layer in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # weight tying, as in GPT-2 and nanoGPT
        _init_weights(self, truncated=False)
        # GPT-2's scaled init (nanoGPT's c_proj): the residual stream sums 2 * depth branch outputs, an
        # attention and an MLP per layer, so the last projection of each branch starts at std
        # 0.02 / sqrt(2 * depth) and the stream's variance at the top does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth))
        if positions:
            nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx, targets=None, return_attn=False):
        """idx (B, T) token ids -> logits (B, T, vocab); with targets (logits, mean cross-entropy);
        with return_attn that and each layer's attention, [(B, H, T, T)] (mean_attention)."""
        T = idx.shape[1]
        if T > self.block_size and self.pos is not None:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.block_size}")
        x = self.drop(self.embed(idx) if self.pos is None else self.embed(idx) + self.pos[:, :T])
        x, attns = self.run_blocks(x, return_attn)
        out = self.head(self.norm(x))                                      # logits (B, T, vocab)
        # nanoGPT's loss: mean cross-entropy over all B * T next-token predictions, in float32 (the
        # logits are bf16 under CUDA autocast); exp of it over a whole split is the perplexity of
        # Table "Perplexity (PPL) comparison".
        if targets is not None:
            out = (out, F.cross_entropy(out.flatten(0, 1).float(), targets.flatten()))
        return (out, attns) if return_attn else out

    @torch.no_grad()
    def generate(self, idx, new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample new_tokens continuations of idx (B, T), feeding back the last block_size tokens."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1] / temperature  # (B, vocab), the last position
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], 1)
        return idx

class ViT(_Model):
    """A ViT as timm's vit_tiny_patch16_224 (width 192, depth 12, 3 heads, MLP 768, patch 16 on
    224 x 224; Table "Experimental setup for CIFAR10"), qkv_bias=True as in timm. masks: None or
    (depth, heads, N, N), one mask_init per layer (impulse_mask for the paper's prior). pool: "cls"
    reads CLS (timm's default, used for CIFAR), "avg" averages the patch tokens ("Global pool avg"
    in Table "Experimental setup for ImageNet100"). drop_paths: None, or one module per block, e.g.
    torchvision.ops.StochasticDepth at the rates train.py's vision_setup spreads as timm does.
    Tokens: CLS at 0, then patch (r, c) of the grid x grid patches at 1 + r * grid + c (row-major), so
    N = 14 * 14 + 1 = 197 at 224 / 16; impulse_mask and centre_patch_maps index this layout.
    Starts as timm's: trunc_normal(0.02) for linear weights and positions, zero biases, the patch
    convolution at torch's default. Where timm differs: its CLS starts at N(0, 1e-6), here at 0; with
    "avg" it averages the tokens and then applies a LayerNorm (its fc_norm), here the final LayerNorm
    acts on every token before the average."""
    def __init__(self, image_size, patch_size, num_classes, dim, depth, heads, mlp_dim, masks=None, mode="none",
                 pool="cls", drop_paths=None, channels=3):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be 'cls' or 'avg', got {pool!r}")
        self.grid, self.pool = image_size // patch_size, pool
        seq_len = self.grid ** 2 + 1
        # Patch embedding: a stride-p convolution = a linear map of each p x p x C patch.
        self.patch_embed = nn.Conv2d(channels, dim, patch_size, stride=patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.empty(1, seq_len, dim))
        self.blocks = nn.ModuleList(
            Block(dim, heads, seq_len, mlp_dim, mask_init=None if masks is None else masks[layer], mode=mode,
                  qkv_bias=True, drop_path=None if drop_paths is None else drop_paths[layer])
            for layer in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        _init_weights(self, truncated=True)                       # timm's ViT init
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, images, return_attn=False):
        """images (B, C, H, W) -> class logits (B, num_classes) [, each layer's (B, H, N, N)]."""
        # Patches as tokens: the stride-p convolution gives (B, dim, grid, grid), and flatten(2) runs
        # over it row by row, so patch (r, c) becomes token r * grid + c (1 + that once CLS is in front).
        x = self.patch_embed(images).flatten(2).transpose(1, 2)    # (B, grid^2, dim), row-major
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos     # (B, N, dim)
        x, attns = self.run_blocks(x, return_attn)
        # the readout `pool` names (the docstring): CLS's final state, or the patch tokens' mean
        x = self.norm(x)
        out = self.head(x[:, 0] if self.pool == "cls" else x[:, 1:].mean(1))   # (B, dim) -> (B, classes)
        return (out, attns) if return_attn else out

# === 3. Mask patterns (Section 4.2; Appendix "Design of Mask Pattern") ===========================
# A pattern is (depth, heads, N, N) logits M: OPEN where a query (row) may attend to a key (column),
# CLOSE elsewhere (Figure "Visualization of task-specific mask design"). Every hand-made pattern of
# the Boolean and arithmetic tasks opens the diagonal, so no row is all closed: a row whose entries
# share one M is plain content attention (MaskedSelfAttention's docstring), not "attend to nothing".
# Each pattern's comment names the principles (Section 4.2) it serves, and marks "ours" what the
# paper's figure and Appendix "Design of Mask Pattern" leave open.
BUILD_LAYERS = 2   # a composed pattern (Principle 4): these first layers build, the rest read out

def _mask(depth, heads, n, head_pairs, readout_pairs=None, open_value=OPEN, close_value=CLOSE, diagonal=True):
    """(depth, heads, N, N) logits: open_value on the diagonal (unless diagonal=False) and at the
    (query, key) pairs head_pairs[h % len(head_pairs)] of head h (a list of one: every head alike),
    close_value elsewhere. With readout_pairs, layers BUILD_LAYERS.. open readout_pairs in every head
    instead (fewer layers get the build layers only)."""
    m = torch.full((depth, heads, n, n), close_value)
    if diagonal:
        m.diagonal(dim1=-2, dim2=-1).fill_(open_value)
    for layer in range(depth):
        for h in range(heads):
            pairs = head_pairs[h % len(head_pairs)]
            if readout_pairs is not None and layer >= BUILD_LAYERS:
                pairs = readout_pairs
            m[layer, h, [query for query, _ in pairs], [key for _, key in pairs]] = open_value
    return m

# --- The Boolean GOTU tasks (Section 5.1). Position 0 is the CLS token the readout uses, position
# 1 + i holds bit x_i, so d = 15 bits give N = 16.
BOOLEAN_MASKS = ("2parity", "majority", "cyclic3", "threesym")      # the tasks boolean_mask knows
# Named alternatives to a task's pattern, its default first (a command line names one)
BOOLEAN_MASK_VARIANTS = {"2parity": ("direct", "composed"), "cyclic3": ("composed", "direct")}

def boolean_mask(task, depth, heads, variant=None, d=15):
    """The (depth, heads, N, N) mask logits of a Boolean task, N = d + 1: its pattern, or the named
    variant of BOOLEAN_MASK_VARIANTS[task] (KeyError naming the choices if there is none)."""
    if task not in BOOLEAN_MASKS:
        raise KeyError(f"no mask pattern for task {task!r}; tasks: {', '.join(BOOLEAN_MASKS)}")
    variants = BOOLEAN_MASK_VARIANTS.get(task, ())
    if variant is not None and variant not in variants:
        raise KeyError(f"task {task!r} has no mask variant {variant!r}; choices: {sorted(variants)}")
    n = d + 1
    x = [1 + i for i in range(d)]                  # x[i]: the sequence position of bit x_i
    x0_x1 = [(x[0], x[1]), (x[1], x[0])]
    if task == "2parity" and variant != "composed":
        # 2parity, f = x0 x1. "Following Principle (1) and Principle (2), we allow attention only
        # between x0 and x1, while suppressing all other interactions": every other token sees only
        # itself. x0 x1 appears naturally in a bilinear logit q(x0) . k(x1); a CLS reading x0 and x1
        # would mix them linearly (the minimum-degree shortcut), so CLS starts closed and learns
        # where to read (CLS closed: ours, the paper's pattern names x0 and x1 alone).
        return _mask(depth, heads, n, [x0_x1])
    if task == "2parity":
        # 2parity composed (Principle 4; ours: the paper has the pattern above alone). Layers 0-1
        # (build): the pattern above, so the product x0 x1 can form in q(x0) . k(x1) before anything
        # reads the bits. Layers 2.. (readout): bits see only themselves, CLS reads x0 and x1, where
        # the product now lives: CLS opens through M, not through W_Q W_K, whose linear read of the
        # raw bits is the shortcut x0 + x1 - 1.
        return _mask(depth, heads, n, [x0_x1], readout_pairs=[(0, x[0]), (0, x[1])])
    if task == "majority":
        # 3-bit majority, f = sign(x0 + x1 + x2), a global sum and a sign, where the MDI uses the
        # pairwise products x0 x2 and x1 x2. Principle (2), "we suppress off-diagonal interactions to
        # avoid MDI-style shortcuts": each bit sees only itself, so no pairwise product forms in
        # attention; CLS reads x0, x1, x2: exactly the three votes.
        return _mask(depth, heads, n, [[(0, x[0]), (0, x[1]), (0, x[2])]])
    if task == "cyclic3" and variant != "direct":
        # cyclic3, f = sum_i x_i x_{i+1} x_{i+2} (indices mod d). Principle (4) layer-wise
        # composition: the triples are built "through layer-wise composition of structured local
        # connections, rather than encoding them directly". The paper gives no windows; these are ours.
        # Layer 0 (pairs): bit token i sees {x_i, x_{i+1 mod d}}; its MLP can form x_i x_{i+1}.
        # Layer 1 (pairs of pairs): the same +1 window; token i reads its pair and token i+1's, whose
        #   union is the triple (x_i, x_{i+1}, x_{i+2}) (a window {i, i+1, i+2} would compose 4
        #   bits); with d = 15 the 15 tokens then hold the 15 cyclic triples of f, each once.
        # Layers 2.. (readout): bits see only themselves, CLS sees every position and sums them.
        # In layers 0-1 CLS sees only itself: reading raw bits early it could fit the minimum-degree
        # shortcut (Principle 2). The paper's Boolean models have 4 layers.
        pairs = [(x[i], x[(i + 1) % d]) for i in range(d)]
        return _mask(depth, heads, n, [pairs], readout_pairs=[(0, key) for key in range(n)])
    if task == "cyclic3":
        # cyclic3 direct: in every layer bit token i sees itself and its two cyclic successors, so
        # one layer spans the whole triple; CLS sees only itself at the start and learns to read
        # the sum. Not composition, so not what Principle (4) describes: ours, kept for comparison.
        pairs = [(x[i], x[(i + step) % d]) for i in range(d) for step in (1, 2)]
        return _mask(depth, heads, n, [pairs])
    # threesym, f = x0 x1 - 1.25 x1 x2 + 1.5 x2 x0. Principles (2) and (3) multi-head
    # specialisation: "we assign each attention head a 2Parity-style mask corresponding to one pairwise
    # interaction". Head h gets the pattern for one pair, (x0, x1), (x1, x2), (x2, x0) in turn (cycling
    # past three heads); head concatenation then adds the three products. Every other token, CLS
    # included, sees only itself (CLS closed: ours).
    head_pairs = [[(x[a], x[b]), (x[b], x[a])] for a, b in ((0, 1), (1, 2), (2, 0))]
    return _mask(depth, heads, n, head_pairs)

# --- Three-digit arithmetic (Section 5.2; Appendix "Design of Mask Pattern") ---
# Token layout (tasks.py, section 2), least significant digit first, no CLS: digit a_i of the
# first operand at position i, b_i at 3 + i, answer digit c_k at 6 + k. Open / closed at
# ARITHMETIC_OPEN / ARITHMETIC_CLOSE. Each token sees itself and each operand digit its partner
# (Principle 1); head h takes role h mod 4 of the algorithm (Principle 3), and depth composes them
# (Principle 4: carries). The paper's addition has "different heads [that] capture complementary
# aspects of the computation, such as digit-wise addition and carry interactions": roles 0 and 1.
# Roles 2 and 3 are ours.
def _arithmetic_mask(depth, heads, shared, columns, role_3):
    """(depth, heads, N, N) logits, N = 6 + K for the K = len(columns) answer slots: every head
    opens the diagonal and the operand pairs `shared`; answer slot c_k of a head of role r = h mod 4
    reads a_i and b_j of each digit pair (i, j) and the answer slots c_m of its role:
      role 0  the pairs columns[k] that land on k (a digit-wise sum, the partial products of k);
      role 1  the pairs columns[k - 1] and c_{k-1}: the carry into k (Principle 3);
      role 2  every pair of a column below k: a carry can ripple from the units (999 + 1) (ours);
      role 3  role_3[k]: (digit pairs, answer slots) (ours)."""
    roles = [list(shared) for _ in range(4)]                 # the open (query, key) pairs of each role
    for k, column in enumerate(columns):
        below = [pair for lower in columns[:k] for pair in lower]
        carry = (columns[k - 1], [k - 1]) if k > 0 else ([], [])
        for role, (pairs, answers) in enumerate([(column, []), carry, (below, []), role_3[k]]):
            keys = [i for i, _ in pairs] + [3 + j for _, j in pairs] + [6 + m for m in answers]
            roles[role] += [(6 + k, key) for key in keys]
    return _mask(depth, heads, 6 + len(columns), roles, open_value=ARITHMETIC_OPEN, close_value=ARITHMETIC_CLOSE)

def mask_addition(depth, heads):
    """Addition: c_k = (a_k + b_k + carry_k) mod 10, carry_k from column k - 1; K = 4 answer slots.
    Shared: a_i <-> b_i (the aligned column, Principle 1). Column k holds the pair (k, k) (none for
    the last slot, the final carry). Role 3 reads its column again, so two heads carry the
    digit-wise sum. Table 2's addition column, at its small train fraction, is where the roles are
    meant to pay."""
    aligned = [(i, 3 + i) for i in range(3)] + [(3 + i, i) for i in range(3)]
    columns = [[(0, 0)], [(1, 1)], [(2, 2)], []]           # the digit pair (i, j) of each c_k
    return _arithmetic_mask(depth, heads, aligned, columns, [(column, []) for column in columns])

def mask_multiplication(depth, heads):
    """Multiplication: c_k collects the partial products a_i b_j with i + j = k, plus carries;
    K = 6 answer slots. Shared: a_i <-> b_j for every i, j: each operand digit sees the digits it
    multiplies with (structured cross-number interactions). Role 1's carries and role 2's carries
    of carries come from the partial products; role 3 reads the answer slots below it,
    c_0 .. c_{k-1}: accumulating partial sums, which deeper layers compose (Principle 4)."""
    cross = [(i, 3 + j) for i in range(3) for j in range(3)]
    cross += [(b, a) for a, b in cross]
    columns = [[(i, k - i) for i in range(3) if 0 <= k - i < 3] for k in range(6)]   # i + j = k
    return _arithmetic_mask(depth, heads, cross, columns, [([], range(k)) for k in range(6)])

ARITHMETIC_MASKS = {"addition": mask_addition, "multiplication": mask_multiplication}

# --- The GPT's relative distance (Appendix "Wiki-text and Tiny-stories") ---
# Language has "no clear predefined structural pattern for initialization. Therefore, for these
# tasks, we initialize a full-rank learnable attention mask using causal relative distance":
# M_ij = -max(i - j, 0), applied as log sigmoid(s M), s = GPT_MASK_SCALE: the diagonal gets
# log sigmoid(0) = -0.69, one step back about -s, two steps back -2 s, ... (a "recent past" prior
# that training can flatten, Figure "Relative mask bias before and after training").
def relative_distance_mask(heads, block_size, relative=False):
    """M_ij = -max(i - j, 0) for every head: dense (heads, block_size, block_size), or relative
    (heads, block_size), one logit per distance 0..block_size - 1 back (distance_mask)."""
    return distance_mask(lambda d: -d.clamp(min=0), heads, block_size, relative=relative)

# --- A prior that is a function of distance, dense or relative (MaskedSelfAttention's relative M) ---
# The GPT's prior above depends on i - j alone, as a causal window does (OPEN on the last w
# distances, CLOSE past them: lambda d: torch.where(d < w, OPEN, CLOSE)). One function of d gives both
# forms: the dense M, stored and learned entry by entry and capped at n positions, or one logit per
# head and distance, T5's relative bias (heads x (K + 1) parameters, causal) and ALiBi's kind of prior
# when fixed, which runs at any length: past K it reads the last logit.
def distance_mask(prior, heads, n, causal=True, relative=False):
    """M from a function of the distance d = i - j (query minus key position), prior(d) a tensor of
    d's shape: dense (heads, n, n), M_ij = prior(i - j); relative, prior at d = 0..K (causal) or
    -K..K, K = n - 1: (heads, n) or (heads, 2n - 1), every distance of an n-token window."""
    i = torch.arange(n)
    d = torch.arange(0 if causal else 1 - n, n) if relative else i[:, None] - i[None, :]     # (R,) or (n, n)
    return prior(d).float().expand(heads, *d.shape).clone()

# --- The ViT's impulse (Section 5.3, Table "Best Top-1 accuracy") ---
# Section 5.3 follows Zheng et al. (2025): each head starts as one 3x3 convolution "impulse"
# filter, a patch attending to exactly one neighbour (Appendix "Visualization of Structure
# Initialization"). As impulse_init of osiriszjq/structured_initialization, head i gets offset
# k = IMPULSE_ORDER[i mod 9] of the 3x3 window, (row, col) = (k // 3 - 1, k % 3 - 1): identity, up,
# right, left, down, then the diagonals, in every layer. The impulse covers patches only; ours:
#   - CLS row (CLS as query): OPEN to every key, to gather the whole image as a global average pool
#     does (osiriszjq/structured_init runs its impulse init with class_token=False and --gp avg).
#   - CLS column (CLS as key): CLOSED, so patch-to-patch attention starts as the 3x3 filter alone.
#   - A patch whose neighbour lies off the grid gets an all-CLOSED row: plain content attention.
# The QK counterpart (structured_svd_init_) solves on the patch part [..., 1:, 1:] only, as the
# 2025 code on pos_embed[1:]; CLS belongs to the mask prior.
IMPULSE_ORDER = (4, 1, 5, 3, 7, 0, 2, 6, 8)

def impulse_mask(depth, heads, grid):
    """Impulse mask logits over CLS + grid x grid patches, (depth, heads, N, N), N = grid^2 + 1:
    query patch (r, c) of head h is OPEN to key patch (r + dr, c + dc) only, the CLS row to all.
    Patch (r, c) sits at position 1 + r * grid + c (row-major, after CLS)."""
    n = grid * grid + 1
    head_pairs = []                                                # head h: IMPULSE_ORDER[h mod 9]
    for k in IMPULSE_ORDER:
        dr, dc = k // 3 - 1, k % 3 - 1                             # the offset (row, col)
        # the patches (r, c) whose neighbour lies on the grid (off the grid: an empty row)
        cells = [(r, c) for r in range(grid) for c in range(grid) if 0 <= r + dr < grid and 0 <= c + dc < grid]
        head_pairs.append([(0, key) for key in range(n)]
                          + [(1 + r * grid + c, 1 + (r + dr) * grid + c + dc) for r, c in cells])
    return _mask(depth, heads, n, head_pairs, diagonal=False)

# --- Imperfect priors (Appendix A.2, "Why Not Just Fix the Mask?": a learnable mask can "refine or
# correct imperfect initial patterns"). A seeded edit of a task's exact pattern stands in for a
# rough or wrong guess of the interaction structure; the run then shows whether training M
# recovers the exact pattern (train.py's --mask-error, its true_prior_mass_* numbers).
EDIT_KINDS = ("extra", "missing", "moved")

def edit_pattern(pattern, kind, fraction, seed, cls_row=False):
    """A seeded edit of the mask logits pattern (..., N, N), open > 0, closed < 0: an edited entry
    is negated (open +A <-> closed -A). p = fraction, 0 < p <= 1; the diagonal is never edited.
    An edit of n entries touches k(n) = p n rounded half up of them, at least one when n > 0:
      extra    opens  k(#closed) closed off-diagonal entries      (a rough superset)
      missing  closes k(#open) open off-diagonal entries          (a rough subset)
      moved    closes min(k(#open), #closed) open off-diagonal entries and opens as many closed
               ones: a wrong prior with the right density
    cls_row (the Boolean encoders, CLS at position 0): the CLS query row and the other rows are
    edited as two parts, a moved entry staying in its part: CLS keeps how many keys it reads and is
    never opened where the exact pattern keeps it closed (Principle 2); `extra` treats it as any row.
    Every (layer, head) matrix and part takes the lowest-ranked entries of the set an edit acts on
    in ONE uniformly random ranking of the N x N positions, drawn from a generator seeded by seed:
    equal patterns get equal edits, and a larger fraction's edit contains a smaller one's."""
    if kind not in EDIT_KINDS or not 0 < fraction <= 1:
        raise ValueError(f"expected a kind in {EDIT_KINDS} and 0 < fraction <= 1, got {kind!r}, {fraction!r}")
    n = pattern.shape[-1]
    rank = torch.randperm(n * n, generator=torch.Generator().manual_seed(seed)).view(n, n)   # position -> rank

    def lowest(where, count):
        """The `count` entries of where (N, N, bool) of lowest rank."""
        ranks = torch.where(where, rank, n * n).flatten().sort().values   # where's ranks first
        return where & (rank < ranks[count])

    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    first_row = (torch.arange(n) == 0)[:, None] & cls_row            # (N, 1): CLS's row, with cls_row
    parts = [off_diagonal & first_row, off_diagonal & ~first_row]
    flat = pattern.reshape(-1, n, n)                                # (L * H, N, N)
    flip = torch.zeros(flat.shape, dtype=torch.bool)
    for matrix, flips in zip(flat, flip):
        for part in parts:
            opened, closed = part & (matrix > 0), part & (matrix < 0)
            counted = int((closed if kind == "extra" else opened).sum())
            k = min(counted, max(1, math.floor(fraction * counted + 0.5)))     # k(counted)
            if kind == "moved":
                k = min(k, int(closed.sum()))
            if kind != "extra":
                flips |= lowest(opened, k)                             # open -> closed
            if kind != "missing":
                flips |= lowest(closed, k)                             # closed -> open
    return torch.where(flip.view(pattern.shape), -pattern, pattern)

# --- Priors learned from a trained model. The hand-made patterns are "in effect an oracle
# assumption" (the paper's Limitations, which name "learning priors from data or pretrained models"
# as future work); learned_mask turns a trained model's attention maps into mask logits for M
# (train.py's --mask-from), as mimetic initialisation (Trockman and Kolter) copies such maps into W_Q / W_K.
def learned_mask(attn, magnitude, tau=1.0, causal=False):
    """Mask logits from mean attention maps p (..., N, N), e.g. mean_attention of a trained model,
    (L, H, N, N): query row i, key column j, each row summing to 1 over the keys it may see:
        M_ij = +A   if  i = j  or  p_ij >= tau / n_i        (open)
        M_ij = -A   otherwise                                (closed)
    n_i, the keys row i may see: N in an encoder, i + 1 in a causal model (key j <= i): tau = 1
    opens the keys that get at least a uniform row's share 1 / n_i. The diagonal is always open (as
    in every hand-made pattern); causal closes the future (j > i). A = magnitude: the hand-made
    values (OPEN, ARITHMETIC_OPEN); where the model applies log sigmoid(s M) (the GPT, s =
    GPT_MASK_SCALE), A = 1, so a closed entry gets the relative-distance prior's bias one step back.
    Returns float32 logits of attn's shape."""
    n = attn.shape[-1]
    i = torch.arange(n, device=attn.device)
    keys_seen = (i + 1 if causal else torch.full_like(i, n)).float()   # (N,) n_i
    is_open = (attn >= tau / keys_seen[:, None]) | (i[:, None] == i[None, :])   # (..., N, N), the diagonal
    if causal:
        is_open = is_open & (i[None, :] <= i[:, None])                  # the future: closed
    return torch.where(is_open, magnitude, -magnitude).float()

def open_fraction(pattern, causal=False):
    """The density of a pattern (..., N, N), open > 0: the fraction of its off-diagonal entries
    that are open, over every layer and head; causal: of the entries a query may see (key before
    query, j < i). 0 when there are none (N = 1)."""
    n = pattern.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=pattern.device)
    counted = torch.ones_like(eye).tril(-1) if causal else ~eye                    # (N, N)
    entries = pattern[..., counted]                                     # (..., #counted)
    return (entries > 0).float().mean().item() if entries.numel() else 0.0

# === 4. Query-key initialisation baselines (Sections 2.1 and 5.1; Zheng et al.'s public code) ====
# The paper's comparison: the SAME pattern in W_Q / W_K instead of in M. Each function takes a
# model of MaskedSelfAttention (mode="none") and (depth, heads, N, N) pattern logits (> 0 is open),
# writes each head's q and k rows in place and returns the model. Public code followed
# (github.com/<repo>, timm/models/vision_transformer.py):
#   osiriszjq/structured_initialization (Zheng et al. 2025, cited in Appendix "Experiment Details"):
#     impulse_init (SVD solve), get_ortho_like (mimetic factors), VisionTransformer.post_init_weights.
#   osiriszjq/structured_init (Zheng et al. 2024): its impulse_init fits Q, K by Adam, the only
#     public code of "Structured (Opt)". The paper's footnote for Opt (Appendix "Experiment
#     Details", Boolean problems) names osiriszjq/structured_initialization, which holds only the
#     SVD solve: structured_opt_init_ follows this repository instead.
# Both structured variants first multiply the learned positions by pos_scale (NORM_P, the norm_p of
# post_init_weights' impulse branch): at the usual 0.02 they would be invisible beside the tokens.
def pattern_targets(pattern):
    """Binary target (1 = open, 0 = closed) from mask logits, any shape."""
    return (pattern > 0).to(torch.float32)

def pseudo_input(model, skip=0):
    """The pseudo-input P of structured initialisation, as in both Zheng et al. codes: the positions
    from `skip` on under layer_norm without affine parameters, (N - skip, D)."""
    pos = model.pos.detach()[0, skip:]                             # (N - skip, D)
    return F.layer_norm(pos, pos.shape[-1:])

def _write_padded(rows, w):
    """rows, a view of a weight's rows, = w (a, b) in its top-left corner, zeros elsewhere, without
    autograd."""
    with torch.no_grad():
        rows.zero_()
        rows[:w.shape[0], :w.shape[1]] = w

def _write_qk(attn, h, w_q, w_k):
    """Write W_Q,h (r, D) and W_K,h (r, D) into head h so that q_h k_h^T = x w_q^T w_k x^T; rows
    beyond r (when the rank is below head_dim) are zeroed."""
    q_rows, k_rows, _ = attn.qkv.weight.view(3, attn.heads, attn.head_dim, -1)[:, h]   # q, k, v stacked
    _write_padded(q_rows, w_q)                                                        # (head_dim, D)
    _write_padded(k_rows, w_k)

def _factor(a, rank):
    """a (D, D) ~ L R with L = U sqrt(S) (D, rank) and R = sqrt(S) V^T (rank, D), by SVD
    (get_ortho_like of both Zheng et al. codes factors A = alpha Z +- beta I the same way)."""
    u, s, vh = torch.linalg.svd(a)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, root[:, None] * vh[:rank]

def mimetic_init_(model, alpha1=0.7, beta1=0.7, alpha2=0.4, beta2=0.4, generator=None):
    """Mimetic initialisation (Trockman and Kolter 2023), the baseline of Tables "Best Top-1
    accuracy" and "Perplexity (PPL) comparison"; it takes no task pattern. Per head,
    W_Q,h W_K,h^T ~ alpha1 Z1 + beta1 I (fresh Z1), factored by SVD and truncated to head_dim, as
    post_init_weights' mimetic branch (osiriszjq/structured_initialization) writes Q.T and K.T; per
    layer, W_V W_O ~ alpha2 Z2 - beta2 I (fresh Z2). Z: uniform on +-sqrt(3 / D), variance 1 / D,
    the default (dist='uniform') of get_ortho_like; alphas and betas its values.
    Where we differ: that code's mimetic branch writes V and Proj untransposed, giving the value-output
    map x (R L)^T rather than x L R. The two share eigenvalues and trace (the -beta2 I part is kept
    either way), but (R L)^T is not L R; we write v rows = L^T and proj = R^T, so W_V W_O = L R, the
    formula of Trockman and Kolter and what that code's impulse branch writes.
    Our draws come from a torch.Generator, the reference's from NumPy's global one."""
    for attn in attention_modules(model):
        dim, inner = attn.qkv.weight.shape[1], attn.heads * attn.head_dim
        eye = torch.eye(dim)
        # Z1 of every head, then Z2: (heads + 1) x (D, D)
        *z1, z2 = [(torch.rand(dim, dim, generator=generator) * 2 - 1) * math.sqrt(3 / dim)
                   for _ in range(attn.heads + 1)]
        for h in range(attn.heads):
            left, right = _factor(alpha1 * z1[h] + beta1 * eye, min(attn.head_dim, dim))
            _write_qk(attn, h, left.T, right)            # W_Q,h^T W_K,h = L R
        left, right = _factor(alpha2 * z2 - beta2 * eye, min(inner, dim))
        _write_padded(attn.qkv.weight[2 * inner:], left.T)      # v = x W_V: stores W_V^T
        _write_padded(attn.proj.weight, right.T)                 # y = o W_O: stores W_O^T
    return model

def structured_svd_init_(model, pattern, open_logit=1000.0, noise_scale=3.0, qk_norm=7.0,
                         pos_scale=NORM_P, generator=None, skip=None):
    """Structured initialisation, SVD variant (Zheng et al. 2025), per layer and head, step for step
    as impulse_init and post_init_weights' impulse branch of osiriszjq/structured_initialization:
    positions times pos_scale (NORM_P) first; P = pseudo_input; P+ from the SVD of P^T P, kept
    to the r = head_dim largest singular values; M_h = P+ T_h P+^T factored by SVD (first r), so
    that P Q_h K_h P^T ~ T_h; Q_h, K_h at Frobenius norm qk_norm (norm_q = 7), q rows = Q_h^T, k
    rows = K_h (forward keeps its 1/sqrt(head_dim)); V and O mimetic (0.4, 0.4), fresh per layer.
    T_h = open_logit * target + noise_scale * eps on closed entries, eps a normal truncated at +-2
    with std 0.6, fresh for every layer (1000 and 3 in that code; Table "Arithmetic task setup"
    quotes other targets, which train.py's arithmetic_setup passes). skip: the leading positions
    left out of the solve; None means 1 for a ViT (its CLS: the 2025 code solves on pos_embed[1:],
    its impulse targets covering patches only) and 0 for the Boolean / arithmetic encoders, whose
    patterns cover every position.
    Where we differ: r is capped by the numerical rank of P^T P, which is at most the N - skip
    positions (16 in a Boolean model, fewer than head_dim; the reference, built for a ViT's 196 patches,
    keeps r = head_dim); the Boolean / arithmetic patterns include the CLS (or first) position, the
    reference's do not."""
    skip = int(isinstance(model, ViT)) if skip is None else skip
    with torch.no_grad():
        model.pos.mul_(pos_scale)
    mimetic_init_(model, generator=generator)  # V / O (its Q / K are overwritten below)
    p = pseudo_input(model, skip)                                  # (N - skip, D)
    n, dim = p.shape
    u, s, vh = torch.linalg.svd(p.T @ p)                           # P^T P = U S V^T, (D, D)
    for layer, attn in enumerate(attention_modules(model)):
        # Section 6.1: "QK-based methods are constrained by the low-rank structure of self-attention,
        # leading to poor initialization of sparse patterns". The solved logits P Q_h K_h^T P^T have
        # rank <= r = min(head_dim, rank of P): an N x N pattern of higher rank is only approximated.
        rank = min(attn.head_dim, int((s > s[0] * 1e-6).sum()))
        p_plus = vh[:rank].T @ torch.diag(1 / s[:rank]) @ u[:, :rank].T @ p.T   # (D, N - skip)
        for h in range(attn.heads):
            target = pattern_targets(pattern[layer, h, skip:, skip:])            # (n, n)
            eps = nn.init.trunc_normal_(torch.empty(n, n), std=0.6, a=-2, b=2, generator=generator)
            logits = open_logit * target + noise_scale * eps * (target == 0)
            q, k = _factor(p_plus @ logits @ p_plus.T, rank)                    # (D, r), (r, D)
            q, k = qk_norm * q / q.norm(), qk_norm * k / k.norm()
            _write_qk(attn, h, q.T, k)
    return model

def _fit_qk(p, target, rank, steps, lr, renorm_every, scale, generator):
    """Adam fit of Q (H, D, r), K (H, r, D) so that softmax(scale P Q K P^T) ~ target (MSE), with
    the norm reset before every renorm_every-th step (structured_opt_init_ has the details)."""
    heads, dim = target.shape[0], p.shape[1]
    bound = math.sqrt(1 / (rank * heads))
    q = ((torch.rand(heads, dim, rank, generator=generator) * 2 - 1) * bound).requires_grad_()
    k = ((torch.rand(heads, rank, dim, generator=generator) * 2 - 1) * bound).requires_grad_()
    nq = q.detach().norm(dim=1).mean()                             # Q's mean column norm
    optimizer = torch.optim.Adam([q, k], lr=lr)
    with torch.enable_grad():
        for step in range(steps):
            if step % renorm_every == 0:
                # the norm reset of impulse_init (osiriszjq/structured_init): every column of Q
                # (H, D, r) and of K (H, r, D) (not K's rows) rescaled to norm nq
                with torch.no_grad():
                    q.div_(q.norm(dim=1, keepdim=True) / nq)
                    k.div_(k.norm(dim=1, keepdim=True) / nq)
            attn = torch.softmax(scale * (p @ q @ k @ p.T), dim=-1)          # (H, N, N)
            optimizer.zero_grad()
            F.mse_loss(attn, target).backward()
            optimizer.step()
    return q.detach(), k.detach()

def structured_opt_init_(model, pattern, steps=2000, lr=1e-4, renorm_every=100, pos_scale=NORM_P,
                         generator=None, scale=None):
    """Structured initialisation, optimisation variant (Zheng et al. 2024): "Structured (Opt)",
    after impulse_init of osiriszjq/structured_init (and its call in _init_weights):
    Q (H, D, r) and K (H, r, D), r = head_dim, uniform on +-sqrt(1 / (r H)), Q drawn first, are
    fitted by Adam at lr: MSE of A_h = softmax(scale * P Q_h K_h P^T) (P = pseudo_input) to the 0/1
    pattern itself (not row-normalised). scale=None means head_dim ** -0.5, the value its caller
    passes: as forward also divides by sqrt(head_dim), the written Q, K (q rows = Q_h^T, k rows =
    K_h) reproduce A_h on P exactly. The norm reset runs BEFORE steps 0, renorm_every, ...: the
    first acts on the fresh draw, the last renorm_every steps run without one.
    Where we differ: steps = 2000 by default (Table "Arithmetic task setup": 2000 steps at lr 1e-4;
    that code runs 10000); P: the model's learned positions times pos_scale (the 2025 code's
    norm_p), where that code has fixed 2-D sin-cos positions and no CLS token; one fit per distinct
    layer pattern (that code's init_once: one for all); random draws come from a torch.Generator."""
    with torch.no_grad():
        model.pos.mul_(pos_scale)
    p = pseudo_input(model)
    attns = attention_modules(model)
    rank = attns[0].head_dim
    scale = rank ** -0.5 if scale is None else scale
    solved = {}                                                    # a layer pattern's entries -> (Q, K)
    for layer, attn in enumerate(attns):
        target = pattern_targets(pattern[layer])                   # (H, N, N), 0 / 1
        entries = tuple(target.flatten().tolist())
        if entries not in solved:
            solved[entries] = _fit_qk(p, target, rank, steps, lr, renorm_every, scale, generator)
        q, k = solved[entries]
        for h in range(attn.heads):
            _write_qk(attn, h, q[h].T, k[h])
    return model

# === 5. Measuring the prior: where attention goes (Section 6.1) ==================================
# Section 6.1 argues persistence with a picture, Figure "Comparison of attention patterns before and
# after training" (head 0 of layer 0 under each init), and with Corollary 1's bound; it prints no
# number for it. The numbers below are this code's, from attention maps averaged over fixed probe
# inputs (the caller picks them, e.g. the whole Boolean cube), taken before and after training:
#   prior mass    the attention a query row puts on the entries the pattern opens, averaged over rows;
#                 1 = all of it where the prior allows. A mask init starts near 1 by construction (a
#                 closed key gets e^-A of an equal open key's weight, the constants at the top); a QK
#                 init starts where its solve got to, which Section 6.1 finds poor for sparse patterns.
#   pattern corr  the Pearson correlation of the mean map with the 0/1 pattern over all N x N entries:
#                 also rewards the right shape when the mass is spread.
#   mask drift    how far the bias log sigmoid(s M) moved, relative to its start.
@torch.no_grad()
def mean_attention(model, inputs, device, batch=4096):
    """Each layer's and head's attention map averaged over the inputs, (L, H, N, N) (the maps of
    Figure "Comparison of attention patterns before and after training")."""
    model.eval()
    total = 0
    for i in range(0, len(inputs), batch):
        _, attns = model(inputs[i:i + batch].to(device), return_attn=True)
        total = total + torch.stack([a.float().sum(0) for a in attns]).cpu()   # (L, H, N, N)
    model.train()
    return total / len(inputs)

def mask_biases(model):
    """log sigmoid(s M) of every MaskedSelfAttention, (L, H, N, N); None for a model without. In mode
    "hadamard" it is the log of the factor sigma(s M) that multiplies the probabilities instead."""
    layers = attention_modules(model)
    if not layers or layers[0].mask is None:
        return None
    return torch.stack([a.logit_bias(a.dense_mask(a.seq_len), a.seq_len, a.mask_scale).detach().float().cpu()
                        for a in layers])

def centre_patch_maps(vit, image, device):
    """Where the centre patch of one image (1, C, H, W) looks (Appendix "Attention Map For Image
    Classification"), on the grid x grid patches, CLS left out: its attention row "attn" and its
    mask bias row log sigmoid(s M) "bias" (None without a mask), (L, H, grid, grid) each."""
    grid = vit.grid
    centre = 1 + (grid // 2) * grid + grid // 2                    # patch (grid // 2, grid // 2)
    maps = {"attn": mean_attention(vit, image, device), "bias": mask_biases(vit)}     # (L, H, N, N)
    return {name: None if m is None else m[:, :, centre, 1:].unflatten(-1, (grid, grid))
            for name, m in maps.items()}

def prior_stats(mean_attn, pattern):
    """Per layer and head (L, H): the attention mass on the pattern's open entries (mean over query
    rows; 1 = all mass where the prior says) and the mean map's Pearson correlation with it."""
    target = pattern_targets(pattern)                              # (L, H, N, N)
    mass = (mean_attn * target).sum(-1).mean(-1)
    a = mean_attn.flatten(2) - mean_attn.flatten(2).mean(-1, keepdim=True)
    t = target.flatten(2) - target.flatten(2).mean(-1, keepdim=True)
    corr = (a * t).sum(-1) / (a.norm(dim=-1) * t.norm(dim=-1)).clamp(min=1e-12)
    return mass, corr

def persistence_fields(before, after, pattern, true_pattern=None):
    """The persistence numbers of a run (the header above): prior mass and pattern correlation at init
    and final (mean and per head); the drift ||log sig(M_T) - log sig(M_0)||_F / ||log sig(M_0)||_F
    per (layer, head), taken on the bias because the bias is what the logits see (M going from +10 to
    +15 moves it by 4.5e-5: no drift worth the name); for the GPT's causal prior (no pattern) the bias
    at each distance. With a true_pattern (the task's exact pattern, of which pattern may be an
    edit_pattern) also the mean mass on that, true_prior_mass_init / _final."""
    fields = {"mask_drift": None}
    if pattern is not None:
        init, final = prior_stats(before["attn"], pattern), prior_stats(after["attn"], pattern)
        for name, v0, v1 in zip(("prior_mass", "pattern_corr"), init, final):     # (L, H) each
            fields.update({f"{name}_init": v0.mean().item(), f"{name}_final": v1.mean().item(),
                           f"{name}_init_per_head": v0.tolist(), f"{name}_final_per_head": v1.tolist()})
    if true_pattern is not None:
        fields.update({f"true_prior_mass_{when}": prior_stats(s["attn"], true_pattern)[0]
                       .mean().item() for when, s in (("init", before), ("final", after))})
    b0, b1 = before["bias"], after["bias"]
    if b0 is not None:
        drift = (b1 - b0).flatten(2).norm(dim=-1) / b0.flatten(2).norm(dim=-1)
        fields.update(mask_drift=drift.mean().item(), mask_drift_per_head=drift.tolist())
    if b0 is not None and pattern is None:
        # Figure "Relative mask bias before and after training": the causal bias log sigmoid(s M)
        # (L, H, N, N) at each distance d = i - j >= 0, averaged over layers, heads and query rows
        n = b0.shape[-1]
        for when, bias in (("init", b0), ("final", b1)):
            fields[f"bias_by_distance_{when}"] = [
                bias[..., torch.arange(d, n), torch.arange(0, n - d)].mean().item() for d in range(n)]
    return fields

# === 6. Appendix: the same prior inside an existing model (Section 4.1) ============================
# add_mask_prior gives every self-attention layer of a model a parameter `mask` M (heads, N, N) and
# adds log sigmoid(s * M[h, i, j]) to its scores before the softmax: the attention of Section 4.1.
# M is indexed by the positions the model uses: i is the query's position and j the key's, as the
# model's position_ids give them where it passes them to its attention layers (transformers'
# decoders: left padding, cached decoding and offsets included) or to its position embeddings alone
# (GPTBigCode, CTRL: the patched model's call's, _remember_positions; a causal part patched without its
# model cannot see them, and its first forward is a ValueError), else the token's index in the sequence
# or the cache (BERT, ViT, timm, nn.MultiheadAttention). So a cached, padded or offset run
# reads the entries of M that the run of the same tokens alone and in one piece reads, and a
# position past N is a ValueError; a relative M (relative=True, one logit per head and distance i - j,
# section 1) takes any position. A layer over text takes any n <= N tokens; an image's layer (timm's
# ViTs, torchvision's, transformers' vision models) exactly the N its M was built for, its prefix
# tokens, its grid of (rows, cols) patches, which a forward hook on the model's patch embedding
# reads off each image, and its suffix tokens (YOLOS's detection tokens): with another grid, of fewer
# patches or as many (2 x 8 for 4 x 4), M would give each patch another patch's prior. Images packed
# into one sequence (Pixtral's) each take those N tokens on that grid, each reading M at its own places.
# Three kinds of layer, each reached through its own door:
#   nn.MultiheadAttention (torchvision's ViT, nn.TransformerEncoder, nn.Transformer): a forward
#     pre-hook passes the bias as attn_mask (B * heads, N, N). No fused shortcut bypasses it:
#     nn.MultiheadAttention's is never taken with a float attn_mask, nor nn.TransformerEncoderLayer's
#     while a sub-module has a forward hook; nn.TransformerEncoder's nested-tensor path is turned off.
#   timm's Attention (every timm ViT and DeiT): the same pre-hook passes the bias as its additive
#     float attn_mask (timm >= 1.0.16), which both its fused and its written-out path add.
#   transformers' layers on the AttentionInterface (GPT-2, Llama, Gemma, BERT, ViT, CLIP, ...): their
#     config's attn_implementation becomes MASK_PRIOR_ATTENTION, a function that runs the attention
#     the stock model runs with the bias in its mask: transformers' sdpa_attention_forward (the bias
#     as its position_bias) or, where a gradient reaches M on the CPU, the same softmax written out,
#     for a family transformers runs on SDPA; the family's eager attention with the bias in its float
#     mask for the others. Every eager attention there adds its mask to its scores after its own changes
#     (scaling, Gemma2's softcap, T5's position bias) and before its softmax (GPT-OSS's sinks), so the
#     prior joins all of them as the causal and padding masks do. A forward pre-hook on each patched
#     layer finds the positions as the model's masks do (position_ids, and for the keys a cache holds,
#     dynamic, static or sliding-window, the cache's get_query_offset and get_mask_sizes) and leaves
#     the bias at those positions on the layer for that function. Each layer's record of its prior
#     (scale, mode, grid) goes into its state_dict beside M (_write_record); each layer holds a
#     _TransformersDoor, which registers the function wherever the layer is unpickled.
# Cross-attention (nn.Transformer's decoder multihead_attn, transformers' cross-attention layers, a
# pooling head's attention from a learned probe: SigLIP's) is left unpatched: its keys are another
# sequence than its queries, which has no positions in M.
# The prior costs the model little (tests/bench_add_mask_prior.py): where the positions are 0..n-1
# (training, plain generation) M is read by one slice, not gathered, its log sigmoid recomputed at
# every forward (M as it is then, whatever wrote it: a kept table could go stale); the CPU's fused
# SDPA kernels give no gradient for a mask (CUDA's memory-efficient kernel does), so there a trained
# M takes the written-out softmax, the scaling on Q, a causal layer's in blocks of rows that skip
# most of the future, as the fused causal kernel does; log sigmoid by log(sigmoid) where that is
# exact to the dtype (F.logsigmoid's CPU kernel is slow).
# timm and transformers are never imported at module level: a model holds their modules only once
# they are imported, so they are looked up in sys.modules.
MASK_PRIOR_ATTENTION = "mask_prior"      # the name in transformers' AttentionInterface
# An image model's prefix tokens, the tokens before its grid of patches, by the names of the
# parameters that hold them, (1, k, C) for k tokens or (C,) for one: timm's cls_token, reg_token
# (registers) and dist_token (DeiT); torchvision's class_token; transformers' cls_token,
# distillation_token (DeiT), register_tokens (DINOv2 with registers) and class_embedding (CLIP).
_PREFIX_TOKENS = ("cls_token", "reg_token", "dist_token", "class_token", "distillation_token", "register_tokens",
                  "class_embedding")
# An image model's suffix tokens, after its grid, by the same rule: transformers' YOLOS appends its
# num_detection_tokens learned detection_tokens to the patches (Fang et al.'s "[DET]" tokens)
_SUFFIX_TOKENS = ("detection_tokens",)
_ATTENTION_OF = {}   # transformers layer class -> its family's eager attention, or None where transformers
                     # runs the family on SDPA (_supports_sdpa: no softcap, no sinks); found at patch time, as
                     # a compiled forward cannot run the look-up (torch.compile traces no bytecode)

def _eager_attention(layer_class):
    """Serves the patch's refusals and the families SDPA does not run (Gemma2's softcap, GPT-OSS's
    sinks): the eager attention function a transformers layer class falls back on (the default of its
    ALL_ATTENTION_FUNCTIONS.get_interface call: eager_attention_forward or a family's own name), if
    it reads attention_mask; else None (Qwen2.5-Omni's DiT never does: a mask would be dropped)."""
    import dis
    import inspect
    forward = inspect.unwrap(layer_class.forward)
    for name in forward.__code__.co_names:
        function = forward.__globals__.get(name)
        if "eager" in name and inspect.isfunction(function):
            loaded = [i.argval for i in dis.get_instructions(function) if i.opname.startswith("LOAD_FAST")]
            return function if any("attention_mask" in str(names) for names in loaded) else None
    return None

def _check_transformers_part(where, module, layer, pretrained):
    """Serves the rule that what cannot take the prior is refused at the patch, by name: ValueError,
    the message starting with where, unless add_mask_prior can patch module, a transformers layer or
    (layer False) model (pretrained: transformers' PreTrainedModel). A family must support attention
    backends (transformers' _supports_attention_backend: BLOOM, T5, BART and Whisper do not), its
    eager attention must read attention_mask, its attention must span the sequence with one head
    count (Swin's attends within windows, stage by stage) over hidden states that are one sequence (B,
    n, C), not a grid (B, rows, cols, C) (SAM3's), and it must keep each patch in its place
    (ViTMAE shuffles them), on a grid its config fixes (an image_size: DETR's and Qwen2-VL's vision
    tower's grids follow each image), in one attention call a forward. A layer's class is entered in _ATTENTION_OF."""
    import dis
    import inspect
    import sys
    name = type(module).__name__
    family = [type(module)] if isinstance(module, pretrained) else [
        c for c in vars(sys.modules[type(module).__module__]).values()
        if isinstance(c, type) and issubclass(c, pretrained)]
    if not any(c._supports_attention_backend for c in family):
        raise ValueError(f"{where}: {name}'s family takes no attention function from transformers' AttentionInterface "
                         f"(_supports_attention_backend), which add_mask_prior needs (GPT-2, Llama, BERT, ViT do)")
    if layer and _eager_attention(type(module)) is None:
        raise ValueError(f"{where}: {name} has no eager attention that adds attention_mask to its scores, "
                         f"where add_mask_prior adds M")
    if layer and not isinstance(_heads(module), int):
        raise ValueError(f"{where}: {name} takes a head count per stage, num_heads={_heads(module)}: a hierarchical "
                         f"attention within windows (Swin), where no one (heads, N, N) prior spans the sequence")
    # ViTMAE's random_masking: patches in the order of argsort(noise), at any mask_ratio, the kept first
    if layer and all(hasattr(getattr(module, "config", None), key) for key in ("mask_ratio", "image_size")):
        raise ValueError(f"{where}: {name} shuffles its patches at random before its layers and drops a mask_ratio "
                         f"of them (ViTMAE's random_masking), so no row of M stays with one patch's place on the grid")
    # An image's layer whose config fixes no image_size: its tokens are a grid that follows each image's
    # size (DETR's backbone feature map, its object queries beside it; Qwen2-VL's vision tower, the
    # patches of several images packed into one sequence), so no one M of N tokens keeps each its place
    pixels = [key for key in ("num_channels", "in_channels") if getattr(getattr(module, "config", None), key, None)]
    if layer and pixels and getattr(module.config, "image_size", None) is None:
        raise ValueError(f"{where}: {name} attends over patches, its grid follows each image's size (no image_size in "
                         f"its config: DETR, Qwen2-VL's vision tower), where M is for one grid: patch a language model")
    # the prior is left on the layer for one attention call a forward; DiffLlama's differential attention makes two
    forward = inspect.unwrap(type(module).forward) if layer else None
    if layer and sum("attention_interface" in str(i.argval) for i in dis.get_instructions(forward)
                     if i.opname.startswith("LOAD_FAST")) > 1:
        raise ValueError(f"{where}: {name} calls its attention function twice a forward (a differential "
                         f"attention's two softmaxes, DiffLlama's), where add_mask_prior adds M to the one attention "
                         f"of Section 4.1")
    # SAM2's, SAM3's and Florence-2's: hidden states (B, rows, cols, C), unpacked as such, in windows of the grid
    code = list(dis.get_instructions(forward)) if layer else []
    if any(a.argval == forward.__code__.co_varnames[1] and b.argval == "shape" and c.opname == "UNPACK_SEQUENCE"
           and c.argval == 4 for a, b, c in zip(code, code[1:], code[2:])):
        raise ValueError(f"{where}: {name} takes its hidden states as a grid (batch, rows, cols, channels), attended "
                         f"within windows of it (SAM's line, Florence-2), where M spans one sequence of N tokens")
    if layer:
        _ATTENTION_OF[type(module)] = None if any(c._supports_sdpa for c in family) else _eager_attention(type(module))

def _heads(attn):
    """Serves the patch's shape check: the query heads of a supported layer, num_heads or its
    transformers config's count."""
    return attn.num_heads if hasattr(attn, "num_heads") else attn.config.num_attention_heads

def _as_logits(mask, dtype, blocked=True):
    """Serves the caller's own masks, kept beside the prior at the nn.MultiheadAttention and timm
    doors: a Boolean mask as additive logits of dtype, -inf where it holds `blocked` (True in
    nn.MultiheadAttention's meaning, False in SDPA's, which timm takes), else 0; a float one and None
    are kept."""
    if mask is not None and mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill(mask == blocked, float("-inf"))
    return None if mask is None else mask.to(dtype)

def _log_sigmoid(x):
    """Serves the rule that the prior costs the model little: log sigmoid(x) as F.logsigmoid gives it,
    to the dtype's precision, in under half its CPU time forward and backward (its kernel calls log1p
    element by element): log(sigmoid(x)) where sigmoid(x) is at least the dtype's eps, else x, which
    x - log(1 + e^x) rounds to there (e^x is below half an ulp of x). The clamp keeps the branch not
    taken finite, and so its gradient: zero, not NaN. A few entries (a cached token's row of M: up to
    heads x N) go to F.logsigmoid, one kernel call where the log(sigmoid) takes five, each a dispatch."""
    if x.numel() <= 4096:
        return F.logsigmoid(x)
    floor = math.log(torch.finfo(x.dtype).eps)
    return torch.where(x > floor, x.clamp(min=floor).sigmoid().log(), x)

def _prior_bias(attn, rows, cols, largest, causal=False):
    """The prior itself, read by all three doors, and the rule that a call's tokens fit M: log
    sigmoid(s M[h, i, j]) of a patched layer for queries at positions rows and keys at cols, (B or 1,
    H, n, n_keys), + -inf where j > i if causal (slices from 0). rows, cols: tensors (B or 1, n) and
    (B or 1, n_keys), or slices where the positions are first, ..., first + n - 1 in every row: then
    M is read by one slice, which costs no gather forward and no scatter backward. Every call reads
    M as it is at that call, and keeps nothing of it: no version counter or address tells every
    writer of M (fused optimizers and .data writes leave its version, a parametrization or
    torch.func.functional_call hands a new tensor at a freed one's address). largest: the largest
    query position (an int, or a tensor where positions are data), which must lie below M's N; an
    image's layer (mask_prior_image set: prefix tokens, a grid of patches, suffix tokens) takes exactly
    the N tokens and the (rows, cols) grid M was built for, or k images' k N tokens packed into one
    sequence, each image's on that grid. A key outside 0..N-1 is a slot every mask
    blocks (a padding, a static cache's unwritten slot): it reads M's edge."""
    mask = attn.mask                                  # one look-up: nn.Module's __getattr__ costs a microsecond
    if mask.dim() == 2:
        # A relative M (add_mask_prior's relative=True), as MaskedSelfAttention.dense_mask reads it: at
        # d = i - j of the positions, clamped to 0..K on a causal layer, -K..K else; any position runs
        i, j = (torch.arange(p.start, p.stop, device=mask.device) if isinstance(p, slice) else p for p in (rows, cols))
        d = i[..., :, None] - j[..., None, :]                                # (n, n_keys) or (B, n, n_keys)
        d = d[None] if d.dim() == 2 else d
        K = len(mask[0]) - 1 if getattr(attn, "is_causal", False) else len(mask[0]) // 2
        index = d.clamp(0, K) if getattr(attn, "is_causal", False) else d.clamp(-K, K) + K
        bias = _log_sigmoid(attn.mask_scale * mask[:, index]).transpose(0, 1)    # (B or 1, H, n, n_keys)
        return bias.masked_fill(d[:, None] < 0, float("-inf")) if causal else bias
    size = mask.shape[-1]                                                          # M's N
    # an image's layer: its prefix tokens, the (rows, cols) of the grid M is for, the patch embedding's
    # convolution (None in a part without it), which holds the grid of this call's image, its suffix tokens
    prefix, grid, conv, suffix = attn.mask_prior_image or (None,) * 4
    # k images the convolution saw, their tokens packed one image after another into one sequence where the
    # layer sees k times M's N (Pixtral's: batch 1, a block-diagonal mask keeps each image to itself, its 2-D
    # RoPE positions restart at each image): each token reads M at its place in its own image, whose grid is
    # checked below, M's (1, H, N, N) tiled k x k; the entries between two images are the model's to mask.
    # The grid is the convolution's, of the images' tensor: images cropped inside it (Pixtral's image_sizes)
    # are refused, to be passed cropped.
    images = getattr(conv, "mask_prior_images", 1)
    if prefix is not None and largest + 1 > size and largest + 1 == images * size:   # no guard on B where it fits
        return _prior_bias(attn, slice(0, size), slice(0, size), size - 1).repeat(1, 1, images, images)
    # the image's grid: the convolution's output (B, C, rows, cols), else the square of the patches;
    # without the convolution only the count is checked, and an M of no grid refused
    patches = None if prefix is None else largest + 1 - prefix - suffix
    seen = patches and (getattr(conv, "mask_prior_grid", None) or (math.isqrt(max(patches, 0)),) * 2)
    if patches is not None and (largest != size - 1 or (seen != grid if conv is not None else grid is None)):
        # Another grid's M, of another N or of the same N (2 x 8 patches for 4 x 4): it would give each
        # patch another patch's prior. impulse_mask builds CLS + g x g patches, row-major (Section 5.3);
        # its rows and columns indexed by [0] * prefix + the patches (r, c) of a rows x cols grid (+ [0] *
        # suffix) give each its neighbours there, and every prefix and suffix token the class token's prior
        # (no CLS: prefix 0).
        (rows, cols), g = seen, max(seen)
        after = (f" + {suffix} after them (detection tokens)", f" + [0] * {suffix}") if suffix else ("", "")
        raise ValueError(f"{attn.mask_prior_name}: an image layer takes the N tokens its mask was built for, on its "
                         f"grid; got {largest + 1} = {prefix} prefix tokens (class, distillation, register tokens in "
                         f"the patched module) + {patches} patches{after[0]}, M {tuple(mask.shape)} is for "
                         f"N = {size}: for a {rows} x {cols} grid M = maskprior.impulse_mask(depth, heads, {g})"
                         f"[..., i, :][..., i], i = [0] * {prefix} + [1 + r * {g} + c for r in range({rows}) for c in "
                         f"range({cols})]{after[1]}"
                         + (f"; patch with add_mask_prior(..., grid=({rows}, {cols}))" if rows != cols else ""))
    if torch.compiler.is_compiling() or largest >= size:   # a compiled graph cannot branch on data: it asserts
        message = (f"{attn.mask_prior_name}: mask of shape {tuple(mask.shape)} is for "
                   f"self-attention over sequences of length at most {size}, positions 0 to {size - 1}")
        if not torch.compiler.is_compiling():
            raise ValueError(f"{message}, got position {int(largest)}")
        torch._assert_async(torch.as_tensor(largest < size), message)
    if not isinstance(rows, slice):                                 # positions as data: M gathered
        heads = torch.arange(len(mask), device=mask.device)[:, None, None]                    # (H, 1, 1)
        rows, cols = rows[:, None, :, None], cols.clamp(0, size - 1)[:, None, None, :]   # (B, 1, n, 1), (B, 1, 1, k)
        return _log_sigmoid(attn.mask_scale * mask[heads, rows, cols])                        # (B, H, n, n_keys)
    if mask.requires_grad and torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.jit.is_tracing():
        block = mask[None, :, rows, cols]                                                     # (1, H, n, n_keys)
    else:     # no backward to serve: one view op, not the indexing's two, which a cached token's step pays for
        (heads, row, col), offset = mask.stride(), mask.storage_offset() + rows.start * mask.stride(1)
        block = mask.as_strided((1, len(mask), rows.stop - rows.start, cols.stop - cols.start), (0, heads, row, col),
                                offset + cols.start * col)                                    # (1, H, n, n_keys)
    # s = 1 (add_mask_prior's default) takes no product: a cached token's step pays for each kernel call
    bias = _log_sigmoid(block if attn.mask_scale == 1 else attn.mask_scale * block)
    return bias + bias.new_full(bias.shape[-2:], float("-inf")).triu(1) if causal else bias   # the future: -inf

def _add_mask_prior_to_call(attn, args, kwargs):
    """The doors of the layers that take an additive float attn_mask, their forward pre-hook:
    attn_mask = log sigmoid(s M) + the caller's mask. nn.MultiheadAttention (torchvision's ViT,
    nn.TransformerEncoder, nn.Transformer) takes (B * heads, N, N), its is_causal a hint beside
    attn_mask; timm's Attention (every timm ViT and DeiT; timm >= 1.0.16) takes (B, H, N, N) on both its
    fused and its written-out path, and its is_causal goes into the bias (with it timm's written-out
    path ignores attn_mask and its fused one, F.scaled_dot_product_attention, refuses both at once)."""
    call = dict(zip(attn.mask_prior_arguments, args), **kwargs)
    # timm's forward(x, attn_mask, is_causal); nn.MultiheadAttention's: (B, N, E), (N, B, E) or unbatched (N, E)
    query, key = (call["x"], call["x"]) if (timm := "x" in call) else (call["query"], call["key"])
    batched = query.dim() == 3
    n = query.shape[1 if batched and (timm or attn.batch_first) else 0]
    if key is not query and not (key.shape == query.shape and torch.equal(key, query)):   # a probe's, patched alone
        raise ValueError(f"{attn.mask_prior_name}: the mask prior is for self-attention, got "
                         f"query {tuple(query.shape)} and key {tuple(key.shape)} from another sequence: "
                         f"patch the part of the model that holds its self-attention layers")
    caller_mask = _as_logits(call.get("attn_mask"), query.dtype, blocked=not timm)   # (N, N), (B * H or B, ., N, N)
    causal = (timm or caller_mask is None) and bool(call.get("is_causal"))   # alone, the causal -inf joins the bias
    bias = _prior_bias(attn, slice(0, n), slice(0, n), n - 1, causal).to(query.dtype)      # (1, H, N, N)
    if not timm:                  # row b * H + h: (B * H, N, N), the only per-head shape attn_mask takes
        bias = bias[0].repeat(query.shape[0 if attn.batch_first else 1], 1, 1) if batched else bias[0]
        call.update(key_padding_mask=_as_logits(call.get("key_padding_mask"), query.dtype))
    bias = bias if caller_mask is None else bias + caller_mask
    # is_causal=False: with is_causal=True (and no padding mask, no weights asked for)
    # F.multi_head_attention_forward drops attn_mask and lets SDPA apply the causal mask alone; the
    # causal -inf is in attn_mask. timm's mask goes 4-D: the CPU's fused kernel takes it (a 3-D one
    # goes to the slower math kernel). A Boolean key_padding_mask beside a float attn_mask draws a
    # deprecation warning: it goes as logits, the same values.
    call.update(attn_mask=bias.expand(query.shape[0], -1, -1, -1) if timm else bias, is_causal=False)
    return (), call

def _add_mask_prior_to_transformers_call(attn, args, kwargs):
    """The transformers door's first half, a patched layer's forward pre-hook, which serves the rule
    that a cached, padded or offset run reads the entries of M its tokens' positions name: leaves
    its attention function mask_prior_bias, log sigmoid(s M) (B or 1, H, n, n_keys) at the
    positions of its queries and keys, found as the model's own masks find them. The queries sit at
    position_ids (else at their cache indices, from get_query_offset on); the keys at cache indices
    kv_offset, ..., kv_offset + kv_length - 1 (get_mask_sizes): the new ones are the queries'
    tokens, at the queries' positions; a cached one, where the call gives positions and the model's
    mask, as many positions before the last query as there are keys between them that some query
    sees (padding inside a row skipped, as generate counts positions), else d positions before the
    first query for d indices (a row's tokens contiguous, left padding only shifting them; a
    padding's position below 0 is blocked anyway). Where the positions are the cache indices
    themselves (no padding, no offset: training, plain generation), so are the keys', and M is read
    by one slice. ValueError where the model was switched off MASK_PRIOR_ATTENTION
    (set_attn_implementation), which would drop M."""
    # attn_implementation read past the config's property and its two __getattribute__ (Python, and
    # vars() calls them for __dict__: microseconds a layer), through them where the attribute is missing
    # and where Dynamo traces the hook (torch.compile, fullgraph too), which cannot trace the shortcut
    implementation = attn.config._attn_implementation if torch.compiler.is_compiling() else (
        object.__getattribute__(attn.config, "__dict__").get("_attn_implementation_internal")
        or attn.config._attn_implementation)
    if implementation != MASK_PRIOR_ATTENTION:
        raise ValueError(f"{attn.mask_prior_name} has a mask prior, which needs attn_implementation="
                         f"{MASK_PRIOR_ATTENTION!r}; got {implementation!r}: call "
                         f"set_attn_implementation({MASK_PRIOR_ATTENTION!r}) on the model")
    # the hidden states (B, n, C) come first; the rest by name, as transformers' layers pass them (a dict
    # built for each call costs a cached token's step about a microsecond a layer)
    call = dict(zip(attn.mask_prior_arguments, args), **kwargs) if len(args) > 1 else kwargs
    n, mask = (args[0] if args else kwargs[attn.mask_prior_arguments[0]]).shape[1], attn.mask
    # transformers' names for another sequence's states, then for the KV cache (past_key_values before
    # 5.24; a call names one of them)
    if call.get("encoder_hidden_states") is not None or call.get("key_value_states") is not None:
        raise ValueError(f"{attn.mask_prior_name}: the mask prior is for self-attention, got another sequence's keys")
    cache = call.get("cache", call.get("past_key_values", call.get("layer_past")))
    cache = getattr(cache, "self_attention_cache", cache)                   # an encoder-decoder's
    first, (length, offset) = (0, (n, 0)) if cache is None else (   # the queries' first cache index, the keys'
        cache.get_query_offset(attn.layer_idx), cache.get_mask_sizes(n, attn.layer_idx))   # number and first index
    positions = call.get("position_ids")                                 # (B or 1, n), or mRoPE's (3, B, n)
    # A causal layer its model hands none (GPTBigCode's, CTRL's), patched without the model whose call's
    # position_ids _remember_positions keeps: a left-padded or offset row would read M at its cache slots
    if positions is None and "position_ids" not in attn.mask_prior_positions and getattr(attn, "is_causal", False):
        raise ValueError(f"{attn.mask_prior_name}: {type(attn).__name__}'s model hands its layers no position_ids, "
                         f"so a part patched alone cannot read M at the positions the model uses (left padding): "
                         f"patch the model, add_mask_prior(model, ...)")
    # a layer its model hands none (GPTBigCode's): the model's call's, which its embeddings took (_remember_positions)
    positions = attn.mask_prior_positions.get("position_ids") if positions is None else positions
    positions = positions if positions is not None and positions.dim() == 2 and positions.shape[-1] == n else None
    if offset + length <= mask.shape[-1] and (positions is None or not torch.compiler.is_compiling() and (
            positions.item() == first if positions.numel() == 1 else     # a cached token's step: one position
            torch.equal(positions, (torch.arange(n, device=mask.device) + first).expand_as(positions)))):
        # object.__setattr__: nn.Module's own costs a cached token's step a microsecond
        rows, cols = slice(int(first), int(first) + n), slice(offset, offset + length)
        return object.__setattr__(attn, "mask_prior_bias", _prior_bias(attn, rows, cols, rows.stop - 1))
    given, visible = positions is not None, call.get("attention_mask")     # the model's mask (B, 1, n, n_keys)
    # or a family's masks by kind (ZAYA's {"causal": (B, 1, n, n_keys), "conv": ...}): the attention's
    visible = next((m for m in visible.values() if getattr(m, "dim", int)() == 4), None) if isinstance(
        visible, dict) else visible
    positions = torch.arange(n, device=mask.device)[None] + first if positions is None else positions   # (B or 1, n)
    # key k lies relative = k's cache index - first after the first query (no cache: the queries)
    relative = torch.arange(length, device=mask.device) + offset - first         # (n_keys,)
    inside = relative.clamp(0, n - 1)         # the new keys are the queries' tokens, at their positions
    keys = positions[:, inside] + (relative - inside)                       # (B or 1, n_keys)
    if given and offset < first and getattr(visible, "dim", int)() == 4 and visible.shape[-1] == length:
        # Cached keys where the positions are given (generate counts them from the attention mask): each
        # lies as many positions before the last query as there are keys between them that some query
        # sees, so padding after a row's first token (right padding, a batch's later turn padded) is
        # skipped, as generate skips it; keys no query sees read M anywhere
        seen = (visible[:, 0] if visible.dtype == torch.bool else visible[:, 0] == 0).any(-2)   # (B, n_keys)
        count = seen.cumsum(-1)
        before = positions[:, -1:] - count[:, first + n - 1 - offset:first + n - offset] + count[:, :first - offset]
        # a seen key before position 0: the positions do not count the tokens (generate's after right
        # padding, which continue from the padding's), and which position each cached key had is lost
        if not torch.compiler.is_compiling() and bool((before < 0)[seen[:, :first - offset]].any()):
            raise ValueError(f"{attn.mask_prior_name}: position_ids that do not count the tokens the mask lets through "
                             f"(right padding in generate?) lose the cached keys' places: pad left, or use_cache=False")
        keys = torch.cat([before, keys[:, first - offset:].expand(len(before), -1)], 1)      # (B, n_keys)
    # on the layer, not in the layer's attention_mask: some layers (VideoMAE's, transformers' ViT)
    # hand their attention function none; the function reads the bias and clears it, for one call
    object.__setattr__(attn, "mask_prior_bias", _prior_bias(attn, positions, keys, positions.max()))  # (B, H, n, k)

def _mask_prior_attention(module, query, key, value, attention_mask, **kwargs):
    """The transformers door's second half, transformers' AttentionInterface function under
    MASK_PRIOR_ATTENTION, which serves the rule that the prior costs the model little: the attention
    the stock model runs, with the bias the pre-hook left on the layer, log sigmoid(s M), in its
    mask. query (B, H, n, d); key, value (B, H_kv, n_keys, d); attention_mask: sdpa_mask's (the mask
    function of MASK_PRIOR_ATTENTION), None (causal, or nothing masked) or Boolean (B, 1, n, n_keys),
    True where a query may look. A family transformers runs on SDPA (GPT-2, Llama, BERT, ViT, ...)
    goes to torch's fused kernel with the bias in its float mask, as its sdpa_attention_forward
    would with the bias as position_bias, unless the model collects the weights or, on the CPU, a
    gradient reaches M: then to the same attention written out, a causal layer's in blocks of query
    rows (the CPU's fused kernels give no gradient for a mask, CUDA's memory-efficient one does;
    SDPA's math fallback costs more). A family SDPA does not run (Gemma2's softcap, GPT-OSS's sinks)
    goes to its eager attention, the bias in its float mask. An unpatched layer (cross-attention, a
    layer a partial patch left out) runs the family's stock attention alone."""
    bias = kwargs.pop("position_bias", None)           # a family's own (PP-DocLayout-V2's): both add
    if hasattr(module, "mask_prior_name"):
        prior = vars(module).pop("mask_prior_bias", None)       # (B or 1, H, n, n_keys), for this call alone
        if prior is None or prior.shape[-2:] != (query.shape[-2], key.shape[-2]):   # called outside the forward
            raise ValueError(f"{module.mask_prior_name}: {query.shape[-2]} queries and {key.shape[-2]} keys where its "
                             f"forward's positions, cache give {None if prior is None else tuple(prior.shape[-2:])}")
        bias = prior if bias is None else prior + bias          # (B or 1, H, n, n_keys)
    # a class no patch has met (a cross-attention's) is looked up here, where compiling cannot
    eager = _ATTENTION_OF[type(module)] if type(module) in _ATTENTION_OF else _eager_attention(type(module))
    # transformers' capture_outputs records each layer's weights (output_attentions=True), GPT-2's
    # without telling the layer; SDPA gives none
    from transformers.utils import output_capturing
    collected = kwargs.get("output_attentions") or "attentions" in (output_capturing._active_collector.get() or ())
    # transformers' SDPA functions imported in the branches that call them: a cached token's step calls neither
    if eager is None and bias is None:          # an unpatched layer on SDPA: the stock attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # sdpa_attention_forward's rule: a causal layer's mask is None where is_causal serves (no padding,
    # as many queries as keys or queries from cache index 0: the causal mask is the top-left triangle)
    causal = query.shape[2] > 1 and attention_mask is None and (
        getattr(module, "is_causal", True) if (is_causal := kwargs.pop("is_causal", None)) is None else is_causal)
    # Causal alone: the future's -inf added to the bias, not filled in, which leaves the backward no
    # pass of its own (every row keeps its first key); nothing masked: the bias alone. Else a blocked
    # entry takes the dtype's lowest value in place of the bias, as transformers' eager_mask gives it:
    # a row of padding stays finite.
    if bias is not None and attention_mask is None:            # (B or 1, H, n, n_keys)
        mask = bias + query.new_full(bias.shape[-2:], float("-inf")).triu(1) if causal else bias
    else:
        from transformers.integrations.sdpa_attention import create_position_bias_mask
        mask = create_position_bias_mask(query.new_zeros(()) if bias is None else bias, attention_mask, causal,
                                         query, key)                            # (B or 1, H or 1, n, n_keys)
    if eager is not None:
        return eager(module, query, key, value, mask, **kwargs)
    scale, dropout = kwargs.get("scaling") or query.shape[-1] ** -0.5, kwargs.get("dropout", 0.0)
    if not (bias.requires_grad and query.device.type == "cpu" or collected):
        # torch's fused kernel, as sdpa_attention_forward calls it, without its Python (a third of a
        # cached token's attention): grouped-query attention by enable_gqa, which copies no K, V. Off
        # the CPU a trained M too: CUDA's memory-efficient kernel gives the mask its gradient
        mask = mask if mask.dtype == query.dtype else mask.to(query.dtype)     # autocast's; .to alone costs 1 us
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                                enable_gqa=query.shape[1] != key.shape[1])
        return output.transpose(1, 2), None                    # (B, n, H, d), as transformers' layers take it
    # softmax(scaling Q K^T + mask) V, Section 4.1 with the model's masks; the scaling on Q (n x d)
    # rather than the logits (n x n). K, V repeated for grouped-query attention as transformers'
    # repeat_kv, and contiguous (B, H, n_keys, d) either way: their blocks below are views, no copies
    key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], 1) for t in (key, value))
    query = query * scale
    # A causal layer's queries in rows start, ..., start + rows - 1 see no key past the last of them:
    # the scores go in blocks of rows, each against its keys 0, ..., start + rows - 1, which skips
    # about half the future's -inf entries and keeps each block's (B, H, rows, keys) in the cache.
    # Row blocks of 64 (n // 8 past 512) ran fastest on the 2-core CPU at n 128 (head size 32) to 1024;
    # fused SDPA's causal kernel does the same skipping. Weights asked for (collected) come whole, and
    # so does a compiled or exported graph's (a loop over blocks would fix a dynamic length to one).
    whole = collected or torch.compiler.is_compiling()
    rows = max(64, query.shape[2] // 8) if causal and not whole else query.shape[2]
    outputs = []
    for start in [0] if whole or not causal else range(0, query.shape[2], rows):
        keys = min(start + rows, query.shape[2]) if causal else key.shape[2]
        weights = torch.matmul(query[:, :, start:start + rows], key[:, :, :keys].transpose(-1, -2))
        block = mask[..., start:start + rows, :keys]                           # (B or 1, H or 1, rows, keys)
        # added in place, one (B, H, rows, keys) buffer fewer; autocast's bf16 scores and an fp32 bias
        # out of place, so that their sum stays fp32 as the stock eager attention keeps it
        weights = weights.add_(block) if weights.dtype == block.dtype else weights + block
        weights = weights.softmax(-1, dtype=torch.float32).to(value.dtype)
        weights = F.dropout(weights, dropout, module.training)              # p = 0 gives weights back
        outputs.append(torch.matmul(weights, value[:, :, :keys]))          # (B, H, rows, d)
    # (B, n, H, d), contiguous: the caller's reshape to (B, n, H * d) copies nothing
    return torch.cat([output.transpose(1, 2) for output in outputs], 1), weights if rows == query.shape[2] else None

def _self_attention_layers(model, refuse=True):
    """Serves add_mask_prior's reach and from_pretrained's: [(name, module, pre-hook, image)] of
    every supported self-attention layer in model, in named_modules() order, each with the forward
    pre-hook of its door: nn.MultiheadAttention (but the multihead_attn of nn.TransformerDecoderLayer,
    cross-attention with keys from the memory), timm's Attention, or a transformers layer, one whose
    forward looks up ALL_ATTENTION_FUNCTIONS (the registry behind attn_implementation=) but its
    family's cross-attention layers. image: None for a layer over a sequence; for an image's layer
    (timm's, torchvision's ViT's, a transformers layer whose config has an image_size) (prefix, patch
    convolution or None, suffix): the count of tokens model puts before its patches (_PREFIX_TOKENS)
    and after them (_SUFFIX_TOKENS). ValueError naming a transformers model or layer that cannot take
    the prior (_check_transformers_part), or, refuse False, such a layer left out (from_pretrained: a
    composite's other tower, which its folder holds no M for)."""
    import inspect
    import sys
    timm_attention = getattr(sys.modules.get("timm.layers.attention"), "Attention", ())   # () before timm
    # timm's patch_drop_rate: a random subset of the patches while training, each then at another index
    patch_dropout = getattr(sys.modules.get("timm.layers.patch_dropout"), "PatchDropout", ())
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", ())
    decoder_cross = {id(m.multihead_attn) for m in model.modules() if isinstance(m, nn.TransformerDecoderLayer)}
    # a pooling head's (SigLIP's, Idefics2's, Phi-4 multimodal's): its queries a learned probe that the module
    # holding it keeps beside it, (1, k, C), its keys the sequence: cross-attention, left unpatched as well
    decoder_cross |= {id(a) for m in model.modules() for a in m.children() if isinstance(a, nn.MultiheadAttention)
                      and any(p.shape[-1] == a.embed_dim for p in m.parameters(recurse=False))}
    prefix, suffix = (sum(p.numel() // p.shape[-1] for name, p in model.named_parameters() if name.endswith(names))
                      for names in (_PREFIX_TOKENS, _SUFFIX_TOKENS))
    torchvision = any(type(m).__module__.startswith("torchvision.") for m in model.modules())  # its ViT's layers
    named, conv = [], None
    for name, module in model.named_modules():
        if isinstance(module, patch_dropout) and module.prob > 0:
            raise ValueError(f"{name}: {type(model).__name__} drops a random {module.prob:g} of its patches while "
                             f"training (timm's patch_drop_rate), so no row of M keeps one patch's place: set it to 0")
        # the patch embedding: the last 2-D convolution before the first attention layer (a hybrid's stem first)
        conv = module if isinstance(module, nn.Conv2d) and not named else conv
        forward = inspect.unwrap(type(module).forward) if "transformers" in sys.modules else None
        on_interface = "ALL_ATTENTION_FUNCTIONS" in getattr(getattr(forward, "__code__", None), "co_names", ())
        cross = getattr(module, "is_cross_attention", False) or "Cross" in type(module).__name__
        transformers_layer = on_interface and not cross
        try:
            if transformers_layer or isinstance(module, pretrained):
                _check_transformers_part(name or type(module).__name__, module, transformers_layer, pretrained)
        except ValueError:
            if refuse:
                raise
            continue
        image = getattr(getattr(module, "config", None), "image_size", None) is not None
        tokens = prefix, conv, suffix          # an image layer's: those before its grid, the patch embedding, after
        if isinstance(module, nn.MultiheadAttention) and id(module) not in decoder_cross:
            named.append((name, module, _add_mask_prior_to_call, tokens if torchvision else None))
        elif isinstance(module, timm_attention):
            named.append((name, module, _add_mask_prior_to_call, tokens))
        elif transformers_layer:
            named.append((name, module, _add_mask_prior_to_transformers_call, tokens if image else None))
    return named

def _remember_positions(model, args, kwargs):
    """A transformers model's forward pre-hook, which serves the rule that a decoder reads M at the
    positions it uses where its layers are not handed them (GPTBigCode, CTRL, BERT's line as a decoder:
    position_ids go to their position embeddings alone; generate passes them, counted from the
    attention mask under left padding): keeps the call's position_ids, None where it gives none (the
    model then counts from its cache, as the layer's pre-hook does), for the patched layers it holds."""
    # a call's arguments by name (generate's calls pass none by position: no dict to build then)
    call = dict(zip(model.mask_prior_arguments, args), **kwargs) if args else kwargs
    model.mask_prior_positions["position_ids"] = call.get("position_ids")

def _patch(named, masks, mode, scale, grid=None, model=None):
    """Serves add_mask_prior and from_pretrained, the one place a layer takes the prior: give each
    (name, layer, pre-hook, image) of named its M (a Parameter from masks), its pre-hook, an image's
    layer the grid M is for (grid, else the square of M's patches; None if they make no square) and,
    for a transformers layer, MASK_PRIOR_ATTENTION and the record of its prior in the layer's
    state_dict (_write_record). First a ValueError naming the module unless every layer is
    unpatched and its mask is (heads, N, N)."""
    import inspect
    import sys
    for (name, attn, _, image), mask in zip(named, masks):
        heads, rows, cols = mask.shape if mask.dim() == 3 else (len(mask), 1, 1)     # relative: (H, R)
        if hasattr(attn, "mask_prior_name"):
            raise ValueError(f"{name or 'model'} already has a mask prior")
        if mask.dim() == 2 and (image is not None or not getattr(attn, "is_causal", False) and len(mask[0]) % 2 == 0):
            raise ValueError(f"{name or 'model'}: a relative mask {tuple(mask.shape)} is for a layer over text, "
                             f"(heads, K + 1) if causal (is_causal), else (heads, 2K + 1); an image's layer "
                             f"takes M dense")
        if heads != _heads(attn) or rows != cols:
            raise ValueError(f"{name or 'model'}: mask of shape {tuple(mask.shape)} does not fit a "
                             f"{type(attn).__name__} with num_heads={_heads(attn)}; expected ({_heads(attn)}, N, N)")
    for (name, attn, hook, image), mask in zip(named, masks):
        # M takes the module's dtype and device
        attn.mask = nn.Parameter(mask.detach().to(next(attn.parameters())).clone(), requires_grad=mode == "learnable")
        attn.mask_scale, attn.mask_prior_mode = scale, mode
        attn.mask_prior_name = name or "model"                             # the name for the forward-time messages
        if image is not None:                      # (prefix tokens, the patch convolution or None, suffix tokens)
            side = math.isqrt(max(len(mask[0]) - image[0] - image[2], 0))
            square = (side, side) if side * side == len(mask[0]) - image[0] - image[2] else None
            # in a tuple, the convolution is no submodule of the layer: named_modules, state_dict unchanged
            attn.mask_prior_image = image[0], tuple(grid) if grid else square, image[1], image[2]
            if image[1] is not None and "mask_prior_grid" not in vars(image[1]):
                object.__setattr__(image[1], "mask_prior_grid", None)
                image[1].register_forward_hook(_record_grid)
        else:
            attn.mask_prior_image = None
        attn.mask_prior_positions = {}         # the position_ids of its model's call (_remember_positions)
        # the names of forward's arguments, by which each hook reads a call's positional ones
        attn.mask_prior_arguments = tuple(inspect.signature(attn.forward).parameters)
        attn.register_forward_pre_hook(hook, with_kwargs=True)
        if hook is _add_mask_prior_to_transformers_call:
            attn.register_state_dict_post_hook(_write_record)
            attn.register_load_state_dict_pre_hook(_drop_record)
            attn.mask_prior_door = _TransformersDoor(type(attn), _ATTENTION_OF[type(attn)])
            attn.config._attn_implementation = MASK_PRIOR_ATTENTION     # every layer on the config takes it
    # Each transformers model in model keeps its call's position_ids for the patched layers it holds,
    # a layer the innermost model's (a vision tower's call has none: its layers count their tokens)
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", ())
    models = [m for m in (model.modules() if model is not None else ()) if isinstance(m, pretrained)]
    for module in models:
        module.mask_prior_positions = getattr(module, "mask_prior_positions", {})
        for layer in (m for m in module.modules() if hasattr(m, "mask_prior_name")):
            layer.mask_prior_positions = module.mask_prior_positions
    # the hook only on a model whose record a layer reads (an outer model's, GPT2LMHeadModel's around
    # GPT2Model, no layer reads: its call would pay a hook for nothing); mask_prior_arguments marks it hooked
    for module in models:
        layers = [m for m in module.modules() if hasattr(m, "mask_prior_name")]
        if not hasattr(module, "mask_prior_arguments") and any(
                layer.mask_prior_positions is module.mask_prior_positions for layer in layers):
            module.mask_prior_arguments = tuple(inspect.signature(module.forward).parameters)
            module.register_forward_pre_hook(_remember_positions, with_kwargs=True)

def _record_grid(conv, args, output):
    """Serves the rule that a grid is a grid: a forward hook on an image model's patch embedding, its
    last convolution before the first attention layer, which leaves the grid of this call's image,
    the (rows, cols) of its output (B, C, rows, cols), for the image's layers to check M's against,
    and its B images, which a layer seeing B times M's N tokens takes as packed into one sequence."""
    object.__setattr__(conv, "mask_prior_grid", tuple(output.shape[-2:]))
    object.__setattr__(conv, "mask_prior_images", output.shape[0])      # not len(): no guard on a dynamic batch

# The record of a layer's prior: its scale and mode, and an image layer's grid, as JSON in a uint8
# tensor beside M, `<layer>.mask_record`. It lives in the weights, not in config.json: a plain
# from_pretrained drops it with M (both unexpected keys), so a model loaded without the prior and
# saved again claims none, and two models built from one config object record their own priors.
# It is written from the layer as it is at each state_dict call, so a load_state_dict never changes
# a patch's scale or mode: the layer takes M from a state_dict, and its record is dropped.

def _write_record(attn, state_dict, prefix, metadata):
    """Serves the rule that the record belongs to the model patched: a patched transformers layer's
    state_dict post-hook, which adds its record to the state_dict that save_pretrained writes."""
    import json
    grid = attn.mask_prior_image and attn.mask_prior_image[1]          # the (rows, cols) an image's M is for
    record = {"scale": attn.mask_scale, "mode": attn.mask_prior_mode, **({"grid": list(grid)} if grid else {})}
    state_dict[prefix + "mask_record"] = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)

def _drop_record(attn, state_dict, prefix, *load_arguments):
    """The load_state_dict pre-hook beside _write_record: the layer keeps its own scale and mode."""
    state_dict.pop(prefix + "mask_record", None)

class _TransformersDoor:
    """Serves the rule that a patched model travels: each patched transformers layer holds one, built
    at the patch and again wherever the layer is unpickled or deep-copied (pickle rebuilds it by
    calling the class, which imports maskprior), so that a torch.load in a fresh process finds
    MASK_PRIOR_ATTENTION registered before the model's first forward asks transformers for it."""
    def __init__(self, layer_class, attention):
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        # _mask_prior_attention under MASK_PRIOR_ATTENTION, with transformers' sdpa_mask as its mask
        # function, SDPA's: None where is_causal serves, else Boolean (a name without one gets
        # attention_mask=None: no causal, no padding mask)
        AttentionInterface.register(MASK_PRIOR_ATTENTION, _mask_prior_attention)
        AttentionMaskInterface.register(MASK_PRIOR_ATTENTION, sdpa_mask)
        _ATTENTION_OF[layer_class] = attention                  # what _check_transformers_part found
        self.arguments = layer_class, attention

    def __reduce__(self):
        return type(self), self.arguments

def add_mask_prior(model, mask_init, mode="learnable", scale=1.0, grid=None, relative=False):
    """The appendix's feature, Section 4.1's prior in an existing model: log sigmoid(scale * M) in
    every self-attention layer of model (a whole model or a part: a ModuleList, one layer):
    nn.MultiheadAttention, timm's Attention, transformers' layers on the AttentionInterface; returns
    the patched modules in model.named_modules() order. mask_init: float logits (heads, N, N) for every
    layer or (layers, heads, N, N), one per layer in that order; M[h, i, j] is the prior of a query at
    position i on a key at position j. mode: "learnable" or "fixed", as in MaskedSelfAttention; M is
    the parameter `mask` of each layer, in the state_dict (patch a fresh model before load_state_dict;
    a transformers model saved with save_pretrained comes back with from_pretrained below). The
    caller's causal and padding masks are kept. A layer over a sequence takes any n <= N tokens, at
    the positions the model gives them; an image's layer exactly the N tokens M was built for (prefix
    tokens, the patches, suffix tokens: timm's, torchvision's and transformers' vision models, YOLOS's
    detection tokens last) and their grid: grid=(rows, cols), row-major, else the square of M's
    patches (impulse_mask's); a layer whose patch embedding lies outside model (a part) checks their
    count alone; images packed into one sequence (Pixtral's) each the same. Else a ValueError at
    forward time.
    A transformers model with a head takes its own copy of its configs, whose attn_implementation
    the patch sets.
    relative: mask_init holds one logit per head and distance d = i - j (MaskedSelfAttention's
    relative M), (heads, R) or (layers, heads, R): R = K + 1 for d = 0..K on a causal layer
    (is_causal: GPT-2, Llama), R = 2K + 1 for -K..K on the others (BERT, nn.MultiheadAttention,
    timm); a distance past K reads the last logit, so a layer over text takes any position; image
    layers refuse it."""
    if mode not in ("learnable", "fixed"):
        raise ValueError(f"mode must be 'learnable' or 'fixed', got {mode!r}")
    if not torch.is_floating_point(mask_init):
        raise ValueError(f"mask_init must be float logits M, got dtype {mask_init.dtype}: pass a Boolean pattern "
                         f"as torch.where(allowed, maskprior.OPEN, maskprior.CLOSE) (open {OPEN:g}, closed {CLOSE:g})")
    named = _self_attention_layers(model)
    if not named:
        raise ValueError(f"{type(model).__name__} contains no nn.MultiheadAttention, timm Attention "
                         f"or transformers attention layer to patch")
    dims = 3 - relative                 # the dims of one layer's M: (heads, N, N), relative (heads, R)
    if mask_init.dim() not in (dims, dims + 1) or (mask_init.dim() == dims + 1 and len(mask_init) != len(named)):
        shape = "heads, R" if relative else "heads, N, N"
        raise ValueError(f"mask_init must be ({shape}) or (layers = {len(named)}, {shape}) for the "
                         f"modules {[layer[0] for layer in named]}, got {tuple(mask_init.shape)}")
    # The patch belongs to the model patched: a transformers model with a head (its base_model another
    # module: LlamaForCausalLM, ViTForImageClassification, LlavaForConditionalGeneration) takes its own
    # copies of the configs its modules hold (one deepcopy: a composite's sub-configs stay its
    # sub-configs), so a model built from the same config object keeps its attn_implementation. A base
    # model or a part (a ModuleList, a layer) sets the one of the config it shares with the model
    # around it (a module cannot reach the model that holds it to copy that one's): its unpatched
    # layers then run their stock attention through MASK_PRIOR_ATTENTION, the same outputs.
    holders = [m for m in model.modules() if hasattr(getattr(m, "config", None), "to_json_string")]
    if holders and getattr(model, "base_model", model) is not model:
        import copy
        copies = copy.deepcopy({id(m.config): m.config for m in holders})
        for module in holders:
            module.config = copies[id(module.config)]
    _patch(named, mask_init if mask_init.dim() == dims + 1 else mask_init.expand(len(named), *mask_init.shape),
           mode, scale, grid, model)
    for encoder in (m for m in model.modules() if isinstance(m, nn.TransformerEncoder)):
        encoder.use_nested_tensor = False
    return [layer[1] for layer in named]

def from_pretrained(model_class, path, **kwargs):
    """Serves the rule that a saved prior loads whole or not at all: model_class.from_pretrained(path,
    **kwargs) with its mask prior, from a directory save_pretrained wrote for a model with
    add_mask_prior, whose weight files hold each patched layer's M and record (_write_record). A
    plain from_pretrained drops both (transformers lists them as unexpected keys) and loads the model
    without its prior; this one patches exactly the layers the weight files hold M for, each with its
    record's scale, mode and grid, and loads their M. An M without its record or a record without
    its M, or either for a layer the model lacks: a ValueError naming the layer. model_class: a model
    class (an Auto class works too, but transformers then lists the masks as unexpected before they
    are loaded)."""
    import json
    import pathlib
    import unittest.mock
    from safetensors import safe_open      # transformers' own checkpoint format
    if not pathlib.Path(path).is_dir():
        raise ValueError(f"{path}: maskprior.from_pretrained reads a directory written by save_pretrained "
                         f"(download a hub model first), got no such directory")
    # transformers would report the masks and records as unexpected keys: it ignores them for this
    # load alone (patch.object gives the class back as it was, with its own list or its parent's)
    ignored = [*(getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or ()), r"\.mask(_record)?$"]
    with unittest.mock.patch.object(model_class, "_keys_to_ignore_on_load_unexpected", ignored):
        model = model_class.from_pretrained(path, **kwargs)
    masks, records = {}, {}                           # the saved layer's name -> its M, its record
    for file in sorted(pathlib.Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as tensors:
            masks.update({key[:-5]: tensors.get_tensor(key) for key in tensors.keys() if key.endswith(".mask")})
            records.update({key[:-12]: json.loads(bytes(tensors.get_tensor(key).tolist()))
                            for key in tensors.keys() if key.endswith(".mask_record")})
    if not masks and not records:
        raise ValueError(f"{path} holds no mask prior: load it with {model_class.__name__}.from_pretrained")
    from transformers.core_model_loading import revert_weight_conversion
    prefix = model.base_model_prefix + "."            # the checkpoint may hold the model with a head or without
    found = _self_attention_layers(model, refuse=False)
    # each layer's M under the name save_pretrained gives it (a composite's renamed: Llava's
    # model.language_model.layers.0 is saved as language_model.model.layers.0), by the tensor's identity
    probes = {f"{layer[0]}.mask": torch.empty(0) for layer in found}
    renamed = {id(t): key[:-5] for key, t in revert_weight_conversion(model, dict(probes)).items()}
    layers = {saved: layer for layer, probe in zip(found, probes.values())
              for saved in (layer[0], prefix + layer[0], layer[0].removeprefix(prefix), renamed.get(id(probe)))}
    for saved in sorted(masks.keys() | records.keys()):
        if saved not in masks or saved not in records or saved not in layers:
            held = ("a record but no M" if saved not in masks else "an M but no record (scale, mode)"
                    if saved not in records else f"an M {tuple(masks[saved].shape)} but the {model_class.__name__} "
                    f"has no self-attention layer of that name")
            raise ValueError(f"{path}: the weight files hold {held} for layer {saved!r}")
        record = records[saved]
        _patch([layers[saved]], [masks[saved]], record["mode"], record["scale"], record.get("grid"), model)
    return model

def param_groups(model, weight_decay, mask_decay=0.0, mask_lr=None, decay_all=False):
    """Serves the prior's persistence under training, M kept out of weight decay: optimizer parameter
    groups, each trainable parameter once: weight matrices and embeddings
    (dim >= 2) decayed by weight_decay, but for the names that no_weight_decay() lists, of the model
    or of any module inside it (timm's pos_embed, cls_token; fnmatch patterns, as timm reads them);
    biases and norm gains not; every M (MaskedSelfAttention's and add_mask_prior's) by mask_decay
    alone. Weight decay pulls M toward 0, the neutral mask of Appendix A.1, and erases the prior;
    timm's create_optimizer_v2 and the HF Trainer decay M (its name lacks "bias"), as nanoGPT's
    configure_optimizers does (dim >= 2). mask_lr: M's own learning rate (the other groups take the
    optimizer's); decay_all: weight_decay on every parameter but M (aryol/GOTU's coupled Adam decay).
    For torch.optim (AdamW(groups, lr=...)), timm's create_optimizer_v2(groups, ...) and the HF
    Trainer's optimizers=(optimizer, None)."""
    import fnmatch
    # M by its name in its layer: the parameter `mask`, or the original a parametrization of it holds
    masks = {id(p) for m in model.modules() if isinstance(m, MaskedSelfAttention) or hasattr(m, "mask_prior_name")
             for name, p in m.named_parameters() if name == "mask" or name.startswith("parametrizations.mask.")}
    no_decay = [f"{prefix}.{pattern}" if prefix else pattern
                for prefix, module in model.named_modules() if callable(getattr(module, "no_weight_decay", None))
                for pattern in module.no_weight_decay()]
    decayed, kept, mask = ({"params": [], "weight_decay": decay} for decay in (weight_decay, 0.0, mask_decay))
    for name, p in model.named_parameters():
        if p.requires_grad:                   # each trainable parameter once: M, else decayed or kept
            decay = decay_all or p.dim() >= 2 and not any(fnmatch.fnmatchcase(name, pattern) for pattern in no_decay)
            (mask if id(p) in masks else decayed if decay else kept)["params"].append(p)
    if mask_lr:
        mask["lr"] = mask_lr
    return [group for group in (decayed, kept, mask) if group["params"]]
