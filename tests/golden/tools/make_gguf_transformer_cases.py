#!/usr/bin/env python3
"""Writes the golden FLUX.1, FLUX.2 and Qwen-Image transformers as GGUF files, with gguf-py itself.

Reads the single files make_single_file_cases.py wrote (--single-files: Black Forest Labs' keys for
FLUX.1 and FLUX.2, ComfyUI's for Qwen-Image, as city96's GGUF conversions keep the original
model's keys) and writes into --out, for each and each TYPE below:

  <file>.<type>.gguf                the transformer as gguf.GGUFWriter writes it (architecture
                                    metadata "flux" or "qwen_image"), each tensor in TYPE unless kept
                                    in a plain type by the rules below
  <file>.<type>.dequantized.safetensors
                                    every tensor of that file as gguf.quants.dequantize gives it
                                    (fp32, same names): the weights the GGUF model must compute with
  cases.json                        per file, the type each tensor was stored in and why

Which tensors keep a plain type (as city96's convert.py does for the files users have): 1-D
tensors (biases, norm scales) and tensors of at most 1024 elements stay F32; a tensor whose row
length is not a whole number of TYPE's blocks (32 elements for Q4_0..Q8_0) is stored in F16 (the
golden models' 16-wide inputs). F16 and BF16 files store every 2-D tensor in that type.

TYPES: F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: every type gguf-py 0.19.0 can quantize.

K-quants (Q4_K, Q5_K, Q6_K) need rows of whole 256-value super-blocks, which the golden models'
16-wide heads do not have: with --golden, each golden transformer is also written "wide" (32 heads
instead of 4, so 512 hidden; one double and one single block), with random weights drawn like the
golden ones (seeded; each tensor's standard deviation over its fan-in), into --out/wide/:

  <file>_wide/config.json           the widened config (the golden config with those changes)
  <file>_wide.safetensors           its fp32 weights in the single file's keys (BFL, ComfyUI)
  <file>_wide.<type>.gguf           Q4_K, Q5_K and Q6_K files, with their
  <file>_wide.<type>.dequantized.safetensors

gguf-py has no quantizer for the K-quants: ggml_k_quants.py (beside this file) makes the blocks with
plain scales, each file checked against gguf-py's dequantization of its blocks before it is kept;
the .dequantized files hold gguf-py's values, as for the other types.

--folder DIR --types T[,T] --out FILE.gguf: writes one diffusers transformer folder (FLUX.1, FLUX.2 or
Qwen-Image; weights F32, F16 or BF16, one file or shards with an index) as a GGUF file of the first
type, tensor by tensor (no .dequantized file): how the large Q4_K file of docs/checkpoints.md's
memory measurement is made from shardit-bench's synthetic FLUX.1-dev-width folder.

--venv DIR: the virtual environment with the pinned gguf-py (requirements-gguf.txt; made once,
shared with make_gguf_cases.py; exit 77 when PyPI cannot be reached to make it).
"""
import argparse
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_gguf_cases import venv_python, write_safetensors  # noqa: E402
from make_single_file_cases import flux1_to_bfl, flux2_to_bfl, qwenimage_to_comfyui  # noqa: E402

FILES = {"flux1_bfl": "flux", "flux2_bfl": "flux", "qwenimage_comfyui": "qwen_image", "pipeline_flux1_bfl": "flux"}
TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
SMALL = 1024  # city96's QUANTIZATION_THRESHOLD: tensors of at most this many elements stay F32
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
# The wide forms of the golden transformers: file name -> (golden case, converter, architecture).
WIDE = {"flux1_bfl_wide": ("flux_b1_square", flux1_to_bfl, "flux"),
        "flux2_bfl_wide": ("flux2_b1_square", flux2_to_bfl, "flux"),
        "qwenimage_comfyui_wide": ("qwenimage_b1_square", qwenimage_to_comfyui, "qwen_image")}
WIDEN = 8  # heads 4 -> 32: 512 hidden, two super-blocks of 256 per row (whole ones per rank at TP 2)
WIDE_SEED = 20261206
# Each architecture's class in config.json, for --folder.
ARCHITECTURES = {"FluxTransformer2DModel": (flux1_to_bfl, "flux"), "Flux2Transformer2DModel": (flux2_to_bfl, "flux"),
                 "QwenImageTransformer2DModel": (qwenimage_to_comfyui, "qwen_image")}


def read_safetensors(path):
    """name -> float32 numpy array, in file order (F32, F16 or BF16 tensors); `path` may be a
    diffusers index (`*.safetensors.index.json`), whose shards are read in turn."""
    import numpy as np
    if path.endswith(".index.json"):
        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for shard in shards:
            out.update(read_safetensors(os.path.join(os.path.dirname(path), shard)))
        return out
    with open(path, "rb") as f:
        data = f.read()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    base = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[base + begin:base + end]
        if entry["dtype"] == "F32":
            array = np.frombuffer(raw, dtype=np.float32)
        elif entry["dtype"] == "F16":
            array = np.frombuffer(raw, dtype=np.float16).astype(np.float32)
        elif entry["dtype"] == "BF16":  # the high half of a float32
            array = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit("%s: tensor %s is %s; F32, F16 or BF16 expected" % (path, name, entry["dtype"]))
        out[name] = array.reshape(entry["shape"])
    return out


def stored_type(array, wanted):
    """The type a tensor is stored in when the file's type is `wanted`, and why."""
    import gguf
    if array.ndim <= 1 or array.size <= SMALL:
        return "F32", "1-D or at most %d elements" % SMALL
    if wanted in ("F16", "BF16"):
        return wanted, "the file's type"
    block = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, wanted)][0]
    if array.shape[-1] % block != 0:
        return "F16", "row length %d is not a multiple of %d" % (array.shape[-1], block)
    return wanted, "the file's type"


def quantize(array, kind, name):
    """`array`'s codes in `kind` (gguf-py's quantizer; ggml_k_quants' for the K-quants, whose
    packing is checked against gguf-py's dequantization)."""
    import numpy as np
    import gguf
    from ggml_k_quants import QUANTIZERS, roundtrip_error
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind not in QUANTIZERS:
        return gguf.quants.quantize(np.ascontiguousarray(array), qtype)
    codes = QUANTIZERS[kind](array)
    error = roundtrip_error(array, codes, qtype)
    assert error < 0.15, "%s: %s blocks restore the values within %.3g only: the packing is wrong" % (name, kind, error)
    return codes


def write_file(tensors, arch, wanted, path, dequantized=True):
    """`tensors` as a GGUF file of type `wanted` (and, with `dequantized`, gguf-py's values of it
    beside it); returns each tensor's stored type and why."""
    import numpy as np
    import gguf
    writer = gguf.GGUFWriter(path, arch=arch)
    reference = {}
    stored = {}
    for name, array in tensors.items():
        kind, why = stored_type(array, wanted)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        codes = quantize(array, kind, name)
        if kind in ("F32", "F16"):
            writer.add_tensor(name, codes)
        else:
            writer.add_tensor(name, codes, raw_dtype=qtype)
        if dequantized:
            reference[name] = np.ascontiguousarray(gguf.quants.dequantize(codes, qtype).astype(np.float32))
        stored[name] = {"type": kind, "why": why}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if dequantized:
        write_safetensors(path[:-len(".gguf")] + ".dequantized.safetensors", reference)
    return stored


def widen(case_dir, seed):
    """The golden transformer of `case_dir` with WIDEN times its heads, one double and one single
    block, and random weights: (config, diffusers state dict). Every dimension that is a multiple
    of the hidden size grows with it but the sinusoidal timestep inputs (256 channels); each
    tensor is drawn with its golden counterpart's mean and standard deviation, the latter over
    sqrt(WIDEN) where its fan-in grew; tensors of unchanged shape (per-head norms) are kept."""
    import numpy as np
    with open(os.path.join(case_dir, "config.json")) as f:
        config = json.load(f)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    wide = dict(config, num_attention_heads=config["num_attention_heads"] * WIDEN, num_layers=1)
    if "num_single_layers" in config:
        wide["num_single_layers"] = 1
    golden = read_safetensors(os.path.join(case_dir, "diffusion_pytorch_model.safetensors"))
    rng = np.random.default_rng(seed)
    sd = {}
    for name, array in golden.items():
        parts = name.split(".")
        if parts[0] in ("transformer_blocks", "single_transformer_blocks") and parts[1] != "0":
            continue
        sinusoidal = name.endswith("embedder.linear_1.weight")
        shape = [size * WIDEN if size % inner == 0 and not (axis == 1 and sinusoidal) else size
                 for axis, size in enumerate(array.shape)]
        if list(array.shape) == shape:
            sd[name] = array
            continue
        std = float(array.std()) / (np.sqrt(WIDEN) if array.ndim == 2 and shape[1] != array.shape[1] else 1.0)
        sd[name] = rng.normal(float(array.mean()), std, size=shape).astype(np.float32)
    return wide, sd


def write_wide_cases(golden, out):
    """The K-quant cases: each golden transformer widened (widen) and written as fp32 single file,
    config and Q4_K/Q5_K/Q6_K GGUF files with their dequantized values, into out/wide."""
    wide_dir = os.path.join(out, "wide")
    os.makedirs(wide_dir, exist_ok=True)
    cases = {}
    for index, (name, (case, convert, arch)) in enumerate(WIDE.items()):
        config, sd = widen(os.path.join(golden, case), WIDE_SEED + index)
        os.makedirs(os.path.join(wide_dir, name), exist_ok=True)
        with open(os.path.join(wide_dir, name, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        tensors = convert(sd, config)
        write_safetensors(os.path.join(wide_dir, name + ".safetensors"), tensors)
        for wanted in K_TYPES:
            path = os.path.join(wide_dir, "%s.%s.gguf" % (name, wanted.lower()))
            cases[os.path.basename(path)] = write_file(tensors, arch, wanted, path)
    return cases


def write_folder(folder, types, out):
    """A diffusers transformer folder as one GGUF file of types[0] (--folder)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if config.get("_class_name") not in ARCHITECTURES:
        raise SystemExit("%s: _class_name %r is not one of %s" % (folder, config.get("_class_name"),
                                                                  ", ".join(ARCHITECTURES)))
    convert, arch = ARCHITECTURES[config["_class_name"]]
    index = os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json")
    path = index if os.path.exists(index) else os.path.join(folder, "diffusion_pytorch_model.safetensors")
    stored = write_file(convert(read_safetensors(path), config), arch, types[0], out, dequantized=False)
    counts = {}
    for entry in stored.values():
        counts[entry["type"]] = counts.get(entry["type"], 0) + 1
    print("wrote %s: %s" % (out, ", ".join("%d tensors %s" % (n, t) for t, n in sorted(counts.items()))), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", required=True, help="where the virtual environment is kept")
    parser.add_argument("--single-files", help="make_single_file_cases.py's output folder")
    parser.add_argument("--golden", help="the golden set, for the wide K-quant cases")
    parser.add_argument("--folder", help="a diffusers transformer folder to write as one GGUF file (--out FILE)")
    parser.add_argument("--types", default="Q4_K", help="with --folder: the file's type")
    parser.add_argument("--out", required=True, help="the folder to write the GGUF files into (with --folder: the file)")
    parser.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.folder is None and args.single_files is None:
        parser.error("give --single-files (the test cases) or --folder")
    if not args.in_venv:
        python = venv_python(args.venv)
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:], "--in-venv"])
    if args.folder is not None:
        write_folder(args.folder, args.types.split(","), args.out)
        return
    os.makedirs(args.out, exist_ok=True)
    cases = {}
    for name, arch in FILES.items():
        tensors = read_safetensors(os.path.join(args.single_files, name + ".safetensors"))
        for wanted in TYPES:
            path = os.path.join(args.out, "%s.%s.gguf" % (name, wanted.lower()))
            cases[os.path.basename(path)] = write_file(tensors, arch, wanted, path)
    if args.golden is not None:
        cases.update({"wide/" + name: entry for name, entry in write_wide_cases(args.golden, args.out).items()})
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump({"files": cases}, f, indent=1)
    print("wrote %d GGUF files into %s" % (len(cases), args.out), flush=True)


if __name__ == "__main__":
    main()
