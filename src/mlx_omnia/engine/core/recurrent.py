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


def _unit_lower_inverse(strict: mx.array, size: int) -> mx.array:
    """(I + M)^-1 for strictly lower-triangular M [..., n, n]. M is nilpotent (M^n = 0), so
    with X = -M the inverse is sum_{k<n} X^k = prod_j (I + X^(2^j)) over 2^j < n: about
    2 log2(n) matrix products instead of n steps of forward substitution."""
    eye = mx.eye(size, dtype=strict.dtype)
    power = -strict
    inverse = eye + power
    reach = 2
    while reach < size:
        power = power @ power
        inverse = inverse @ (eye + power)
        reach *= 2
    return inverse


class GatedDeltaRule(Declaration):
    """The gated delta rule (Gated DeltaNet) over `value_heads` heads, each with a state
    S [key_dim, value_dim] (float32); key heads serve value_heads / key_heads value heads each.
    Token by token:

        q, k <- q / |q|, k / |k|  (l2, eps 1e-6);  q <- q / sqrt(key_dim)
        S    <- exp(g) S                           (g <= 0: the decay, in log space)
        S    <- S + k (beta (v - S^T k))^T         (v replaces what S recalled for k, by beta)
        o     = S^T q

    One token is that step. A longer call runs the chunked form, equal up to rounding: within
    a chunk of `chunk` tokens with cumulative decays G_i, the updates solve one unit lower
    triangular system T = I + strict_lower(beta_i k_i.k_j exp(G_i - G_j)):
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
        below = mx.tril(mx.ones((c, c), dtype=mx.bool_), k=-1)
        strict = mx.where(below, (kb @ k.swapaxes(-1, -2)) * decay, 0.0)
        inverse = _unit_lower_inverse(strict, c)
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
