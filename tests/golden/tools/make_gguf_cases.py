#!/usr/bin/env python3
"""Writes the GGUF reference cases of tests/unit/test_gguf_reference.cpp with gguf-py itself.

Installs the pinned gguf-py release (requirements-gguf.txt, beside this file) into a virtual
environment kept in the build folder (once; later runs reuse it), then writes into --out:
  cases.gguf             tensors of every type below, in several shapes (rows that are not a power
                         of two, one and several rows, one and several blocks per row, a 3-D tensor),
                         and metadata of several value types, written by gguf.GGUFWriter;
  reference.safetensors  for every tensor, gguf.quants.dequantize's float32 values (Q8_K, which
                         gguf-py cannot dequantize, is computed by the format's definition: the
                         block's float32 scale times each int8 code, in NumPy float32);
  cases.json             each tensor's type, shape and how its codes were made, and the metadata.
Codes: gguf.quants.quantize where gguf-py has a quantizer (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0); random bytes with valid (finite, positive) scales where it has none (Q4_K, Q5_K, Q6_K, Q8_K).

Exit codes: 0 written, 1 failed, 77 skipped (only when PyPI cannot be reached to make the
environment, with the reason).
"""
import argparse
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "support"))
from pinned_venv import pinned_python  # noqa: E402

REQUIREMENTS = os.path.join(HERE, "requirements-gguf.txt")


def pins():
    with open(REQUIREMENTS) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return dict(line.split("==") for line in lines if line)


def venv_python(venv):
    """The venv's python with the pinned packages; exits 77 when PyPI is out of reach."""
    wanted = pins()
    check = ("import gguf, numpy, sys, importlib.metadata as m; "
             f"sys.exit(m.version('gguf') != '{wanted['gguf']}' or numpy.__version__ != '{wanted['numpy']}')")
    return pinned_python(venv, check, ["-r", REQUIREMENTS], "gguf-py", "gguf")


# Torch-order shapes [.., rows, row length] per block size: one row and several, rows that are not
# a power of two (12 rows split at TP 1-4, 5 rows at TP 1 only), 1 to 12 blocks per row (12 split at
# TP 1-4; 5, 3 and 4 refuse some degrees), a 3-D tensor (its rows are the outer dimensions' product).
SHAPES = {
    1: [[1, 8], [12, 10], [5, 33], [4, 36]],
    32: [[1, 32], [12, 96], [5, 160], [6, 384], [2, 6, 64]],
    256: [[1, 256], [5, 768], [12, 1024], [4, 3072]],
}
QUANTIZED = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
RANDOM_CODES = ["Q4_K", "Q5_K", "Q6_K", "Q8_K"]


def make_cases(out):
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(20260)
    writer = gguf.GGUFWriter(os.path.join(out, "cases.gguf"), arch="flux")
    metadata = {"general.name": "shardit gguf reference", "shardit.rows": [3, 5, 7],
                "shardit.scale": 0.125, "shardit.flag": True, "shardit.names": ["a", "bc"]}
    writer.add_string("general.name", metadata["general.name"])
    writer.add_array("shardit.rows", metadata["shardit.rows"])
    writer.add_float32("shardit.scale", metadata["shardit.scale"])
    writer.add_bool("shardit.flag", metadata["shardit.flag"])
    writer.add_array("shardit.names", metadata["shardit.names"])
    reference = {}
    cases = []
    for type_name in QUANTIZED + RANDOM_CODES:
        qtype = getattr(T, type_name)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        for shape in SHAPES[block]:
            name = f"{type_name.lower()}.{'x'.join(map(str, shape))}.weight"
            if type_name in QUANTIZED:
                # Weights of a trained layer's range, with a few outliers and an all-zero block.
                values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
                values.reshape(-1)[:: 97] *= 20
                values.reshape(-1)[: min(block, values.size)] = 0
                codes = gguf.quants.quantize(values, qtype)
                made = "gguf.quants.quantize"
            else:
                blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block, type_size), dtype=np.uint8)
                if type_name == "Q8_K":
                    scale = rng.uniform(1e-4, 1e-2, size=(blocks.shape[0], 1)).astype(np.float32)
                    blocks[:, 0:4] = scale.view(np.uint8)
                    qs = blocks[:, 4:260].view(np.int8).astype(np.int16)
                    blocks[:, 260:292] = qs.reshape(-1, 16, 16).sum(axis=2).astype(np.int16).view(np.uint8)
                else:
                    at = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[type_name]
                    for offset in at:
                        scale = rng.uniform(1e-4, 1e-2, size=(blocks.shape[0], 1)).astype(np.float16)
                        blocks[:, offset:offset + 2] = scale.view(np.uint8)
                codes = blocks.reshape(*shape[:-1], shape[-1] // block * type_size)
                made = "random codes, valid scales"
            if type_name == "Q8_K":
                blocks = codes.reshape(-1, type_size)
                d = blocks[:, 0:4].copy().view(np.float32)
                values = (d * blocks[:, 4:260].view(np.int8).astype(np.float32)).reshape(shape)
                dequantized_by = "numpy float32 (gguf-py has no Q8_K dequantizer)"
            else:
                values = gguf.quants.dequantize(codes, qtype)
                dequantized_by = "gguf.quants.dequantize"
            assert values.dtype == np.float32 and list(values.shape) == shape, (name, values.shape)
            if type_name in ("F32", "F16"):
                writer.add_tensor(name, codes)
            else:
                writer.add_tensor(name, codes, raw_dtype=qtype)
            reference[name] = np.ascontiguousarray(values)
            cases.append({"name": name, "type": type_name, "shape": shape, "codes": made,
                          "dequantized_by": dequantized_by})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_safetensors(os.path.join(out, "reference.safetensors"), reference)
    versions = {"gguf": gguf.__version__ if hasattr(gguf, "__version__") else pins()["gguf"],
                "numpy": np.__version__}
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"versions": versions, "metadata": metadata, "cases": cases}, f, indent=1)


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", required=True, help="where the virtual environment is kept")
    parser.add_argument("--out", help="the folder to write the cases into (required unless --only-venv)")
    parser.add_argument("--only-venv", action="store_true",
                        help="make (or check) the virtual environment, then stop (scripts/test.sh, during the build)")
    parser.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.only_venv and args.out is None:
        parser.error("--out is required")
    if not args.in_venv:
        python = venv_python(args.venv)
        if args.only_venv:
            sys.exit(0)
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:], "--in-venv"])
    os.makedirs(args.out, exist_ok=True)
    make_cases(args.out)
    print(f"wrote {args.out}/cases.gguf, reference.safetensors and cases.json", flush=True)


if __name__ == "__main__":
    main()
