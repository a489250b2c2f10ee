"""The float64 numpy pieces of the script tests' references (docs/model_math.md): the
activations and the row softmax. Imported by path, as script_test."""

import math

import numpy as np


def sigmoid(z):
    """1 / (1 + exp(-z)), written with exp(-|z|) so that exp never overflows."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def activation(kind, z):
    """Activation `kind` (the config's name) of z, elementwise; ValueError for another name."""
    if kind == "relu":
        return np.maximum(z, 0.0)
    if kind == "tanh":
        return np.tanh(z)
    if kind == "gelu":  # the tanh form
        return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))
    if kind == "gelu_erf":  # the exact form 0.5 z (1 + erf(z / sqrt 2)), as 0.5 z erfc(-z / sqrt 2)
        return 0.5 * z * np.vectorize(math.erfc)(-z / math.sqrt(2.0))
    if kind == "silu":  # z sigmoid(z)
        return z * sigmoid(z)
    if kind == "sigmoid":
        return sigmoid(z)
    if kind == "none":
        return z
    raise ValueError("unknown activation " + kind)


def softmax(z):
    """Softmax of each row of z."""
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)
