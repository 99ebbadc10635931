#!/usr/bin/env python3
"""Writes the golden FLUX.1, FLUX.2 and Qwen-Image transformers as the single files users have.

From the diffusers folders of the golden set (tests/golden/<case>/: config.json and
diffusion_pytorch_model.safetensors) it writes, into --out:

  flux1_bfl.safetensors         FLUX.1 in Black Forest Labs' keys: fused img/txt `qkv`, the single
                                blocks' `linear1` = [q | k | v | mlp], RMSNorm `scale`s, the final
                                modulation stored [shift, scale]
  flux1_bfl_fp8_scaled.safetensors
                                the same under ComfyUI's `model.diffusion_model.` prefix, every Linear
                                weight in F8_E4M3 with a per-tensor `scale_weight` (fp32) beside it and
                                ComfyUI's `scaled_fp8` marker, as ComfyUI's "fp8 scaled" files are
  flux1_bfl_fp8_e4m3fn.safetensors
                                the same with the weights' values rounded to F8_E4M3 and no scales,
                                as ComfyUI's plain `*_fp8_e4m3fn` files are
  flux2_bfl.safetensors         FLUX.2 in Black Forest Labs' keys (fused double-block `qkv`; the single
                                blocks' linear1 stays [q | k | v | gate | up])
  pipeline_flux1_bfl.safetensors
                                the FLUX.1 pipeline's transformer (pipeline_flux1/transformer) in
                                Black Forest Labs' keys, for `generate --transformer`
  qwenimage_comfyui.safetensors Qwen-Image as ComfyUI publishes it: diffusers' own names (diffusers'
                                from_single_file takes QwenImageTransformer2DModel's keys as they are;
                                shardit also accepts them under `model.diffusion_model.`, which the
                                FP8 FLUX.1 file covers)

This is the inverse of diffusers' single-file conversion (loaders/single_file_utils.py:
convert_flux_transformer_checkpoint_to_diffusers, convert_flux2_transformer_checkpoint_to_diffusers;
QwenImageTransformer2DModel's keys are taken as they are), written with numpy and safetensors only.
Values are copied exactly (fp32), so a correct loader gives the folder's weights bit for bit.

--venv DIR: run inside a virtual environment holding the pinned numpy and safetensors (made once,
from PyPI; exits 77 when PyPI cannot be reached and the environment is not there yet).

--verify: loads every written file with diffusers' `from_single_file` (diffusers and torch must be
importable, e.g. a virtual environment with the pinned releases of README.md) and checks that it
gives exactly the folder's state dict. Run by hand; the result is recorded in README.md.
"""
import argparse
import json
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "support"))
from pinned_venv import pinned_python  # noqa: E402

NUMPY_RELEASE = "2.4.6"
SAFETENSORS_RELEASE = "0.8.0"
SKIPPED = 77
COMFY_PREFIX = "model.diffusion_model."

CASES = {
    "flux1_bfl": "flux_b1_square",
    "flux2_bfl": "flux2_b1_square",
    "qwenimage_comfyui": "qwenimage_b1_square",
    "pipeline_flux1_bfl": "pipeline_flux1/transformer",
}


def tool_python(venv):
    """The venv's python with the pinned numpy and safetensors; made once (tests/support/pinned_venv.py)."""
    check = ("import numpy, safetensors, sys; sys.exit(numpy.__version__ != '%s' or safetensors.__version__ != '%s')"
             % (NUMPY_RELEASE, SAFETENSORS_RELEASE))
    return pinned_python(venv, check, [f"numpy=={NUMPY_RELEASE}", f"safetensors=={SAFETENSORS_RELEASE}"],
                         f"numpy {NUMPY_RELEASE} and safetensors {SAFETENSORS_RELEASE}", "numpy")


# ------------------------------------------------------------------------------------------------
# Writing

def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, dtype name, shape, raw bytes), written in this order."""
    header = {}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for _, _, _, data in tensors:
            out.write(data)
    os.replace(tmp, path)


def f32(array):
    import numpy as np
    array = np.ascontiguousarray(array, dtype=np.float32)
    return ("F32", array.shape, array.tobytes())


def e4m3_table():
    """Every finite float8_e4m3fn value by code (NaN codes 0x7F, 0xFF left out)."""
    import numpy as np
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    finite = (codes & 0x7F) != 0x7F
    return codes[finite], (sign * value)[finite]


def to_e4m3(values):
    """Round to nearest float8_e4m3fn, ties to the even code (saturating at +-448)."""
    import numpy as np
    codes, table = e4m3_table()
    order = np.argsort(table, kind="stable")
    codes, table = codes[order], table[order]
    keep = np.concatenate([[True], np.diff(table) != 0])  # +0 and -0: keep +0's code
    codes, table = codes[keep], table[keep]
    flat = np.clip(values.astype(np.float64).ravel(), table[0], table[-1])
    upper = np.clip(np.searchsorted(table, flat), 1, len(table) - 1)
    lower = upper - 1
    d_low = flat - table[lower]
    d_up = table[upper] - flat
    pick = np.where(d_low < d_up, lower, np.where(d_up < d_low, upper,
                                                  np.where(codes[lower] % 2 == 0, lower, upper)))
    return codes[pick].astype(np.uint8).reshape(values.shape)


def flux1_to_bfl(sd, config):
    """diffusers FluxTransformer2DModel names -> BFL's (inverse of diffusers' conversion)."""
    import numpy as np
    out = {}
    renames = {
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "context_embedder": "txt_in",
        "x_embedder": "img_in",
        "proj_out": "final_layer.linear",
    }
    for ours, theirs in renames.items():
        for kind in ("weight", "bias"):
            if f"{ours}.{kind}" in sd:
                out[f"{theirs}.{kind}"] = sd[f"{ours}.{kind}"]
    for kind in ("weight", "bias"):
        scale, shift = np.split(sd[f"norm_out.linear.{kind}"], 2, axis=0)
        out[f"final_layer.adaLN_modulation.1.{kind}"] = np.concatenate([shift, scale], axis=0)
    for i in range(config["num_layers"]):
        b, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{d}img_mod.lin.{kind}"] = sd[f"{b}norm1.linear.{kind}"]
            out[f"{d}txt_mod.lin.{kind}"] = sd[f"{b}norm1_context.linear.{kind}"]
            out[f"{d}img_attn.qkv.{kind}"] = np.concatenate([sd[f"{b}attn.to_{x}.{kind}"] for x in "qkv"], axis=0)
            out[f"{d}txt_attn.qkv.{kind}"] = np.concatenate([sd[f"{b}attn.add_{x}_proj.{kind}"] for x in "qkv"],
                                                            axis=0)
            out[f"{d}img_mlp.0.{kind}"] = sd[f"{b}ff.net.0.proj.{kind}"]
            out[f"{d}img_mlp.2.{kind}"] = sd[f"{b}ff.net.2.{kind}"]
            out[f"{d}txt_mlp.0.{kind}"] = sd[f"{b}ff_context.net.0.proj.{kind}"]
            out[f"{d}txt_mlp.2.{kind}"] = sd[f"{b}ff_context.net.2.{kind}"]
            out[f"{d}img_attn.proj.{kind}"] = sd[f"{b}attn.to_out.0.{kind}"]
            out[f"{d}txt_attn.proj.{kind}"] = sd[f"{b}attn.to_add_out.{kind}"]
        out[f"{d}img_attn.norm.query_norm.scale"] = sd[f"{b}attn.norm_q.weight"]
        out[f"{d}img_attn.norm.key_norm.scale"] = sd[f"{b}attn.norm_k.weight"]
        out[f"{d}txt_attn.norm.query_norm.scale"] = sd[f"{b}attn.norm_added_q.weight"]
        out[f"{d}txt_attn.norm.key_norm.scale"] = sd[f"{b}attn.norm_added_k.weight"]
    for i in range(config["num_single_layers"]):
        b, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{s}modulation.lin.{kind}"] = sd[f"{b}norm.linear.{kind}"]
            out[f"{s}linear1.{kind}"] = np.concatenate(
                [sd[f"{b}attn.to_{x}.{kind}"] for x in "qkv"] + [sd[f"{b}proj_mlp.{kind}"]], axis=0)
            out[f"{s}linear2.{kind}"] = sd[f"{b}proj_out.{kind}"]
        out[f"{s}norm.query_norm.scale"] = sd[f"{b}attn.norm_q.weight"]
        out[f"{s}norm.key_norm.scale"] = sd[f"{b}attn.norm_k.weight"]
    return out


def flux2_to_bfl(sd, config):
    """diffusers Flux2Transformer2DModel names -> BFL's (inverse of diffusers' conversion)."""
    import numpy as np
    out = {}
    renames = {
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin",
        "proj_out": "final_layer.linear",
    }
    for ours, theirs in renames.items():
        if f"{ours}.weight" in sd:
            out[f"{theirs}.weight"] = sd[f"{ours}.weight"]
    scale, shift = np.split(sd["norm_out.linear.weight"], 2, axis=0)
    out["final_layer.adaLN_modulation.1.weight"] = np.concatenate([shift, scale], axis=0)
    for i in range(config["num_layers"]):
        b, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out[f"{d}img_attn.qkv.weight"] = np.concatenate([sd[f"{b}attn.to_{x}.weight"] for x in "qkv"], axis=0)
        out[f"{d}txt_attn.qkv.weight"] = np.concatenate([sd[f"{b}attn.add_{x}_proj.weight"] for x in "qkv"], axis=0)
        for theirs, ours in (("img_attn.norm.query_norm.scale", "attn.norm_q.weight"),
                             ("img_attn.norm.key_norm.scale", "attn.norm_k.weight"),
                             ("txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"),
                             ("txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"),
                             ("img_attn.proj.weight", "attn.to_out.0.weight"),
                             ("txt_attn.proj.weight", "attn.to_add_out.weight"),
                             ("img_mlp.0.weight", "ff.linear_in.weight"),
                             ("img_mlp.2.weight", "ff.linear_out.weight"),
                             ("txt_mlp.0.weight", "ff_context.linear_in.weight"),
                             ("txt_mlp.2.weight", "ff_context.linear_out.weight")):
            out[d + theirs] = sd[b + ours]
    for i in range(config["num_single_layers"]):
        b, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out[f"{s}linear1.weight"] = sd[f"{b}attn.to_qkv_mlp_proj.weight"]
        out[f"{s}linear2.weight"] = sd[f"{b}attn.to_out.weight"]
        out[f"{s}norm.query_norm.scale"] = sd[f"{b}attn.norm_q.weight"]
        out[f"{s}norm.key_norm.scale"] = sd[f"{b}attn.norm_k.weight"]
    return out


def qwenimage_to_comfyui(sd, config):
    return dict(sd)


def fp8_scaled(bfl, scaled=True):
    """ComfyUI's "fp8 scaled" form of a BFL state dict: prefixed keys, each 2-D weight in F8_E4M3
    with a per-tensor fp32 `scale_weight` (max|w| / 448), the rest fp32, and the `scaled_fp8` marker.
    scaled=False: the plain `fp8_e4m3fn` form, the weights' values rounded to F8_E4M3, no scales."""
    import numpy as np
    tensors = []
    for name in sorted(bfl):
        value = bfl[name]
        if name.endswith(".weight") and value.ndim == 2 and not scaled:
            tensors.append((COMFY_PREFIX + name, "F8_E4M3", value.shape, to_e4m3(value).tobytes()))
        elif name.endswith(".weight") and value.ndim == 2:
            scale = np.float32(np.abs(value).max() / 448.0)
            codes = to_e4m3(value.astype(np.float32) / scale)
            tensors.append((COMFY_PREFIX + name, "F8_E4M3", value.shape, codes.tobytes()))
            tensors.append((COMFY_PREFIX + name[:-len("weight")] + "scale_weight", "F32", (),
                            np.array(scale, dtype=np.float32).tobytes()))
        else:
            tensors.append((COMFY_PREFIX + name, *f32(value)))
    if scaled:
        tensors.append((COMFY_PREFIX + "scaled_fp8", "F8_E4M3", (0,), b""))
    return tensors


def write_cases(golden, out):
    from safetensors.numpy import load_file
    os.makedirs(out, exist_ok=True)
    converters = {"flux1_bfl": flux1_to_bfl, "flux2_bfl": flux2_to_bfl, "qwenimage_comfyui": qwenimage_to_comfyui,
                  "pipeline_flux1_bfl": flux1_to_bfl}
    for name, case in CASES.items():
        folder = os.path.join(golden, case)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        sd = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
        converted = converters[name](sd, config)
        write_safetensors(os.path.join(out, name + ".safetensors"),
                          [(key, *f32(converted[key])) for key in sorted(converted)])
        if name == "flux1_bfl":
            write_safetensors(os.path.join(out, "flux1_bfl_fp8_scaled.safetensors"), fp8_scaled(converted))
            write_safetensors(os.path.join(out, "flux1_bfl_fp8_e4m3fn.safetensors"), fp8_scaled(converted, False))
        print(f"wrote {name}.safetensors from {case} ({len(converted)} tensors)")


# ------------------------------------------------------------------------------------------------
# Verifying with diffusers

def patch_flux_widths():
    """diffusers' FLUX.1 converter splits linear1 by FLUX.1-dev's widths, fixed in its code
    (inner_dim 3072, mlp_ratio 4): the one size it does not read from the file. The split it calls
    is given the golden model's widths instead (the same ratios); everything else is diffusers' own."""
    import diffusers.loaders.single_file_utils as utils
    real = utils.torch

    class Torch:
        def __getattr__(self, name):
            return getattr(real, name)

        def split(self, tensor, sizes, dim=0):
            if isinstance(sizes, (tuple, list)) and tuple(sizes) == (3072, 3072, 3072, 12288):
                inner = (tensor.shape[0]) // 7  # q, k, v and the 4x MLP: 7 x inner rows
                sizes = (inner, inner, inner, 4 * inner)
            return real.split(tensor, sizes, dim=dim)

    utils.torch = Torch()


def verify(golden, out):
    import diffusers
    import torch
    from safetensors.torch import load_file
    classes = {"flux1_bfl": diffusers.FluxTransformer2DModel, "flux2_bfl": diffusers.Flux2Transformer2DModel,
               "qwenimage_comfyui": diffusers.QwenImageTransformer2DModel,
               "pipeline_flux1_bfl": diffusers.FluxTransformer2DModel}
    patch_flux_widths()
    failures = 0
    for name, case in CASES.items():
        folder = os.path.join(golden, case)
        expected = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
        path = os.path.join(out, name + ".safetensors")
        try:
            model = classes[name].from_single_file(path, config=folder, local_files_only=True,
                                                   torch_dtype=torch.float32)
            got = model.state_dict()
            bad = sorted(k for k in expected if k not in got or not torch.equal(got[k], expected[k]))
            extra = sorted(k for k in got if k not in expected)
            status = "OK" if not bad and not extra else f"DIFFERS: {bad[:5]} extra {extra[:5]}"
        except Exception as error:  # reported, not hidden: the README records it
            status = f"ERROR: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        failures += not status.startswith("OK")
        print(f"{name}: from_single_file vs {case}: {status}")
    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", help="the golden set (or the build folder's view of it; required unless --only-venv)")
    parser.add_argument("--out", help="where the single files are written (required unless --only-venv)")
    parser.add_argument("--venv", help="a virtual environment with the pinned numpy and safetensors (made once)")
    parser.add_argument("--only-venv", action="store_true",
                        help="make (or check) the --venv environment, then stop (scripts/test.sh, during the build)")
    parser.add_argument("--verify", action="store_true", help="check the written files with diffusers")
    parser.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only_venv and not args.venv:
        parser.error("--only-venv needs --venv")
    if not args.only_venv and (args.golden is None or args.out is None):
        parser.error("--golden and --out are required")
    if args.venv and not args.in_venv:
        python = tool_python(args.venv)
        if args.only_venv:
            sys.exit(0)
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:], "--in-venv"])
    if args.verify:
        sys.exit(1 if verify(args.golden, args.out) else 0)
    write_cases(args.golden, args.out)


if __name__ == "__main__":
    main()
