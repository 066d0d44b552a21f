"""Declarations of recurrent arithmetic shared by the hybrid and state-space families (design
rule 4): what a layer that is not attention computes from token to token, with its state in the
sequence's `RecurrentState` (core/state.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import mlx.core as mx

from mlx_omnia.engine.core.binding import Declaration
from mlx_omnia.engine.core.mxcompat import reshape, silu
from mlx_omnia.engine.core.state import RecurrentState, StaticRecurrentState

State = RecurrentState | StaticRecurrentState
Activation = Literal["silu"]


class ShortConv(Declaration):
    """Causal depthwise convolution over time: channel c of output t is

        y[t, c] = sum_j weight[c, 0, j] * x[t - (K - 1) + j, c]  (+ bias[c]), j = 0 .. K-1

    (then `activation`), where inputs before the sequence's first token are zeros. `weight` is
    [channels, 1, K] as a torch Conv1d with groups = channels stores it. The state (`name` in the
    layer's RecurrentState) holds the last K - 1 inputs [B, K - 1, channels], oldest first, so a
    chunk or a single token continues where the one before stopped."""

    weight: mx.array
    bias: mx.array

    def __init__(
        self, channels: int, kernel_size: int, *, bias: bool = False,
        activation: Activation | None = None, name: str = "conv",
    ) -> None:
        super().__init__()
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self.name = name
        self.weight = mx.zeros((channels, 1, kernel_size))
        if bias:
            self.bias = mx.zeros((channels,))
        self._bound: Callable[[mx.array, State | None], mx.array] = self.reference()

    def reference(self) -> Callable[[mx.array, State | None], mx.array]:
        k = self.kernel_size

        def conv(x: mx.array, state: State | None) -> mx.array:
            b, length, c = x.shape
            before = state.get(self.name) if state is not None else None
            if before is None:
                before = mx.zeros((b, k - 1, c), x.dtype)
            window = mx.concatenate([before.astype(x.dtype), x], axis=1)  # [B, K-1+L, C]
            taps = self.weight[:, 0, :].astype(x.dtype)  # [C, K]
            y = window[:, 0:length] * taps[:, 0]
            for j in range(1, k):
                y = y + window[:, j : j + length] * taps[:, j]
            if "bias" in self:
                y = y + self.bias.astype(x.dtype)
            if state is not None:
                state.put(self.name, window[:, length:])
            return silu(y) if self.activation == "silu" else y

        return conv

    def __call__(self, x: mx.array, state: State | None) -> mx.array:
        return self._bound(x, state)


def _l2_normalized(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _pairwise_decay(cum: mx.array) -> mx.array:
    """exp(G_i - G_j) for j <= i, else 0: [..., n, n] from a chunk's cumulative log-decays
    G [..., n] (the exponent is masked first, so no exp of a growth above the diagonal)."""
    size = cum.shape[-1]
    lower = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    return mx.exp(mx.where(lower, cum[..., :, None] - cum[..., None, :], -mx.inf))


def _delta_inverse(k: mx.array, beta: mx.array, cum: mx.array) -> mx.array:
    """T^-1 [..., n, n] for GatedDeltaRule's T = I + strict_lower(beta_i k_i.k_j exp(G_i - G_j)),
    from k [..., n, d], beta and G [..., n] (n padded to a power of two with tokens of k =
    beta = 0, which leave the first n rows' inverse as it is): built from one-token blocks
    (T_tt = 1) by merging neighbouring pairs, [[A, 0], [C, B]]^-1 = [[A^-1, 0],
    [-B^-1 C A^-1, B^-1]], C the later half's rows against the earlier half's columns. Every
    block formed is a block of the true inverse, so nothing grows on the way (a power series
    (I - M)(I + M^2)(I + M^4)... is exact in theory, but with alike keys under a weak decay
    M's powers grow like binomials and cancel: 1e3 to 1e9 off in float32); G_i - G_j <= 0."""
    rows, d = k.shape[-2], k.shape[-1]
    lead = k.shape[:-2]
    n = 1 << max(rows - 1, 0).bit_length()
    if n != rows:
        extra = [(0, 0)] * len(lead)
        k = mx.pad(k, [*extra, (0, n - rows), (0, 0)])
        beta = mx.pad(beta, [*extra, (0, n - rows)])
        cum = mx.concatenate([cum, mx.repeat(cum[..., -1:], n - rows, axis=-1)], axis=-1)
    inverse = mx.ones((*lead, n, 1, 1), dtype=k.dtype)
    size = 1
    while size < n:
        pairs = n // (2 * size)
        ks = reshape(k, *lead, pairs, 2, size, d)
        gs = reshape(cum, *lead, pairs, 2, size)
        later_beta = reshape(beta, *lead, pairs, 2, size)[..., 1, :, None]
        decay = mx.exp(gs[..., 1, :, None] - gs[..., 0, None, :])
        cross = later_beta * (ks[..., 1, :, :] @ ks[..., 0, :, :].swapaxes(-1, -2)) * decay
        halves = reshape(inverse, *lead, pairs, 2, size, size)
        first, second = halves[..., 0, :, :], halves[..., 1, :, :]
        inverse = _lower_blocks(first, -(second @ cross) @ first, second)
        size *= 2
    return inverse[..., 0, :rows, :rows]


class GatedDeltaRule(Declaration):
    """The gated delta rule (Gated DeltaNet) over `value_heads` heads, each with a state
    S [key_dim, value_dim] (float32); key heads serve value_heads / key_heads value heads each.
    Token by token:

        q, k <- q / |q|, k / |k|  (l2, eps 1e-6);  q <- q / sqrt(key_dim)
        S    <- exp(g) S                           (g <= 0: the decay, in log space)
        S    <- S + k (beta (v - S^T k))^T         (v replaces what S recalled for k, by beta)
        o     = S^T q

    One token is that step. A longer call runs the chunked form, equal up to rounding: within
    a chunk of `chunk` tokens with cumulative decays G_i, the updates solve
    one unit lower triangular system T = I + strict_lower(beta_i k_i.k_j exp(G_i - G_j)),
    inverted block by block (`_delta_inverse`):
    U = T^-1 (beta v), W = T^-1 (beta k exp(G)); then per chunk, in order,
    v' = U - W S, o = exp(G) q S + lower(q_i.k_j exp(G_i - G_j)) v', and
    S <- exp(G_last) S + (k exp(G_last - G))^T v'.
    Inputs q, k [B, L, key_heads, key_dim], v [B, L, value_heads, value_dim], g and beta
    [B, L, value_heads]; the output [B, L, value_heads, value_dim] in v's dtype. The state is
    `name` in the layer's RecurrentState."""

    def __init__(
        self, *, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
        chunk: int = 64, name: str = "recurrent",
    ) -> None:
        super().__init__()
        if value_heads % key_heads:
            raise ValueError(f"{value_heads} value heads do not group over {key_heads} key heads")
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.chunk = chunk
        self.name = name
        self._bound: Callable[..., mx.array] = self.reference()

    def reference(self) -> Callable[..., mx.array]:
        repeats = self.value_heads // self.key_heads

        def rule(
            q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
            state: State | None,
        ) -> mx.array:
            b, length = v.shape[:2]
            f32 = mx.float32
            q = _l2_normalized(q.astype(f32)) * self.key_dim**-0.5
            k = _l2_normalized(k.astype(f32))
            if repeats > 1:
                q, k = mx.repeat(q, repeats, axis=2), mx.repeat(k, repeats, axis=2)
            # heads first: [B, H, L, d] and [B, H, L]
            q, k, vf = q.swapaxes(1, 2), k.swapaxes(1, 2), v.astype(f32).swapaxes(1, 2)
            g, beta = g.astype(f32).swapaxes(1, 2), beta.astype(f32).swapaxes(1, 2)
            s = state.get(self.name) if state is not None else None
            if s is None:
                s = mx.zeros((b, self.value_heads, self.key_dim, self.value_dim), f32)
            if length == 1:
                out, s = _delta_step(q[:, :, 0], k[:, :, 0], vf[:, :, 0], g[:, :, 0], beta[:, :, 0], s)
                out = out[:, :, None]
            else:
                out, s = self._chunked(q, k, vf, g, beta, s)
            if state is not None:
                state.put(self.name, s)
            return out.swapaxes(1, 2).astype(v.dtype)

        return rule

    def _chunked(
        self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, s: mx.array
    ) -> tuple[mx.array, mx.array]:
        b, h, length, _ = q.shape
        c = self.chunk
        pad = -length % c
        if pad:  # padded tokens: k = v = beta = 0 and no decay, so they change nothing
            q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
            g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))
        n = (length + pad) // c
        q, k, v = (reshape(x, b, h, n, c, x.shape[-1]) for x in (q, k, v))
        g, beta = reshape(g, b, h, n, c), reshape(beta, b, h, n, c)
        cum = mx.cumsum(g, axis=-1)  # G_i
        decay = _pairwise_decay(cum)
        kb = k * beta[..., None]
        inverse = _delta_inverse(k, beta, cum)
        u = inverse @ (v * beta[..., None])
        w = inverse @ (kb * mx.exp(cum)[..., None])
        q_decayed = q * mx.exp(cum)[..., None]
        intra = (q @ k.swapaxes(-1, -2)) * decay
        last = cum[..., -1:]
        k_decayed = k * mx.exp(last - cum)[..., None]
        chunk_decay = mx.exp(last)[..., None]  # [B, H, N, 1, 1]
        outs: list[mx.array] = []
        for i in range(n):
            fresh = u[:, :, i] - w[:, :, i] @ s
            outs.append(q_decayed[:, :, i] @ s + intra[:, :, i] @ fresh)
            s = s * chunk_decay[:, :, i] + k_decayed[:, :, i].swapaxes(-1, -2) @ fresh
        out = mx.concatenate(outs, axis=2)[:, :, :length]
        return out, s

    def __call__(
        self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
        state: State | None,
    ) -> mx.array:
        return self._bound(q, k, v, g, beta, state)


def _delta_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, s: mx.array
) -> tuple[mx.array, mx.array]:
    """One token of the gated delta rule: q, k [B, H, dk], v [B, H, dv], g, beta [B, H],
    s [B, H, dk, dv] -> (o [B, H, dv], the new s)."""
    s = s * mx.exp(g)[..., None, None]
    recalled = (k[..., None, :] @ s)[..., 0, :]  # S^T k
    delta = (v - recalled) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :], s


class ChannelGatedDeltaRule(Declaration):
    """The gated delta rule with a decay per key channel (Kimi Delta Attention, KDA) over
    `heads` heads, each with a state S [key_dim, value_dim] (float32). Token by token:

        q, k <- q / |q|, k / |k|  (l2, eps 1e-6);  q <- q / sqrt(key_dim)
        S    <- diag(exp(g)) S                     (g [key_dim] <= 0: row c decays by exp(g_c))
        S    <- S + k (beta (v - S^T k))^T         (v replaces what S recalled for k, by beta)
        o     = S^T q

    One token is that step. A longer call runs the chunked form, equal up to rounding: within
    a chunk of `chunk` tokens (a power of two; a shorter call takes the power of two that holds
    it) with cumulative decays G_t [key_dim], the updates solve one unit lower triangular
    system T = I + strict_lower(beta_t P(k)_tj), P(x)_tj = sum_c x_tc k_jc exp(G_tc - G_jc):
    U = T^-1 (beta v), W = T^-1 (beta k exp(G)); then per chunk, in order, v' = U - W S,
    o = (q exp(G)) S + lower(P(q)) v', S <- exp(G_last) S + (k exp(G_last - G))^T v'.
    P and T^-1 are built together from one-token blocks up, pairs of neighbouring blocks
    merging log2(chunk) times: the later block's rows against the earlier block's columns are
    one matrix product through the later block's first token r, (x_t exp(G_t - G_r)) .
    (k_j exp(G_r - G_j)), both factors at most 1 (no exponent grows however strong the decay);
    T^-1 of the pair is [[A, 0], [-D C A, D]] from its blocks' inverses A, D and T's block C.
    Every inverse formed is a block of T^-1 itself, so nothing grows past T^-1's own entries
    (a power series of T's nilpotent part would: its powers grow like binomials where the keys
    of a chunk are alike and the decay is weak, then cancel, and float32 loses everything).
    Inputs q, k [B, L, heads, key_dim], v [B, L, heads, value_dim], g [B, L, heads, key_dim],
    beta [B, L, heads]; the output [B, L, heads, value_dim] in v's dtype. The state is `name`
    in the layer's RecurrentState."""

    def __init__(
        self, *, heads: int, key_dim: int, value_dim: int, chunk: int = 64,
        name: str = "recurrent",
    ) -> None:
        super().__init__()
        if chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"chunk {chunk} is not a power of two")
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        self.chunk = chunk
        self.name = name
        self._bound: Callable[..., mx.array] = self.reference()

    def reference(self) -> Callable[..., mx.array]:
        def rule(
            q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
            state: State | None,
        ) -> mx.array:
            b, length = v.shape[:2]
            f32 = mx.float32
            q = _l2_normalized(q.astype(f32)) * self.key_dim**-0.5
            k = _l2_normalized(k.astype(f32))
            # heads first: [B, H, L, d] and [B, H, L]
            q, k, vf, gf = (x.swapaxes(1, 2) for x in (q, k, v.astype(f32), g.astype(f32)))
            beta = beta.astype(f32).swapaxes(1, 2)
            s = state.get(self.name) if state is not None else None
            if s is None:
                s = mx.zeros((b, self.heads, self.key_dim, self.value_dim), f32)
            if length == 1:
                out, s = _channel_delta_step(
                    q[:, :, 0], k[:, :, 0], vf[:, :, 0], gf[:, :, 0], beta[:, :, 0], s
                )
                out = out[:, :, None]
            else:
                size = min(self.chunk, 1 << (length - 1).bit_length())
                out, s = _channel_chunked(q, k, vf, gf, beta, s, size)
            if state is not None:
                state.put(self.name, s)
            return out.swapaxes(1, 2).astype(v.dtype)

        return rule

    def __call__(
        self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
        state: State | None,
    ) -> mx.array:
        return self._bound(q, k, v, g, beta, state)


def _channel_chunked(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, s: mx.array, size: int
) -> tuple[mx.array, mx.array]:
    """ChannelGatedDeltaRule's chunked form: q, k, g [B, H, L, dk], v [B, H, L, dv], beta
    [B, H, L] (float32, q and k normed), s [B, H, dk, dv]; chunks of `size`, a power of two."""
    b, h, length, _ = q.shape
    pad = -length % size
    if pad:  # padded tokens: k = v = beta = 0 and no decay, so they change nothing
        q, k, v, g = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v, g))
        beta = mx.pad(beta, [(0, 0), (0, 0), (0, pad)])
    n = (length + pad) // size
    q, k, v, g = (reshape(x, b, h, n, size, x.shape[-1]) for x in (q, k, v, g))
    beta = reshape(beta, b, h, n, size)
    cum = mx.cumsum(g, axis=-2)  # G_t [B, H, N, size, dk]
    intra, inverse = _channel_blocks(q, k, beta, cum)
    decay = mx.exp(cum)
    u = inverse @ (v * beta[..., None])
    w = inverse @ (k * beta[..., None] * decay)
    q_decayed = q * decay
    last = cum[..., -1:, :]  # G_last [B, H, N, 1, dk]
    k_decayed = k * mx.exp(last - cum)
    chunk_decay = mx.exp(last).swapaxes(-1, -2)  # [B, H, N, dk, 1]: S's rows
    outs: list[mx.array] = []
    for i in range(n):
        fresh = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_decayed[:, :, i] @ s + intra[:, :, i] @ fresh)
        s = s * chunk_decay[:, :, i] + k_decayed[:, :, i].swapaxes(-1, -2) @ fresh
    return mx.concatenate(outs, axis=2)[:, :, :length], s


def _channel_blocks(
    q: mx.array, k: mx.array, beta: mx.array, cum: mx.array
) -> tuple[mx.array, mx.array]:
    """(lower(P(q)), T^-1) [..., n, n] of ChannelGatedDeltaRule's docstring, from q, k and the
    cumulative log-decays G [..., n, d] and beta [..., n], n a power of two: both built from
    one-token blocks (P(q)_tt = q_t . k_t, T_tt = 1) by merging neighbouring pairs."""
    n, d = k.shape[-2], k.shape[-1]
    lead = k.shape[:-2]
    products = (q * k).sum(axis=-1)[..., None, None]  # [..., n, 1, 1]
    inverses = mx.ones((*lead, n, 1, 1), dtype=k.dtype)
    size = 1
    while size < n:
        pairs = n // (2 * size)
        qs, ks, gs = (reshape(t, *lead, pairs, 2, size, d) for t in (q, k, cum))
        ref = gs[..., 1, :1, :]  # G_r at the later block's first token, [..., pairs, 1, d]
        into_later = mx.exp(gs[..., 1, :, :] - ref)
        earlier = (ks[..., 0, :, :] * mx.exp(ref - gs[..., 0, :, :])).swapaxes(-1, -2)
        cross_q = (qs[..., 1, :, :] * into_later) @ earlier  # P(q), later rows x earlier columns
        cross_t = reshape(beta, *lead, pairs, 2, size)[..., 1, :, None] * (
            (ks[..., 1, :, :] * into_later) @ earlier
        )  # T's block there
        p_halves = reshape(products, *lead, pairs, 2, size, size)
        i_halves = reshape(inverses, *lead, pairs, 2, size, size)
        first, second = i_halves[..., 0, :, :], i_halves[..., 1, :, :]
        products = _lower_blocks(p_halves[..., 0, :, :], cross_q, p_halves[..., 1, :, :])
        inverses = _lower_blocks(first, -(second @ cross_t) @ first, second)
        size *= 2
    return products[..., 0, :, :], inverses[..., 0, :, :]


def _lower_blocks(top: mx.array, cross: mx.array, bottom: mx.array) -> mx.array:
    """[[top, 0], [cross, bottom]] from three [..., s, s] blocks: [..., 2 s, 2 s]."""
    upper = mx.concatenate([top, mx.zeros_like(cross)], axis=-1)
    return mx.concatenate([upper, mx.concatenate([cross, bottom], axis=-1)], axis=-2)


def _channel_delta_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, s: mx.array
) -> tuple[mx.array, mx.array]:
    """One token of ChannelGatedDeltaRule: q, k, g [B, H, dk], v [B, H, dv], beta [B, H],
    s [B, H, dk, dv] -> (o [B, H, dv], the new s)."""
    s = s * mx.exp(g)[..., :, None]
    recalled = (k[..., None, :] @ s)[..., 0, :]  # S^T k
    delta = (v - recalled) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :], s


class SelectiveScan(Declaration):
    """Mamba-2's selective state space scan (state space duality), per head h with a state
    S [head_dim, state_size] (float32) and a scalar decay A_h < 0; B and C come in `groups`, each
    serving heads / groups heads. Token by token:

        S <- exp(dt A) S + dt x B^T       (x [head_dim], B [state_size], dt > 0 a step size)
        y  = S C + D x

    One token is that step. A longer call runs the chunked form, equal up to rounding: within a
    chunk of `chunk` tokens with cumulative log-decays G_i = sum_{j<=i} dt_j A,
    y_i = sum_{j<=i} (C_i . B_j) exp(G_i - G_j) dt_j x_j + exp(G_i) S C_i + D x_i, and the state
    after it is exp(G_last) S + sum_j exp(G_last - G_j) dt_j x_j B_j^T. Inputs x [B, L, heads,
    head_dim], dt [B, L, heads] (after its softplus), A and D [heads], B and C [B, L, groups,
    state_size]; the output [B, L, heads, head_dim] in x's dtype. The state is `name` in the
    layer's RecurrentState."""

    def __init__(
        self, *, heads: int, head_dim: int, state_size: int, groups: int, chunk: int = 64,
        name: str = "ssm",
    ) -> None:
        super().__init__()
        if heads % groups:
            raise ValueError(f"{heads} heads do not group over {groups} groups")
        self.heads, self.head_dim, self.state_size, self.groups = heads, head_dim, state_size, groups
        self.chunk = chunk
        self.name = name
        self._bound: Callable[..., mx.array] = self.reference()

    def reference(self) -> Callable[..., mx.array]:
        repeats = self.heads // self.groups

        def scan(
            x: mx.array, dt: mx.array, a: mx.array, b: mx.array, c: mx.array, d: mx.array,
            state: State | None,
        ) -> mx.array:
            batch, length = x.shape[:2]
            f32 = mx.float32
            if repeats > 1:
                b, c = mx.repeat(b, repeats, axis=2), mx.repeat(c, repeats, axis=2)
            # heads first: [B, H, L, *] and [B, H, L]
            xf, bf, cf = (t.astype(f32).swapaxes(1, 2) for t in (x, b, c))
            dtf = dt.astype(f32).swapaxes(1, 2)
            log_decay = dtf * a.astype(f32)[:, None]  # dt A, [B, H, L]
            s = state.get(self.name) if state is not None else None
            if s is None:
                s = mx.zeros((batch, self.heads, self.head_dim, self.state_size), f32)
            if length == 1:
                s = (mx.exp(log_decay[:, :, 0])[..., None, None] * s
                     + (dtf[:, :, 0, None] * xf[:, :, 0])[..., :, None] * bf[:, :, 0, None, :])
                y = (s @ cf[:, :, 0, :, None])[..., 0][:, :, None]
            else:
                y, s = self._chunked(xf * dtf[..., None], log_decay, bf, cf, s)
            if state is not None:
                state.put(self.name, s)
            y = y + d.astype(f32)[:, None, None] * xf
            return y.swapaxes(1, 2).astype(x.dtype)

        return scan

    def _chunked(
        self, xd: mx.array, log_decay: mx.array, b: mx.array, c: mx.array, s: mx.array
    ) -> tuple[mx.array, mx.array]:
        """xd = dt x [B, H, L, P], log_decay [B, H, L], b, c [B, H, L, N], s [B, H, P, N]."""
        batch, heads, length, _ = xd.shape
        size = self.chunk
        pad = -length % size
        if pad:  # padded tokens: dt = 0, so no input and no decay
            xd, b, c = (mx.pad(t, [(0, 0), (0, 0), (0, pad), (0, 0)]) for t in (xd, b, c))
            log_decay = mx.pad(log_decay, [(0, 0), (0, 0), (0, pad)])
        n = (length + pad) // size
        xd, b, c = (reshape(t, batch, heads, n, size, t.shape[-1]) for t in (xd, b, c))
        cum = mx.cumsum(reshape(log_decay, batch, heads, n, size), axis=-1)  # G_i
        within = ((c @ b.swapaxes(-1, -2)) * _pairwise_decay(cum)) @ xd  # [B, H, n, size, P]
        into = mx.exp(cum)[..., None]  # the carried state's decay to each token
        last = cum[..., -1:]
        xd_out = xd * mx.exp(last - cum)[..., None]  # each token's decay to the chunk's end
        chunk_decay = mx.exp(last)[..., None]  # [B, H, n, 1, 1]
        outs: list[mx.array] = []
        for i in range(n):
            outs.append(within[:, :, i] + into[:, :, i] * (c[:, :, i] @ s.swapaxes(-1, -2)))
            s = s * chunk_decay[:, :, i] + xd_out[:, :, i].swapaxes(-1, -2) @ b[:, :, i]
        return mx.concatenate(outs, axis=2)[:, :, :length], s

    def __call__(
        self, x: mx.array, dt: mx.array, a: mx.array, b: mx.array, c: mx.array, d: mx.array,
        state: State | None,
    ) -> mx.array:
        return self._bound(x, dt, a, b, c, d, state)


class DiagonalSelectiveScan(Declaration):
    """Mamba-1's selective scan: each of `channels` channels c has a state row S_c [state_size]
    (float32) with decays of its own, A [channels, state_size] (< 0), and a step size dt_c a
    token; B and C [state_size] come a token, shared by every channel. Token by token:

        S_c <- exp(dt_c A_c) * S_c + dt_c x_c B      (* elementwise over the state)
        y_c  = S_c . C + D_c x_c

    One token is that step. A longer call runs in chunks of `chunk` tokens: the carried state
    is folded into the chunk's first input, then the recurrence h_t = a_t h_{t-1} + u_t with
    (a_t, u_t) = (exp(dt_t A), dt_t x_t B) runs as a parallel scan (neighbours combined pairwise,
    2 log2(chunk) rounds of elementwise products): every decay a product of factors in (0, 1],
    so no exponent grows; equal up to rounding. Inputs x and dt [B, L, channels] (dt after its
    softplus), A [channels, state_size], B and C [B, L, state_size], D [channels]; the output
    [B, L, channels] in x's dtype. The state is `name` in the layer's RecurrentState."""

    def __init__(self, *, channels: int, state_size: int, chunk: int = 128, name: str = "ssm") -> None:
        super().__init__()
        self.channels, self.state_size = channels, state_size
        self.chunk = chunk
        self.name = name
        self._bound: Callable[..., mx.array] = self.reference()

    def reference(self) -> Callable[..., mx.array]:
        def scan(
            x: mx.array, dt: mx.array, a: mx.array, b: mx.array, c: mx.array, d: mx.array,
            state: State | None,
        ) -> mx.array:
            batch, length, _ = x.shape
            f32 = mx.float32
            xf, dtf, bf, cf = (t.astype(f32) for t in (x, dt, b, c))
            af = a.astype(f32)
            s = state.get(self.name) if state is not None else None
            if s is None:
                s = mx.zeros((batch, self.channels, self.state_size), f32)
            if length == 1:
                s = (mx.exp(dtf[:, 0, :, None] * af) * s
                     + (dtf[:, 0] * xf[:, 0])[:, :, None] * bf[:, 0, None, :])
                y = (s @ cf[:, 0, :, None])[..., 0][:, None]
            else:
                y, s = self._chunked(xf, dtf, af, bf, cf, s)
            if state is not None:
                state.put(self.name, s)
            return (y + d.astype(f32) * xf).astype(x.dtype)

        return scan

    def _chunked(
        self, x: mx.array, dt: mx.array, a: mx.array, b: mx.array, c: mx.array, s: mx.array
    ) -> tuple[mx.array, mx.array]:
        """x, dt [B, L, C], a [C, N], b, c [B, L, N], s [B, C, N] (all float32)."""
        outs: list[mx.array] = []
        for start in range(0, x.shape[1], self.chunk):
            end = min(start + self.chunk, x.shape[1])
            step = dt[:, start:end, :, None]  # [B, n, C, 1]
            decay = mx.exp(step * a)  # a_t [B, n, C, N]
            inputs = (step * x[:, start:end, :, None]) * b[:, start:end, None, :]  # u_t
            inputs = mx.concatenate([inputs[:, :1] + decay[:, :1] * s[:, None], inputs[:, 1:]], 1)
            states = _linear_scan(decay, inputs)  # h_t [B, n, C, N]
            outs.append((states @ c[:, start:end, :, None])[..., 0])
            s = states[:, -1]
        return mx.concatenate(outs, axis=1), s

    def __call__(
        self, x: mx.array, dt: mx.array, a: mx.array, b: mx.array, c: mx.array, d: mx.array,
        state: State | None,
    ) -> mx.array:
        return self._bound(x, dt, a, b, c, d, state)


def _linear_scan(decay: mx.array, inputs: mx.array) -> mx.array:
    """h_t = decay_t * h_{t-1} + inputs_t along axis 1, from h_{-1} = 0, as a work-efficient
    parallel scan: pairs of neighbours (2k, 2k+1) combine into one step (decay_{2k+1} decay_2k,
    decay_{2k+1} inputs_2k + inputs_{2k+1}), the half-length recurrence gives h at the odd
    tokens, and each even token is one step on from the odd one before it. About twice the
    sequential work, 2 log2(length) rounds."""
    length = decay.shape[1]
    if length == 1:
        return inputs
    if length % 2:  # a last step that keeps h as it is: decay 1, input 0
        decay = mx.concatenate([decay, mx.ones_like(decay[:, :1])], axis=1)
        inputs = mx.concatenate([inputs, mx.zeros_like(inputs[:, :1])], axis=1)
    pairs = (decay.shape[0], decay.shape[1] // 2, 2, *decay.shape[2:])
    a, u = reshape(decay, *pairs), reshape(inputs, *pairs)
    a_even, a_odd, u_even, u_odd = a[:, :, 0], a[:, :, 1], u[:, :, 0], u[:, :, 1]
    odd = _linear_scan(a_odd * a_even, a_odd * u_even + u_odd)
    even = mx.concatenate([u_even[:, :1], u_even[:, 1:] + a_even[:, 1:] * odd[:, :-1]], axis=1)
    return reshape(mx.stack([even, odd], axis=2), *decay.shape)[:, :length]
