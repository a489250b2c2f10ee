"""A meshtrain model as a PyTorch module, written by `meshtrain export --format pytorch`.

    import model          # this file; model.safetensors lies beside it
    m = model.load()      # a torch.nn.Module in eval mode, on the CPU
    y = m(x)              # x: float32 [rows, inputs] in your units; y: [rows, outputs]
    y = m(dense, indices, offsets)   # a DLRM: per table nn.EmbeddingBag's ids and bag
                                     # starts; y: logits [rows, 1] (torch.sigmoid: clicks)

The model: @SUMMARY@.

It computes what `meshtrain predict` computes (meshtrain's docs/model_math.md): the inputs
standardized with the training data's statistics, the network, the outputs returned to the
targets' units. A classifier returns logits: torch.softmax(y, 1) and y.argmax(1) are predict's
/probability and /class. `m.network` is the network alone, in normalized units; `m.double()`
computes in float64 (torch.autograd.functional.jacobian(m, x) gives input derivatives).

It needs PyTorch alone (1.13 or newer): read_safetensors below reads the weights
(`safetensors.torch.load_file` reads the same file). The state dict's names and shapes are
those of model.safetensors; edit the classes as you like while they keep them.
"""

import json
import math
import os
import struct
import sys

import torch
from torch import nn

# What meshtrain trained: the model's part of the checkpoint's config (inputs and outputs in
# the data's order; the norms' eps are training's).
CONFIG = "@CONFIG@"

# Where the weights came from.
SOURCE = "@SOURCE@"


def make_activation(name):
    """model.activation between layers (docs/model_math.md, Activations)."""
    activations = {
        "relu": nn.ReLU,
        "tanh": nn.Tanh,
        "gelu": lambda: nn.GELU(approximate="tanh"),  # 0.5 z (1 + tanh(...)), the tanh form
        "gelu_erf": nn.GELU,  # 0.5 z (1 + erf(z / sqrt(2))), the exact form
        "silu": nn.SiLU,
        "sigmoid": nn.Sigmoid,
        "none": nn.Identity,
    }
    if name not in activations:
        raise ValueError("unknown activation %r" % name)
    return activations[name]()


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last axis (torch.nn.RMSNorm from
    PyTorch 2.4 on)."""

    def __init__(self, features, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind, features, config):
    """A residual_mlp's norm: LayerNorm (biased variance), RMSNorm, or none."""
    if kind == "layernorm":
        return nn.LayerNorm(features, eps=config["layernorm_eps"])
    if kind == "rmsnorm":
        return RMSNorm(features, eps=config["rmsnorm_eps"])
    if kind == "none":
        return nn.Identity()
    raise ValueError("unknown norm %r" % kind)


class MixtureOfExperts(nn.Module):
    """An MoE layer: p = softmax(x W_r) over the experts; each row's top_k experts by p (of
    equal probabilities the lower expert first, as meshtrain chooses); their gates
    g = p / sum(p of the chosen); y = sum over the chosen experts of g * expert(x)."""

    def __init__(self, features, experts, top_k, out_features):
        super().__init__()
        self.router = nn.Linear(features, len(experts), bias=False)
        self.experts = nn.ModuleList(experts)
        self.top_k = top_k
        self.out_features = out_features

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        # A stable sort keeps equal probabilities in expert order; torch.topk promises no order.
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        top_probs, top_experts = ordered[:, : self.top_k], order[:, : self.top_k]
        gates = top_probs / top_probs.sum(dim=-1, keepdim=True)
        y = x.new_zeros(x.shape[0], self.out_features)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(top_experts == e, as_tuple=True)
            if rows.numel() > 0:
                y.index_add_(0, rows, gates[rows, slot].unsqueeze(1) * expert(x[rows]))
        return y


class Mlp(nn.Module):
    """model.kind = "mlp": layer i is Linear(sizes[i], sizes[i+1]) or an MixtureOfExperts of
    Linear experts (model.moe_layers); the activation after every layer but the last."""

    def __init__(self, config):
        super().__init__()
        sizes, moe_layers = config["sizes"], set(config["moe_layers"])
        layers = []
        for i, (features, out_features) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i in moe_layers:
                experts = [nn.Linear(features, out_features) for _ in range(config["experts"])]
                layers.append(MixtureOfExperts(features, experts, config["top_k"], out_features))
            else:
                layers.append(nn.Linear(features, out_features))
        self.layers = nn.ModuleList(layers)
        self.activation = make_activation(config["activation"])

    def forward(self, h):
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i + 1 < len(self.layers):
                h = self.activation(h)
        return h


class FeedForward(nn.Module):
    """A residual block's feed-forward: down(act(up(u))), or for SwiGLU
    down(silu(gate(u)) * up(u))."""

    def __init__(self, width, hidden, activation):
        super().__init__()
        self.swiglu = activation == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(width, hidden)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.activation = nn.SiLU() if self.swiglu else make_activation(activation)

    def forward(self, u):
        if self.swiglu:
            return self.down(self.activation(self.gate(u)) * self.up(u))
        return self.down(self.activation(self.up(u)))


class Block(nn.Module):
    """A pre-norm residual block: h + feed_forward(norm(h))."""

    def __init__(self, norm, feed_forward):
        super().__init__()
        self.norm = norm
        self.feed_forward = feed_forward

    def forward(self, h):
        return h + self.feed_forward(self.norm(h))


class ResidualMlp(nn.Module):
    """model.kind = "residual_mlp": the input projection, `depth` blocks (a block of
    model.moe_layers has a MixtureOfExperts of feed-forwards), the output norm and
    projection."""

    def __init__(self, config):
        super().__init__()
        width, hidden, activation = config["width"], config["hidden"], config["activation"]
        moe_layers = set(config["moe_layers"])
        self.input = nn.Linear(config["inputs"], width)
        blocks = []
        for i in range(config["depth"]):
            if i in moe_layers:
                experts = [FeedForward(width, hidden, activation) for _ in range(config["experts"])]
                feed_forward = MixtureOfExperts(width, experts, config["top_k"], width)
            else:
                feed_forward = FeedForward(width, hidden, activation)
            blocks.append(Block(make_norm(config["norm"], width, config), feed_forward))
        self.blocks = nn.ModuleList(blocks)
        self.output_norm = make_norm(config["norm"], width, config)
        self.output = nn.Linear(width, config["outputs"])

    def forward(self, x):
        h = self.input(x)
        for block in self.blocks:
            h = block(h)
        return self.output(self.output_norm(h))


class Dlrm(nn.Module):
    """model.kind = "dlrm" (meshtrain's docs/recsys.md): z = bottom MLP(dense) (the activation
    after every layer, the last one too); per table an nn.EmbeddingBag (mode "sum" or "mean":
    an empty bag gives 0 either way); the interaction "dot" (DLRM's: z and the pooled rows
    F = [z, e_1, .., e_T], h = [z, F_i . F_j for i > j], the strictly lower triangle of F F^T
    row by row) or "cat" (h = [z, e_1, .., e_T]); the top MLP (the activation after every layer
    but the last) -> one logit per row. The tables are `embeddings.<t>` in the order of
    `tables` (their names)."""

    def __init__(self, config):
        super().__init__()
        bottom, top = config["bottom"], config["top"]
        self.bottom = nn.ModuleList(nn.Linear(a, b) for a, b in zip(bottom[:-1], bottom[1:]))
        self.top = nn.ModuleList(nn.Linear(a, b) for a, b in zip(top[:-1], top[1:]))
        self.tables = [t["name"] for t in config["tables"]]
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(t["rows"], t["dim"], mode=t["pooling"]) for t in config["tables"])
        self.interaction = config["interaction"]
        self.activation = make_activation(config["activation"])
        count = len(self.tables) + 1
        rows, cols = torch.tril_indices(count, count, offset=-1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def _by_table(self, given, what):
        """A dict by table name as a list in the order of `tables`: ValueError naming the keys
        that are not the model's tables, and those of its tables that are missing."""
        if not isinstance(given, dict):
            return given
        unknown = [k for k in given if k not in self.tables]
        missing = [name for name in self.tables if name not in given]
        if unknown or missing:
            raise ValueError("%s: the keys %s are not the model's tables %s (unknown: %s, "
                             "missing: %s)" % (what, sorted(given, key=str), self.tables,
                                               unknown, missing))
        return [given[name] for name in self.tables]

    def forward(self, dense, indices, offsets):
        """dense: float [rows, bottom[0]]; indices and offsets: per table (a list in the order of
        `tables`, or a dict by name) the int64 ids of every bag one after the other and each
        bag's first position in them [rows] (nn.EmbeddingBag's input and offsets)."""
        indices = self._by_table(indices, "indices")
        offsets = self._by_table(offsets, "offsets")
        if len(indices) != len(self.tables) or len(offsets) != len(self.tables):
            raise ValueError("expected the ids and offsets of %d tables %s, got %d and %d" %
                             (len(self.tables), self.tables, len(indices), len(offsets)))
        z = dense
        for layer in self.bottom:
            z = self.activation(layer(z))
        pooled = [bag(ids, starts) for bag, ids, starts in zip(self.embeddings, indices, offsets)]
        if self.interaction == "cat":
            h = torch.cat([z] + pooled, dim=1)
        else:
            features = torch.stack([z] + pooled, dim=1)  # [rows, tables + 1, d]
            products = torch.bmm(features, features.transpose(1, 2))
            h = torch.cat([z, products[:, self.pair_rows, self.pair_cols]], dim=1)
        for i, layer in enumerate(self.top):
            h = layer(h)
            if i + 1 < len(self.top):
                h = self.activation(h)
        return h


class Model(nn.Module):
    """The model in the user's units: the inputs standardized, the network, the outputs
    returned to the targets' units (each step only when the checkpoint has its statistics:
    the training data's mean and population standard deviation, float64, as buffers)."""

    def __init__(self, config=CONFIG):
        super().__init__()
        self.dlrm = config["kind"] == "dlrm"
        residual = config["kind"] == "residual_mlp"
        if self.dlrm:  # no statistics: m(dense, indices, offsets) returns the logits [rows, 1]
            self.network = Dlrm(config)
            inputs, outputs = config["bottom"][0], 1
        else:
            self.network = ResidualMlp(config) if residual else Mlp(config)
            inputs = config["inputs"] if residual else config["sizes"][0]
            outputs = config["outputs"] if residual else config["sizes"][-1]

        def statistics(present, width):
            return torch.zeros(width, dtype=torch.float64) if present else None

        self.register_buffer("input_mean", statistics(config["normalize_inputs"], inputs))
        self.register_buffer("input_std", statistics(config["normalize_inputs"], inputs))
        self.register_buffer("target_mean", statistics(config["normalize_targets"], outputs))
        self.register_buffer("target_std", statistics(config["normalize_targets"], outputs))

    def forward(self, x, *sparse):
        """m(x) for an MLP; m(dense, indices, offsets) for a DLRM (Dlrm.forward). Any other
        number of arguments is a TypeError naming what was passed."""
        if self.dlrm:
            if len(sparse) != 2:
                raise TypeError("a DLRM is called m(dense, indices, offsets), got %d arguments "
                                "after dense" % len(sparse))
            return self.network(x, *sparse)
        if sparse:
            raise TypeError("this %s model is called m(x), got %d more arguments (%s): only a "
                            "DLRM takes ids and offsets" %
                            (type(self.network).__name__, len(sparse),
                             ", ".join(type(a).__name__ for a in sparse)))
        # The standardization and its inverse in float64, rounded once, as predict does.
        if self.input_mean is not None:
            x = ((x.double() - self.input_mean) / self.input_std).to(x.dtype)
        y = self.network(x)
        if self.target_mean is not None:
            y = (y.double() * self.target_std + self.target_mean).to(y.dtype)
        return y


def read_safetensors(path):
    """({name: tensor}, metadata) of a safetensors file: an 8-byte little-endian header
    length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then
    the tensors' little-endian bytes from data_offsets[0] to [1] after the header."""
    if sys.byteorder != "little":
        raise RuntimeError("read_safetensors reads little-endian bytes on a little-endian machine")
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16}
    with open(path, "rb") as f:
        data = bytearray(f.read())
    (header_length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_length].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    start = 8 + header_length
    tensors = {}
    for name, info in header.items():
        dtype, shape = dtypes[info["dtype"]], info["shape"]
        begin, end = info["data_offsets"]
        count = math.prod(shape)
        if end - begin != count * torch.finfo(dtype).bits // 8 or start + end > len(data):
            raise ValueError("%s: tensor %r: data_offsets %s do not fit its shape %s" %
                             (path, name, info["data_offsets"], shape))
        # Each tensor views its bytes of `data` (and keeps it alive): no copy.
        values = torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin) \
            if count else torch.empty(0, dtype=dtype)
        tensors[name] = values.reshape(shape)
    return tensors, metadata


def load(path=None):
    """The model with the weights of `path` (default: model.safetensors beside this file),
    in eval mode (no dropout exists here: meshtrain uses it in training only)."""
    if path is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.safetensors")
    tensors, _ = read_safetensors(path)
    m = Model()
    m.load_state_dict(tensors)  # strict: every name and shape must match
    return m.eval()
