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

TYPES: F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: every type gguf-py 0.19.0 can quantize. Q4_K,
Q5_K and Q6_K are skipped: gguf-py only dequantizes them (gguf.quants raises NotImplementedError
for their quantize), and the K-quant loader is exercised by the memory benchmark's files of random
codes instead (docs/checkpoints.md).

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

FILES = {"flux1_bfl": "flux", "flux2_bfl": "flux", "qwenimage_comfyui": "qwen_image", "pipeline_flux1_bfl": "flux"}
TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
SMALL = 1024  # city96's QUANTIZATION_THRESHOLD: tensors of at most this many elements stay F32


def read_safetensors(path):
    """name -> float32 numpy array, in file order (the single files are F32)."""
    import numpy as np
    with open(path, "rb") as f:
        data = f.read()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    base = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "F32", (path, name, entry["dtype"])
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[base + begin:base + end], dtype=np.float32).reshape(entry["shape"])
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


def write_file(tensors, arch, wanted, path):
    import numpy as np
    import gguf
    writer = gguf.GGUFWriter(path, arch=arch)
    reference = {}
    stored = {}
    for name, array in tensors.items():
        kind, why = stored_type(array, wanted)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        codes = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
        if kind in ("F32", "F16"):
            writer.add_tensor(name, codes)
        else:
            writer.add_tensor(name, codes, raw_dtype=qtype)
        reference[name] = np.ascontiguousarray(gguf.quants.dequantize(codes, qtype).astype(np.float32))
        stored[name] = {"type": kind, "why": why}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_safetensors(path[:-len(".gguf")] + ".dequantized.safetensors", reference)
    return stored


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", required=True, help="where the virtual environment is kept")
    parser.add_argument("--single-files", required=True, help="make_single_file_cases.py's output folder")
    parser.add_argument("--out", required=True, help="the folder to write the GGUF files into")
    parser.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.in_venv:
        python = venv_python(args.venv)
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:], "--in-venv"])
    os.makedirs(args.out, exist_ok=True)
    cases = {}
    for name, arch in FILES.items():
        tensors = read_safetensors(os.path.join(args.single_files, name + ".safetensors"))
        for wanted in TYPES:
            path = os.path.join(args.out, "%s.%s.gguf" % (name, wanted.lower()))
            cases[os.path.basename(path)] = write_file(tensors, arch, wanted, path)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump({"skipped_types": {"Q4_K": "gguf-py cannot quantize", "Q5_K": "gguf-py cannot quantize",
                                     "Q6_K": "gguf-py cannot quantize"}, "files": cases}, f, indent=1)
    print("wrote %d GGUF files into %s" % (len(cases), args.out), flush=True)


if __name__ == "__main__":
    main()
