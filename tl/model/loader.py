"""Loading Hugging Face tensors into the step layout: one `WeightLoader`, each step a method.

Owns: turning a model's Hugging Face tensors ([out, in] linears; float arrays, or `Packed`
blocks read from a GGUF) into tl/model/llama.py's `Weights` on the host (numpy; a matrix that
needs no fusing or conversion is the tensor itself, not a copy), in named steps: read a tensor
as stored or as float (`source`, `get`, `norm`), choose its encoding (`encoding`: the
configured one, or with "auto" the one its file stores), declare its tensor-parallel axes
(`row_axes` and the column axes written where each linear is built), encode it (`encode`,
`linear`: the file's bytes kept where they are already in that block format, else the float
matrix encoded; `fuse_qkv`, `fuse_gate_up` and `stack_experts` fuse tensors into one linear
first), and build a layer (`attention`, `mlp`, `experts`: tl/model/moe.py's `Experts` from
the per-expert tensors, `layer`) and the whole (`weights`). `load_weights` and `load_params`
are the entry points.
Must not: place arrays on devices (tl/runtime/placement.py does), compute anything of the
forward. Tested by tests/model/test_llama_reference.py (the loaded layout against an independent
numpy forward), tests/model/test_blocks.py (packed and quantized-at-load weights), tests/model/test_int8.py,
tests/model/test_moe.py (experts: float, quantized, packed, mixed formats, tensor-parallel axes) and
tests/runtime/test_backend.py (tensor-parallel axes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from tl.model.config import ModelConfig, ModelDirError, hf_shapes, load_model_config
from tl.model.files import HostTensor, read_tensors
from tl.model.gguf_model import Packed
from tl.model.llama import Layer, Weights
from tl.model.moe import Experts
from tl.model.weights import ENCODINGS, Axes, Bf16x3, Blocks, Dense, Linear, Table, Tensor

EncodingName = str
"""The linears' encoding, by its name in tl/model/weights.py ENCODINGS: "float32" (weights as
stored), "int8" (per-output-channel symmetric quantization), "q8_0", "q4_1", "q4_k", ... (llama.cpp's
block formats), "bf16x3" (float32 with its AMX packing: matmul_precision "high"), or "auto"
(each tensor as its file stores it). (tl/core/config.py `WeightDType` is the configured
weight_dtype, the subset of these an engine config may name.)"""
COL = "model"
"""The mesh axis tensor parallelism splits weights over."""
Fuse = Callable[..., np.ndarray]
"""Arrays of the named tensors (float, or their packed bytes) -> the one array of their linear."""


def fuse_qkv(wq: Any, wk: Any, wv: Any, cfg: ModelConfig) -> Any:
    """[Hq*hd, ...], [Hk*hd, ...] x2 -> [Hk, G+2, hd, ...] grouped by KV head (numpy).

    Group g is [query heads g*G .. g*G+G-1 | k head g | v head g] (query head h reads KV head
    h // G, as in the attention kernels): the Hk axis is what tensor parallelism splits.
    """
    tail, hk, hd = wq.shape[1:], cfg.num_key_value_heads, cfg.head_dim
    return np.concatenate(
        [wq.reshape(hk, -1, hd, *tail), wk.reshape(hk, 1, hd, *tail), wv.reshape(hk, 1, hd, *tail)], axis=1
    )


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[F, ...] x2 -> [F, 2, ...]: gate and up rows interleaved (llama.py says why)."""
    return np.stack([gate, up], axis=1)


def stack_experts(*ws: np.ndarray, groups: int = 1) -> np.ndarray:
    """`groups` runs of E per-expert [out, ...] arrays -> [E, out, ...] (one run: downs) or
    [E, out, groups, ...] (gates then ups: each expert's gate and up rows interleaved, as the
    dense layer's [F, 2, D])."""
    n = len(ws) // groups
    per = [np.stack(ws[g * n : (g + 1) * n]) for g in range(groups)]  # each [E, out, in]
    return per[0] if groups == 1 else np.stack(per, axis=2)


def _one(w: np.ndarray) -> np.ndarray:
    return w


def _for_experts(enc: type[Linear] | None) -> type[Linear]:
    """Experts' encoding: `Dense` where their tensors' formats differ (None) or for bf16x3."""
    return Dense if enc is None or enc is Bf16x3 else enc


class WeightLoader:
    """One model's tensors and how to load them: `weights()` builds the step layout; each step
    is a method that tl/model/moe.py's experts reuse as the dense layers do.

    weight_dtype: every linear's encoding (`EncodingName`), which also says how the embedding
    and LM head are kept (its `table`) and what the LM head needs beside them (`head_packing`:
    bf16x3's packing as `head_packed`; embed and lm_head then stay float32); "auto": each as its
    file stores it (packed blocks kept as they are, float as `dtype`). Where q, k and v (or gate
    and up) are stored in different formats they are not fused: wq/wk/wv (w_gate/w_up) apart.
    kv_sharded False (tensor parallel over more devices than divide the KV heads): wq/wk/wv
    kept apart, k/v whole. vocab_sharded False: embed and lm_head whole. tensor_parallel: the
    degree, for the row-parallel wo and w_down: split by input only where every device gets
    whole blocks of the encoding's `in_block` (32 or 256 for the block formats; always for the
    others), else whole (XLA then gathers their input and runs the whole dot on each device).
    A matrix whose input axis is not a multiple of `in_block` is refused, naming it.
    """

    def __init__(
        self,
        tensors: Mapping[str, HostTensor],
        cfg: ModelConfig,
        dtype: Any = np.float32,
        weight_dtype: EncodingName = "float32",
        *,
        kv_sharded: bool = True,
        vocab_sharded: bool = True,
        tensor_parallel: int = 1,
    ) -> None:
        if weight_dtype != "auto" and weight_dtype not in ENCODINGS:
            raise ValueError(f"weight_dtype must be auto or one of {', '.join(ENCODINGS)}, got {weight_dtype!r}")
        self.tensors, self.cfg, self.dtype, self.weight_dtype = tensors, cfg, dtype, weight_dtype
        self.kv_sharded, self.vocab_sharded, self.tensor_parallel = kv_sharded, vocab_sharded, tensor_parallel
        self.shapes = hf_shapes(cfg)

    # ---- reading ----

    def source(self, name: str) -> HostTensor:
        """The tensor as stored (float, or `Packed`), its shape checked against the config."""
        if name not in self.tensors:
            raise ModelDirError(f"weights: missing tensor {name!r}")
        x = self.tensors[name]
        x = x if isinstance(x, Packed) else np.asarray(x)
        if tuple(x.shape) != self.shapes[name]:
            raise ModelDirError(f"weights: tensor {name!r} has shape {x.shape}, expected {self.shapes[name]}")
        return x

    def get(self, name: str) -> np.ndarray:
        """The tensor as float in `dtype` (packed blocks dequantized)."""
        x = self.source(name)
        x = x.to_float() if isinstance(x, Packed) else x
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def norm(self, name: str) -> Tensor:
        """An RMSNorm's multiplier: the weight, plus 1 for Gemma's (1 + w) (in float32, as HF)."""
        w = self.get(name)
        if self.cfg.norm_offset:
            w = (w.astype(np.float32) + np.float32(self.cfg.norm_offset)).astype(self.dtype)
        return Tensor(w, (None,))

    # ---- encoding ----

    def encoding(self, *names: str) -> type[Linear] | None:
        """weight_dtype's, or with "auto" the format the tensors are stored in (None: they differ)."""
        if self.weight_dtype != "auto":
            return ENCODINGS[self.weight_dtype]
        kinds = {x.format if isinstance(x := self.source(n), Packed) else "float32" for n in names}
        return ENCODINGS[kinds.pop()] if len(kinds) == 1 else None

    def row_axes(self, name: str) -> Axes:
        """A row-parallel weight's axes: [out, in] split by in, at block boundaries only."""
        enc = self.encoding(name)
        assert enc is not None  # one tensor has one format
        return (None, COL if (self.shapes[name][-1] // enc.in_block) % self.tensor_parallel == 0 else None)

    def encode(
        self, enc: type[Linear], names: tuple[str, ...], axes: Axes, fuse: Fuse = _one, table: bool = False
    ) -> Any:
        """The linear of these tensors (fused by `fuse`) in `enc`: the file's bytes where every
        one is packed in enc's block format, else their float matrix encoded; `table`: as an
        embedding / LM head is kept (the encoding's `table`)."""
        srcs = [self.source(n) for n in names]
        if issubclass(enc, Blocks) and all(isinstance(x, Packed) and x.format == enc.fmt.name for x in srcs):
            return enc(fuse(*(x.data for x in srcs if isinstance(x, Packed))), axes)  # the file's bytes
        w = fuse(*(self.get(n) for n in names))
        if w.shape[-1] % enc.in_block:
            raise ModelDirError(
                f"weights: tensor {names[0]!r} of shape {w.shape}: {enc.__name__} stores blocks of "
                f"{enc.in_block} inputs, and its input axis ({w.shape[-1]}) is not a multiple"
            )
        return enc.table(w, axes) if table else enc.encode(w, axes)

    def linear(self, names: tuple[str, ...], axes: Axes, fuse: Fuse = _one, table: bool = False) -> Any:
        """`encode` in the tensors' `encoding` (they share one)."""
        enc = self.encoding(*names)
        assert enc is not None, names
        return self.encode(enc, names, axes, fuse, table)

    # ---- a layer ----

    def attention(self, i: int) -> dict[str, Any]:
        """Layer i's q, k, v projections: fused wqkv (+ bqkv) where the KV heads are sharded and
        q, k and v share an encoding, else wq, wk, wv (+ biases) apart."""
        a = f"model.layers.{i}.self_attn."
        q, k, v = (a + f"{n}_proj.weight" for n in "qkv")
        if self.kv_sharded and self.encoding(q, k, v) is not None:
            fuse = functools.partial(fuse_qkv, cfg=self.cfg)
            out: dict[str, Any] = {"wqkv": self.linear((q, k, v), (COL, None, None, None), fuse)}
            if self.cfg.attention_bias:
                bq, bk, bv = (self.get(a + f"{n}_proj.bias") for n in "qkv")
                out["bqkv"] = Tensor(fuse_qkv(bq, bk, bv, self.cfg), (COL, None, None))
            return out
        kv_axis = COL if self.kv_sharded else None
        out = {"wq": self.linear((q,), (COL, None))}
        out |= {"wk": self.linear((k,), (kv_axis, None)), "wv": self.linear((v,), (kv_axis, None))}
        if self.cfg.attention_bias:
            out |= {"bq": Tensor(self.get(a + "q_proj.bias"), (COL,))}
            out |= {n: Tensor(self.get(a + f"{n[1]}_proj.bias"), (kv_axis,)) for n in ("bk", "bv")}
        return out

    def mlp(self, i: int) -> dict[str, Any]:
        """Layer i's MLP: its experts (a MoE layer), else gate-up [F,2,D] fused where gate and
        up share an encoding (w_gate and w_up apart where not), and w_down."""
        if self.cfg.is_moe(i):
            return {"moe": self.experts(i)}
        gate, up, down = (f"model.layers.{i}.mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
        if self.encoding(gate, up) is not None:  # [F,2,D]
            out = {"w_gate_up": self.linear((gate, up), (COL, None, None), fuse_gate_up)}
        else:
            out = {"w_gate": self.linear((gate,), (COL, None)), "w_up": self.linear((up,), (COL, None))}
        return out | {"w_down": self.linear((down,), self.row_axes(down))}

    def experts(self, i: int) -> Experts:
        """Layer i's experts from its per-expert tensors: gate-up [E,Fm,2,D] column-parallel on
        Fm, down [E,D,Fm] row-parallel where whole blocks fall on each device, the router [E,D]
        float32 and whole. Packed experts that all share the encoding's block format are stacked
        as the file's bytes; mixed formats are dequantized to float (`Dense`). bf16x3 (a native
        AMX packing for the dense layers) keeps experts as `Dense`."""
        p = f"model.layers.{i}.mlp."
        gates, ups, downs = (
            tuple(f"{p}experts.{e}.{n}_proj.weight" for e in range(self.cfg.num_experts))
            for n in ("gate", "up", "down")
        )
        gate_up_enc = _for_experts(self.encoding(*gates, *ups))
        interleave = functools.partial(stack_experts, groups=2)
        gate_up = self.encode(gate_up_enc, gates + ups, (COL, None, None, None), interleave)
        down_enc = self.encoding(*downs)
        fm = self.cfg.moe_intermediate_size
        split = down_enc is not None and (fm // down_enc.in_block) % self.tensor_parallel == 0
        down = self.encode(_for_experts(down_enc), downs, (None, None, COL if split else None), stack_experts)
        router = Tensor(np.asarray(self.get(p + "gate.weight"), np.float32), (None, None))
        return Experts(router, gate_up, down, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)

    def layer(self, i: int) -> Layer:
        """Layer i: its norms (Gemma's four; Qwen3's and Gemma's per-head q/k norms), the
        attention's projections and its MLP."""
        p = f"model.layers.{i}."
        o = p + "self_attn.o_proj.weight"
        lp: dict[str, Any] = {"attn_norm": self.norm(p + "input_layernorm.weight")}
        lp["wo"] = self.linear((o,), self.row_axes(o))
        if self.cfg.sandwich_norms:  # Gemma: post_attention_layernorm is on the attention's output
            lp["attn_post_norm"] = self.norm(p + "post_attention_layernorm.weight")
            lp["mlp_norm"] = self.norm(p + "pre_feedforward_layernorm.weight")
            lp["mlp_post_norm"] = self.norm(p + "post_feedforward_layernorm.weight")
        else:
            lp["mlp_norm"] = self.norm(p + "post_attention_layernorm.weight")
        if self.cfg.qk_norm:
            lp["q_norm"] = self.norm(p + "self_attn.q_norm.weight")
            lp["k_norm"] = self.norm(p + "self_attn.k_norm.weight")
        return Layer(**lp, **self.mlp(i), **self.attention(i))

    # ---- the whole ----

    def weights(self) -> Weights:
        """Every layer, the embedding and LM head (`table`s; the head's packing beside it), the
        final norm."""
        layers = tuple(self.layer(i) for i in range(self.cfg.num_hidden_layers))
        vocab = (COL if self.vocab_sharded else None, None)
        embed: Table = self.linear(("model.embed_tokens.weight",), vocab, table=True)
        lm_head: Table | None = None
        if not self.cfg.tie_word_embeddings:
            lm_head = self.linear(("lm_head.weight",), vocab, table=True)
        head_enc = ENCODINGS[self.weight_dtype] if self.weight_dtype != "auto" else Dense
        packed = head_enc.head_packing(embed if lm_head is None else lm_head)
        return Weights(embed, layers, self.norm("model.norm.weight"), lm_head, packed)


def load_weights(
    tensors: Mapping[str, HostTensor],
    cfg: ModelConfig,
    dtype: Any = np.float32,
    weight_dtype: EncodingName = "float32",
    *,
    kv_sharded: bool = True,
    vocab_sharded: bool = True,
    tensor_parallel: int = 1,
) -> Weights:
    """Hugging Face tensors -> the step layout on the host (`WeightLoader` says how)."""
    loader = WeightLoader(
        tensors,
        cfg,
        dtype,
        weight_dtype,
        kv_sharded=kv_sharded,
        vocab_sharded=vocab_sharded,
        tensor_parallel=tensor_parallel,
    )
    return loader.weights()


def load_params(model_dir: str, dtype: str = "float32") -> tuple[Weights, ModelConfig]:
    """(host Weights of numpy arrays, ModelConfig) of a Hugging Face model directory."""
    cfg = load_model_config(model_dir)
    return load_weights(read_tensors(model_dir), cfg, jnp.dtype(dtype)), cfg
