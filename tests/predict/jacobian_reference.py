#!/usr/bin/env python3
"""`meshtrain predict --jacobian` against float64 references (docs/derivatives.md), one case per
ctest test:

  jacobian_reference.py CASE --meshtrain BIN --source-dir DIR --work DIR -- MPIEXEC [FLAGS...]

Each case trains tiny regression models with `meshtrain train` (tests/export/export_test.py's
data, configs and meshes, imported from it), gives each checkpoint input and target statistics
(inputs at scales 1e-3 to 1e4, target standard deviations 12.5 and 0.02: export_test.py's
write_normalization) and runs `meshtrain predict --jacobian` in forward and in reverse mode on
dp (1 rank), fsdp and tp (2 ranks), fsdp x tp (4 ranks), and ep (2 ranks) for MoE models.
Checked:

  1. the float64 reference Jacobian of this file (the tangents of docs/derivatives.md pushed
     through each layer in numpy) against central differences of export_test.py's float64
     forward (reference_forward; steps of 1e-5 input standard deviations): normwise within
     CD_TOL in normalized units; rows whose MoE routing changes inside a step are left out
     of that column (how many is printed);
  2. /jacobian [N, outputs, inputs] float32 against that reference: within RTOL in normalized
     units J' = J * input_std / target_std (the model's own derivative), relative to
     max(|J'|, FLOOR * max|J'|) as export_test.py measures outputs: float32 rounding scales
     with the largest terms;
  3. /prediction against the float64 forward (export_test.py's FP32_RTOL), and the file's
     jacobian_mode attribute.

Case cli_errors: --jacobian-mode without --jacobian, an unknown mode and a mixed-precision
override are refused (exit 2, one sentence), no output left behind.
"""

import math
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "export"))
import export_test as et  # noqa: E402  (its data, training, meshes and float64 forward)
from export_test import Failure, h5py, np  # noqa: E402

RTOL = 2e-5  # meshtrain's float32 Jacobian against float64 (measured: at most 4.5e-6)
CD_TOL = 1e-7  # the float64 reference against float64 central differences
CD_STEP = 1e-5  # central differences' step, in input standard deviations
FLOOR = et.FLOOR
MODES = ("forward", "reverse")


# --- the float64 reference: value and tangents, layer by layer ---------------------------
# Tangents T [N, D, F]: the derivative of each row's features F along D input directions.

def slope(kind, z):
    """f'(z) of docs/model_math.md's activations."""
    if kind == "relu":
        return (z > 0).astype(np.float64)
    if kind == "tanh":
        return 1.0 - np.tanh(z) ** 2
    if kind == "gelu":
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (z + 0.044715 * z**3))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * z * z)
    if kind == "gelu_erf":
        cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
        return cdf + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    if kind == "silu":
        s = 1.0 / (1.0 + np.exp(-z))
        return s * (1.0 + z * (1.0 - s))
    if kind == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-z))
        return s * (1.0 - s)
    if kind == "none":
        return np.ones_like(z)
    raise Failure("unknown activation " + kind)


def linear_t(h, T, w, b):
    return h @ w + b, T @ w  # the bias has no derivative


def activation_t(kind, z, T):
    return et.activation(kind, z), T * slope(kind, z)[:, None, :]


def swiglu_t(g, Tg, u, Tu):
    s = 1.0 / (1.0 + np.exp(-g))
    return et.activation("silu", g) * u, (slope("silu", g) * u)[:, None, :] * Tg + (g * s)[:, None, :] * Tu


def norm_t(kind, h, T, p, prefix):
    """LayerNorm: x_hat = (x - mean) r, r = 1 / sqrt(var + eps), d x_hat = r (dx - mean(dx)
    - x_hat mean(x_hat dx)); RMSNorm: x_hat = x r, d x_hat = r (dx - x_hat mean(x_hat dx));
    both times scale."""
    if kind == "none":
        return h, T
    y = et.norm_forward(kind, h, p, prefix)
    if kind == "layernorm":
        xc = h - h.mean(axis=1, keepdims=True)
        r = 1.0 / np.sqrt((xc * xc).mean(axis=1, keepdims=True) + et.LAYERNORM_EPS)
        x_hat = xc * r
        centred = T - T.mean(axis=2, keepdims=True)
    else:
        r = 1.0 / np.sqrt((h * h).mean(axis=1, keepdims=True) + et.RMSNORM_EPS)
        x_hat = h * r
        centred = T
    along = (x_hat[:, None, :] * T).mean(axis=2, keepdims=True)
    Tn = r[:, :, None] * (centred - x_hat[:, None, :] * along)
    return y, Tn * p[prefix + "/scale"]


def moe_t(h, T, p, prefix, top_k, expert_t):
    """The routing of export_test.moe_forward (top k of softmax(x Wr), ties: the lower index;
    gates renormalized over the chosen), held fixed: dp = p (dl - p . dl), dg_s = (dp_s - g_s
    sum_t dp_t) / sum_t p_t, dy = sum_s dg_s y_s + g_s dy_s. Returns (y, T, routes)."""
    router = p[prefix + "/router/weight"]
    probs = et.softmax(h @ router)
    Tl = T @ router
    Tp = probs[:, None, :] * (Tl - (probs[:, None, :] * Tl).sum(axis=2, keepdims=True))
    y, Ty, routes = None, None, []
    for r in range(h.shape[0]):
        chosen = sorted(range(probs.shape[1]), key=lambda e: (-probs[r, e], e))[:top_k]
        total = probs[r, chosen].sum()
        gates = probs[r, chosen] / total
        dtotal = Tp[r][:, chosen].sum(axis=1)
        dgates = (Tp[r][:, chosen] - gates[None, :] * dtotal[:, None]) / total
        for s, e in enumerate(chosen):
            v, Tv = expert_t(e, h[r:r + 1], T[r:r + 1])
            if y is None:
                y = np.zeros((h.shape[0], v.shape[1]))
                Ty = np.zeros((h.shape[0], T.shape[1], v.shape[1]))
            y[r] += gates[s] * v[0]
            Ty[r] += dgates[:, s, None] * v[0][None, :] + gates[s] * Tv[0]
        routes.append(tuple(chosen))
    return y, Ty, routes


def residual_t(model, p, h, T, routes):
    kind = model.get("norm", "rmsnorm")
    act = model.get("activation", "relu")
    h, T = linear_t(h, T, p["input/weight"], p["input/bias"])
    moe_blocks = set(model.get("moe_layers", []))
    for i in range(model["depth"]):
        prefix = "blocks/%d" % i
        u, Tu = norm_t(kind, h, T, p, prefix + "/norm")
        if i in moe_blocks:
            def expert_t(e, row, Trow, q=prefix + "/experts/"):
                up, Tup = linear_t(row, Trow, p[q + "up/weight"][e], p[q + "up/bias"][e])
                if act == "swiglu":
                    g, Tg = linear_t(row, Trow, p[q + "gate/weight"][e], p[q + "gate/bias"][e])
                    a, Ta = swiglu_t(g, Tg, up, Tup)
                else:
                    a, Ta = activation_t(act, up, Tup)
                return linear_t(a, Ta, p[q + "down/weight"][e], p[q + "down/bias"][e])
            y, Ty, r = moe_t(u, Tu, p, prefix, model.get("top_k", 2), expert_t)
            routes.append(r)
        else:
            up, Tup = linear_t(u, Tu, p[prefix + "/up/weight"], p[prefix + "/up/bias"])
            if act == "swiglu":
                g, Tg = linear_t(u, Tu, p[prefix + "/gate/weight"], p[prefix + "/gate/bias"])
                a, Ta = swiglu_t(g, Tg, up, Tup)
            else:
                a, Ta = activation_t(act, up, Tup)
            y, Ty = linear_t(a, Ta, p[prefix + "/down/weight"], p[prefix + "/down/bias"])
        h, T = h + y, T + Ty
    h, T = norm_t(kind, h, T, p, "output_norm")
    return linear_t(h, T, p["output/weight"], p["output/bias"])


def reference_jacobian(ckpt, x):
    """(outputs [N, O], J [N, O, I], routes) in float64 and the user's units: T starts as the
    identity, divided by input_std when the inputs are standardized, and ends times
    target_std."""
    model = ckpt["config"]["model"]
    p = ckpt["params"]
    norm = ckpt["normalization"]
    h = x.astype(np.float64)
    rows, inputs = h.shape
    T = np.broadcast_to(np.eye(inputs), (rows, inputs, inputs)).copy()
    if "input_mean" in norm:
        h = (h - norm["input_mean"]) / norm["input_std"]
        T = T / norm["input_std"][None, None, :]
    routes = []
    if model.get("kind") == "residual_mlp":
        h, T = residual_t(model, p, h, T, routes)
    else:
        sizes = model["sizes"]
        moe_layers = set(model.get("moe_layers", []))
        for i in range(len(sizes) - 1):
            prefix = "layers/%d" % i
            if i in moe_layers:
                w, b = p[prefix + "/experts/weight"], p[prefix + "/experts/bias"]
                h, T, r = moe_t(h, T, p, prefix, model.get("top_k", 2),
                                lambda e, row, Trow: linear_t(row, Trow, w[e], b[e]))
                routes.append(r)
            else:
                h, T = linear_t(h, T, p[prefix + "/weight"], p[prefix + "/bias"])
            if i < len(sizes) - 2:
                h, T = activation_t(model.get("activation", "relu"), h, T)
    if "target_mean" in norm:
        h = h * norm["target_std"] + norm["target_mean"]
        T = T * norm["target_std"][None, None, :]
    return h, T.transpose(0, 2, 1), routes


def normalized(ckpt, J):
    """J' = J * input_std / target_std."""
    norm = ckpt["normalization"]
    return J * norm["input_std"][None, None, :] / norm["target_std"][None, :, None]


def check_against_central_differences(ctx, label, ckpt, x, J):
    """The reference J against central differences of export_test's float64 forward."""
    _, _, routes = reference_jacobian(ckpt, x)
    steps = CD_STEP * ckpt["normalization"]["input_std"]
    cd = np.zeros_like(J)
    keep = np.ones(J.shape[::2], bool)  # [N, I]: rows whose routing holds within the step
    for i in range(x.shape[1]):
        up, down = x.astype(np.float64), x.astype(np.float64)
        up[:, i] += steps[i]
        down[:, i] -= steps[i]
        y_up = et.reference_forward(ckpt, up)[0]["output"]
        y_down = et.reference_forward(ckpt, down)[0]["output"]
        # The step as float64 holds it (feature 3 is 1000 +- 0.01: x + h rounds by 1e-13).
        cd[:, :, i] = (y_up - y_down) / (up[:, i] - down[:, i])[:, None]
        for moved in (up, down):
            for layer, other in zip(routes, reference_jacobian(ckpt, moved)[2]):
                keep[:, i] &= np.array([a == b for a, b in zip(layer, other)])
    ref, got = normalized(ckpt, J), normalized(ckpt, cd)
    mask = np.broadcast_to(keep[:, None, :], ref.shape)
    err = float(np.abs(got - ref)[mask].max() / np.abs(ref).max())
    left_out = int((~keep).sum())
    print("%s float64 reference vs central differences: max|error| / max|J'| %.3g (tolerance "
          "%.3g; %d of %d row-columns left out where the routing changes within a step)" %
          (label, err, CD_TOL, left_out, keep.size))
    ctx.check(err <= CD_TOL, "%s: the float64 reference Jacobian is %.3g off central differences"
              % (label, err))
    ctx.check(left_out <= keep.size // 10, "%s: %d of %d row-columns left out" %
              (label, left_out, keep.size))


def relative_error(got, ref):
    floor = FLOOR * max(float(np.abs(ref).max()), 1e-30)
    return float((np.abs(got - ref) / np.maximum(np.abs(ref), floor)).max())


def mesh_overrides(mesh):
    _, axes, preset = et.MESHES[mesh]
    out = []
    for axis in ("dp", "fsdp", "ep", "tp"):
        out += ["--set", "mesh.%s=%d" % (axis, axes.get(axis, 1))]
    return out + ["--set", "partition.preset=" + preset]


def predict_jacobian(ctx, checkpoint, x, mesh, mode):
    """`meshtrain predict --jacobian` on `mesh`: (prediction, jacobian, attribute)."""
    work = os.path.join(ctx.work, "predict_%s_%s" % (mesh, mode))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    inputs, output = os.path.join(work, "x.h5"), os.path.join(work, "out.h5")
    with h5py.File(inputs, "w") as f:
        f["x"] = x
    ranks = et.MESHES[mesh][0]
    cmd = (ctx.mpiexec[:1] + ["-n", str(ranks)] + ctx.mpiexec[1:] +
           [ctx.meshtrain, "predict", checkpoint, "--input", inputs, "--output", output,
            "--jacobian", "--jacobian-mode", mode] + mesh_overrides(mesh))
    et.run_ok(cmd)
    with h5py.File(output, "r") as f:
        ctx.check(f["jacobian"].dtype == np.float32, "%s %s: /jacobian is %s, expected float32" %
                  (mesh, mode, f["jacobian"].dtype))
        mode_attr = f.attrs["jacobian_mode"]
        mode_attr = mode_attr.decode() if isinstance(mode_attr, bytes) else str(mode_attr)
        result = f["prediction"][()], f["jacobian"][()], mode_attr
    shutil.rmtree(work)
    return result


def check_model(ctx, label, ckpt_dir, data_x, meshes):
    path = et.latest_file(ckpt_dir)
    et.write_normalization(path, data_x, 2)
    ckpt = et.read_checkpoint(path)
    x = et.test_rows(data_x)
    want_y = et.reference_forward(ckpt, x)[0]["output"]
    ref_y, J, _ = reference_jacobian(ckpt, x)
    ctx.check(relative_error(ref_y, want_y) <= 1e-12, "%s: the reference's outputs are not "
              "export_test's forward" % label)
    check_against_central_differences(ctx, label, ckpt, x, J)
    worst = 0.0
    for mesh in meshes:
        for mode in MODES:
            y, got, attr = predict_jacobian(ctx, path, x, mesh, mode)
            what = "%s on %s, %s mode" % (label, mesh, mode)
            ctx.check(attr == mode, "%s: jacobian_mode attribute %r" % (what, attr))
            ctx.check(got.shape == J.shape, "%s: /jacobian is %s, expected %s" %
                      (what, got.shape, J.shape))
            if got.shape != J.shape:
                continue
            err = relative_error(normalized(ckpt, got.astype(np.float64)), normalized(ckpt, J))
            y_err = relative_error(y, want_y)
            worst = max(worst, err)
            print("%s: /jacobian relative error %.3g (tolerance %.3g), /prediction %.3g" %
                  (what, err, RTOL, y_err))
            ctx.check(err <= RTOL, "%s: /jacobian relative error %.3g > %.3g" % (what, err, RTOL))
            ctx.check(y_err <= et.FP32_RTOL, "%s: /prediction relative error %.3g" % (what, y_err))
    print("%s: largest /jacobian relative error %.3g" % (label, worst))
    # The statistics matter: J in the user's units is not the model's own.
    off = relative_error(J, normalized(ckpt, J))
    ctx.check(off > 1e-2, "%s: the normalization changes J by only %.3g" % (label, off))


DENSE_MESHES = ("dp_np1", "fsdp_np2", "tp_np2", "fsdp_tp_np4")
MOE_MESHES = DENSE_MESHES + ("ep_np2",)


def regression_data(ctx):
    data = os.path.join(ctx.work, "regression.h5")
    return data, et.write_data(data, "regression")


def case_mlp(ctx):
    """An MLP (gelu, 8 -> 16 -> 12 -> 2) on every mesh."""
    data, x = regression_data(ctx)
    ckpt = et.train(ctx, "mlp", data, [et.FEATURES, 16, 12, 2], "gelu", "mse")
    check_model(ctx, "mlp_gelu", ckpt, x, DENSE_MESHES)


def case_mlp_activations(ctx):
    """An MLP with each other activation, on one rank."""
    data, x = regression_data(ctx)
    for kind in ("relu", "tanh", "gelu_erf", "silu", "sigmoid", "none"):
        ckpt = et.train(ctx, "mlp_" + kind, data, [et.FEATURES, 12, 2], kind, "mse")
        check_model(ctx, "mlp_" + kind, ckpt, x, ("dp_np1",))


def case_residual_layernorm_silu(ctx):
    """A residual_mlp (LayerNorm, SiLU, 2 blocks) trained on tp = 2, on every mesh."""
    data, x = regression_data(ctx)
    ckpt = et.train(ctx, "residual_layernorm_silu", data, None, "silu", "mse", mesh="tp_np2",
                    residual=et.residual_keys("layernorm"))
    check_model(ctx, "residual_layernorm_silu", ckpt, x, DENSE_MESHES)


def case_residual_rmsnorm_swiglu(ctx):
    """A residual_mlp (RMSNorm, SwiGLU, 2 blocks), on every mesh."""
    data, x = regression_data(ctx)
    ckpt = et.train(ctx, "residual_rmsnorm_swiglu", data, None, "swiglu", "mse",
                    residual=et.residual_keys("rmsnorm"))
    check_model(ctx, "residual_rmsnorm_swiglu", ckpt, x, DENSE_MESHES)


def case_moe(ctx):
    """An MoE MLP (tanh; layer 1: 4 experts, top 2) trained on ep = 2, on every mesh and ep."""
    data, x = regression_data(ctx)
    ckpt = et.train(ctx, "moe", data, [et.FEATURES, 16, 12, 2], "tanh", "mse", mesh="ep_np2",
                    moe={"moe_layers": [1], "experts": 4, "top_k": 2})
    check_model(ctx, "moe", ckpt, x, MOE_MESHES)


def case_residual_moe(ctx):
    """A residual_mlp whose block 0 is 4 SwiGLU expert feed-forwards (top 2) before a dense
    block (RMSNorm), trained on ep = 2, on every mesh and ep."""
    data, x = regression_data(ctx)
    ckpt = et.train(ctx, "residual_moe", data, None, "swiglu", "mse", mesh="ep_np2",
                    moe={"moe_layers": [0], "experts": 4, "top_k": 2},
                    residual=et.residual_keys("rmsnorm"))
    check_model(ctx, "residual_moe", ckpt, x, MOE_MESHES)


def case_cli_errors(ctx):
    """--jacobian's refusals: exit 2, one sentence, no output left behind."""
    data, x = regression_data(ctx)
    ckpt = et.train(ctx, "cli", data, [et.FEATURES, 8, 2], "tanh", "mse")
    inputs, output = os.path.join(ctx.work, "x.h5"), os.path.join(ctx.work, "out.h5")
    with h5py.File(inputs, "w") as f:
        f["x"] = x[:4]
    base = [ctx.meshtrain, "predict", ckpt, "--input", inputs, "--output", output]
    et.expect_error(ctx, base + ["--jacobian-mode", "forward"],
                    r"--jacobian-mode requires --jacobian", "--jacobian-mode alone")
    et.expect_error(ctx, base + ["--jacobian", "--jacobian-mode", "backward"],
                    r"--jacobian-mode is 'backward'; choose auto, forward or reverse",
                    "an unknown mode")
    et.expect_error(ctx, base + ["--jacobian", "--set", "mixed_precision.param_dtype=bf16"],
                    r"--jacobian computes in fp32; drop the mixed_precision override",
                    "a bf16 override")
    for name in (output, output + ".tmp"):
        ctx.check(not os.path.exists(name), "%s was left behind by a refused --jacobian" % name)


CASES = {
    "cli_errors": case_cli_errors,
    "mlp": case_mlp,
    "mlp_activations": case_mlp_activations,
    "residual_layernorm_silu": case_residual_layernorm_silu,
    "residual_rmsnorm_swiglu": case_residual_rmsnorm_swiglu,
    "moe": case_moe,
    "residual_moe": case_residual_moe,
}


def main():
    def make_context(args):
        args.predict = False
        return et.Context(args)
    return et.script_test.case_main(CASES, make_context)


if __name__ == "__main__":
    sys.exit(main())
